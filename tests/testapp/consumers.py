"""Handlers the suite drives, including through real ``manage.py consume`` subprocesses.

Each handler records an :class:`Effect` and then behaves as the payload asks, per consumer label:
``{"fail": {"alpha": 2}}`` fails the first two attempts of alpha, ``{"permanent": {"alpha": 1}}``
raises PermanentError, ``{"sleep": {"alpha": 1.5}}`` sleeps, ``{"require": "field"}`` reads a
field that may be missing (KeyError), ``{"crash_after_commit": {"alpha": 1}}`` kills the process
with SIGKILL after the commit and before the ack (first delivery only),
``{"broken_while_env": {"alpha": "VAR"}}`` fails permanently while the process has VAR set.
Poison pills (issue 18): ``{"kill": {"alpha": true}}`` kills the process with SIGKILL on every
delivery, ``{"kill_once": {"alpha": true}}`` only on the first (not redelivered) one, and
``{"spin": {"alpha": 30}}`` busy-loops in pure Python for that many seconds (``sleep`` blocks in
C instead), and ``{"kill_while": {"alpha": "name"}}`` kills it on every delivery while an
``Effect`` row of consumer ``switch`` with that message_id exists (the test deletes it: the
fix). The effect rolls back whenever the handler raises or its process dies.
Database conflicts (issue 33): ``{"lock": {"alpha": ["hot-1", "hot-2"]}, "lock_pause": 0.05}``
locks those hot rows (``Effect`` rows of consumer ``hot``, made by the test) in that order with
``SELECT ... FOR UPDATE``, pausing after each, and counts itself in them (two handlers with the
opposite orders deadlock); ``{"conflict": {"alpha": 2}}`` has the server raise a serialization
failure (SQLSTATE 40001) on the first two runs of the message in this process (``-1``: always);
``{"break_at_commit": {"alpha": true}}`` writes twice the same key into ``rm_test_deferred``
(made by the test, its key unique and checked at commit), so the commit is refused.
Tracing: ``{"fail_while": {"alpha": "name"}}`` fails (a transient error) while an ``Effect`` row
of consumer ``switch`` with that message_id exists (the test deletes it to deploy the fix), and
``{"publish": {"alpha": "order.shipped"}}`` publishes a message with that routing key.
Circuit breaker (issue 39): with ``RM_TEST_DOWNSTREAM_URL`` set, ``tests.payments`` calls that
HTTP server (a "payment provider" the test stops and starts) and has a small breaker;
``tests.ordered_payments`` (``opay.*``) is the same, ordered by its ordering key.

Expiry: ``tests.delta`` and ``tests.epsilon`` (``late.*``) have a max_age of 2 s (delta's is
``RM_TEST_LATE_MAX_AGE`` seconds in a process with it set); in a process with
``RM_TEST_LATE_RETRY_DELAY`` set, they retry after that many seconds (the suite's delays
otherwise, which the system checks of this process judge).

In-process tests: ``{"hold": {"alpha": "name"}}`` waits (up to 60 s) until the test sets
``GATES["name"]``, so the test decides when the handler ends.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import urllib.request

from django.db import connection, transaction
from django.db.models import F

from reliable_messaging import Breaker, Message, PermanentError, consumer, publish

from .models import Effect

GATES: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)

NAMESPACE = os.environ["RM_TEST_NAMESPACE"]

# Runs of each (label, message_id) asked to meet a serialization failure, in this process.
CONFLICT_RUNS: dict[tuple[str, str], int] = {}


def lock_hot_rows(names: list[str], pause: float) -> None:
    for name in names:
        Effect.objects.select_for_update().get(consumer="hot", message_id=name)
        Effect.objects.filter(consumer="hot", message_id=name).update(attempt=F("attempt") + 1)
        time.sleep(pause)


def serialization_failure(label: str, message_id: str, times: int) -> None:
    key = (label, message_id)
    CONFLICT_RUNS[key] = CONFLICT_RUNS.get(key, 0) + 1
    if times < 0 or CONFLICT_RUNS[key] <= times:
        with connection.cursor() as cursor:
            cursor.execute(
                "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access (test)' "
                "USING ERRCODE = '40001'; END $$"
            )


def behave(label: str, message: Message) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    Effect.objects.create(
        consumer=label,
        message_id=message.message_id,
        attempt=message.attempt,
        payload=message.payload,
    )
    if payload.get("crash_after_commit", {}).get(label) and not message.redelivered:
        # Dies right after the commit, before the ack can be sent: a real crash in the window
        # the inbox exists for.
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
    if payload.get("kill", {}).get(label):
        # A poison pill: takes its whole process down, inside the handler's transaction, on
        # every delivery; nothing our code could catch.
        os.kill(os.getpid(), signal.SIGKILL)
    if payload.get("kill_once", {}).get(label) and not message.redelivered:
        # Dies on the first delivery only; the redelivery succeeds.
        os.kill(os.getpid(), signal.SIGKILL)
    kill_switch = payload.get("kill_while", {}).get(label)
    if kill_switch and Effect.objects.filter(consumer="switch", message_id=kill_switch).exists():
        # A poison pill until its fix is deployed (the test deletes the switch row).
        os.kill(os.getpid(), signal.SIGKILL)
    hot = payload.get("lock", {}).get(label)
    if hot:
        lock_hot_rows(list(hot), float(payload.get("lock_pause", 0.0)))
    conflicts = payload.get("conflict", {}).get(label)
    if conflicts:
        serialization_failure(label, message.message_id, int(conflicts))
    if payload.get("break_at_commit", {}).get(label):
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO rm_test_deferred (k) VALUES (1), (1)")
    gate = payload.get("hold", {}).get(label)
    if gate:
        GATES[gate].wait(60)
    sleep = payload.get("sleep", {}).get(label)
    if sleep:
        time.sleep(float(sleep))
    spin = payload.get("spin", {}).get(label)
    if spin:
        # Busy in Python bytecode, so an exception raised asynchronously in this thread lands.
        deadline = time.monotonic() + float(spin)
        while time.monotonic() < deadline:
            pass
    broken_by = payload.get("broken_while_env", {}).get(label)
    if broken_by and os.environ.get(broken_by):
        # A bug in this deploy (the environment variable is set): fixed by restarting without.
        raise PermanentError(f"{label} is broken in this deploy ({broken_by} is set)")
    if payload.get("permanent", {}).get(label):
        raise PermanentError(f"{label} refuses this message for good")
    failures = payload.get("fail", {}).get(label, 0)
    if message.attempt <= failures:
        raise RuntimeError(f"{label}: transient failure on attempt {message.attempt}")
    if "require" in payload:
        payload["fields"][payload["require"]]  # KeyError when the field is missing
    switch = payload.get("fail_while", {}).get(label)
    if switch and Effect.objects.filter(consumer="switch", message_id=switch).exists():
        raise RuntimeError(f"{label}: failing while switch {switch!r} is on")
    then = payload.get("publish", {}).get(label)
    if then:
        publish(then, {"after": message.message_id}, message_id=f"{message.message_id}.{label}")


@consumer(f"{NAMESPACE}.alpha", bindings=["order.*"], name="tests.alpha")
def alpha(message: Message) -> None:
    behave("alpha", message)


@consumer(f"{NAMESPACE}.beta", bindings=["order.*"], name="tests.beta")
def beta(message: Message) -> None:
    behave("beta", message)


@consumer(f"{NAMESPACE}.gamma", bindings=["seq.*"], name="tests.gamma", ordered=True)
def gamma(message: Message) -> None:
    """Ordered: the payload's ``key`` is also the ordering key, ``seq`` its place in the key."""
    behave("gamma", message)


DOWNSTREAM_URL = os.environ.get("RM_TEST_DOWNSTREAM_URL")
if DOWNSTREAM_URL:
    # Only in the processes of the breaker's tests: the others consume no such queue.

    def charge(label: str, message: Message) -> None:
        """Charges through the provider; fails (connection refused) while it is down."""
        with urllib.request.urlopen(f"{DOWNSTREAM_URL}/{message.message_id}", timeout=5) as reply:
            reply.read()
        Effect.objects.create(
            consumer=label,
            message_id=message.message_id,
            attempt=message.attempt,
            payload=message.payload,
        )

    @consumer(
        f"{NAMESPACE}.payments",
        bindings=["payment.*"],
        name="tests.payments",
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=1.0, probes=2),
    )
    def payments(message: Message) -> None:
        charge("payments", message)

    @consumer(
        f"{NAMESPACE}.opayments",
        bindings=["opay.*"],
        name="tests.ordered_payments",
        ordered=True,
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=1.0, probes=2),
    )
    def ordered_payments(message: Message) -> None:
        """The same provider, ordered by the payload's ``key`` (the ordering key)."""
        charge("opayments", message)


# Expiry (issue 39): a message over 2 s old is not handled; epsilon keeps it as a dead letter.
# A retry delay longer than that makes the attempt after a failure always too late.
LATE_RETRY_DELAYS = (
    [float(os.environ["RM_TEST_LATE_RETRY_DELAY"])]
    if os.environ.get("RM_TEST_LATE_RETRY_DELAY")
    else None
)
# In a process with RM_TEST_LATE_MAX_AGE set, delta's max_age is that many seconds instead.
DELTA_MAX_AGE = float(os.environ.get("RM_TEST_LATE_MAX_AGE") or 2.0)


@consumer(
    f"{NAMESPACE}.delta",
    bindings=["late.*"],
    name="tests.delta",
    max_age=DELTA_MAX_AGE,
    retry_delays=LATE_RETRY_DELAYS,
)
def delta(message: Message) -> None:
    behave("delta", message)


@consumer(
    f"{NAMESPACE}.epsilon",
    bindings=["late.*"],
    name="tests.epsilon",
    max_age=2.0,
    on_expiry="dead_letter",
    retry_delays=LATE_RETRY_DELAYS,
)
def epsilon(message: Message) -> None:
    behave("epsilon", message)


if os.environ.get("RM_TEST_EXTRA_CONSUMER"):
    # A handler a later deploy adds (tests/e2e/test_relay_declares_topology.py): registered
    # only in the processes of that deploy, which set the variable.
    @consumer(f"{NAMESPACE}.zeta", bindings=["invoice.*"], name="tests.zeta")
    def zeta(message: Message) -> None:
        behave("zeta", message)


if os.environ.get("RM_TEST_ASYNC_CONSUMERS"):
    # The async def handler of tests/integration/consuming/test_async_handlers.py (issue 47),
    # only in the processes of those tests.
    from .async_handling import ASYNC_CONSUMER, handle

    @consumer(f"{NAMESPACE}.async", bindings=["async.*"], name=ASYNC_CONSUMER, timeout=1)
    async def async_handler(message: Message) -> None:
        await handle(message)


if os.environ.get("RM_TEST_TASK_SIGNALS"):
    # The processes of the task tests that count the task signals a process sent.
    from .task_signals import record_task_signals

    record_task_signals()
