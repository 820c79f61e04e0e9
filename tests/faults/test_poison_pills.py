"""Issue 18, a delivery that never finishes: poison pills against real ``manage.py consume``
processes under a supervisor that restarts them (see supervisor.py).

A message whose handler kills its process (``SIGKILL``: the OOM killer, a segfault) comes back
redelivered to the next process, which dies the same way: under a supervisor, a crash loop that
also starves every message behind it. The crash guard breaks it: after ``CRASH_LIMIT`` deaths the
delivery becomes a dead letter (reason ``worker_crashed``) and is acked. A handler that runs
past its time limit is interrupted when it spins in Python (retried, then a dead letter with
reason ``timeout``, the process alive), and makes its process exit when it is blocked in C (the
guard charges those exits; reason ``timeout`` too).

Every test publishes the poison pill first and good messages behind it (for the crash loops, as
a backlog before the supervised process starts), so the good ones are prefetched by the process
that dies and come back redelivered with it. They must be handled exactly once (one ``Effect``
row each), none lost, none dead-lettered: an innocent neighbour is never blamed for a death, on
classic queues and on quorum queues (whose ``x-delivery-limit`` would otherwise drop them).

Each test has a vhost of its own (the ``rig`` fixture of tests/faults/conftest.py), deleted with
every queue in it afterwards; the consume logs are attached to a failed test's report, and the
failure messages carry their tails.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from reliable_messaging.models import DeadLetter, SuspectDelivery
from tests import support
from tests.support import ConsumeProcess, ManageProcess, Publisher, wait_until
from tests.testapp.models import Effect

from .harness import FaultRig
from .supervisor import Supervisor, SupervisorGaveUp

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(150)]

ROUTING_KEY = "order.placed"
LABEL = "alpha"  # the Effect rows' consumer label (tests/testapp/consumers.py)
CONSUMER = "tests.alpha"  # the DeadLetter rows' consumer name
BAD_ID = "pill-bad"
MAX_ATTEMPTS = 3  # tests/settings.py
TIMED_OUT_EXIT_CODE = 3  # consume's exit code when a handler cannot be interrupted
LOSS_CHECK_EVERY = 5.0  # seconds between two looks for lost messages while waiting


class PoisonRun:
    """One test's backlog (a poison pill, good messages behind it) and its consume processes,
    all with the same environment, in the rig's vhost."""

    def __init__(self, rig: FaultRig, **env: str) -> None:
        self.rig = rig
        self.env = env
        self.queue = rig.queues[LABEL]
        self.bad_body = b""
        self.good_ids: list[str] = []

    def start_consume(self, *args: str) -> ConsumeProcess:
        """``manage.py consume --queue <alpha> ARGS``, not waited for (it may die at once)."""
        name = f"rmpill-{self.rig.ns}-consume-{len(self.rig.processes) + 1}"
        proc = ConsumeProcess(
            ["--queue", self.queue, *args],
            self.rig.env(name, **self.env),
            self.rig.tmp_path / f"{name}.log",
        )
        self.rig.processes.append(proc)  # killed by the rig, its log attached to the report
        return proc

    def publish(self, bad_payload: dict[str, Any], good: int) -> None:
        """The poison pill first, ``good`` ordinary messages behind it (confirmed by the broker)."""
        self.bad_body = json.dumps(bad_payload).encode()
        self.good_ids = [f"pill-good-{n:02d}" for n in range(good)]
        publisher = Publisher(self.rig.vhost)
        try:
            publisher.publish(self.rig.exchange, ROUTING_KEY, body=self.bad_body, message_id=BAD_ID)
            for n, message_id in enumerate(self.good_ids):
                publisher.publish(self.rig.exchange, ROUTING_KEY, {"n": n}, message_id=message_id)
        finally:
            publisher.close()

    def publish_pill_again(self) -> None:
        """A second, fresh copy of the pill (as a relay that died before recording it sent
        would send it again)."""
        publisher = Publisher(self.rig.vhost)
        try:
            publisher.publish(self.rig.exchange, ROUTING_KEY, body=self.bad_body, message_id=BAD_ID)
        finally:
            publisher.close()

    def publish_backlog(self, bad_payload: dict[str, Any], good: int) -> None:
        """Publish while nobody consumes, so the first supervised process takes the whole backlog
        into its prefetch: the good messages are in flight at every death and come back
        redelivered with the pill each time. A consume process declares the exchange and the
        queue first (with the arguments the supervised ones use) and leaves them empty: it exits
        after 1 s without a delivery."""
        proc = self.start_consume("--idle-timeout", "1")
        assert proc.wait(60) == 0, f"the declaring consume process failed:\n{proc.log()}"
        self.publish(bad_payload, good)
        # A quorum queue's counts reach rabbitmqctl a moment after the confirms.
        wait_until(
            lambda: support.queue_counts(self.queue, self.rig.vhost) == (good + 1, 0),
            timeout=15,
            interval=0.2,
            message=lambda: f"{good + 1} messages ready in {self.queue}",
        )

    def supervise(self, *args: str, max_restarts: int) -> Supervisor[ConsumeProcess]:
        supervisor = Supervisor(lambda: self.start_consume(*args), max_restarts=max_restarts)
        supervisor.start()
        return supervisor

    # -- what happened -----------------------------------------------------------------------

    def effects(self) -> Counter[str]:
        return Counter(
            Effect.objects.filter(
                consumer=LABEL, message_id__in=[BAD_ID, *self.good_ids]
            ).values_list("message_id", flat=True)
        )

    def dead_letters(self) -> dict[str, DeadLetter]:
        return {
            letter.message_id: letter for letter in DeadLetter.objects.filter(consumer=CONSUMER)
        }

    def goods_handled(self) -> bool:
        effects = self.effects()
        return all(effects[m] for m in self.good_ids)

    def drained(self) -> bool:
        """No message left in any queue of the vhost, ready or unacked."""
        counts = support.all_queue_counts(self.rig.vhost)
        return self.queue in counts and all(c == (0, 0) for c in counts.values())

    def summary(self) -> str:
        effects = self.effects()
        missing = [m for m in self.good_ids if not effects[m]]
        doubled = {m: n for m, n in effects.items() if n > 1}
        letters = [
            (m, d.reason, d.attempts, d.exception_message[:200])
            for m, d in self.dead_letters().items()
        ]
        suspects = list(
            SuspectDelivery.objects.values_list("message_id", "deaths", "running", "last_cause")
        )
        busy = {q: c for q, c in support.all_queue_counts(self.rig.vhost).items() if c != (0, 0)}
        return (
            f"good messages without an effect {len(missing)}/{len(self.good_ids)} {missing[:5]}; "
            f"effects of the pill {effects[BAD_ID]}; doubled {doubled}; dead letters {letters}; "
            f"suspect rows {suspects}; queues not drained {busy}"
        )

    def context(self, supervisor: Supervisor[ConsumeProcess]) -> str:
        """Where things stand, for a failure message (only built when an assertion fails)."""
        return f"{self.summary()}\n{supervisor.report()}"

    def wait(
        self,
        predicate: Callable[[], bool],
        what: str,
        timeout: float,
        supervisor: Supervisor,
    ) -> None:
        """Wait for ``predicate``; fail at once if the supervisor gives up, and on a timeout
        say where things stand, with every process's exit code and log tail."""

        next_loss_check = time.monotonic() + LOSS_CHECK_EVERY

        def done() -> bool:
            nonlocal next_loss_check
            try:
                supervisor.check()
            except SupervisorGaveUp as exc:
                raise SupervisorGaveUp(
                    f"while waiting for {what}: {exc}\n{self.summary()}"
                ) from None
            if predicate():
                return True
            if time.monotonic() >= next_loss_check:
                self.assert_nothing_lost(supervisor)
                next_loss_check = time.monotonic() + LOSS_CHECK_EVERY
            return False

        wait_until(
            done,
            timeout=timeout,
            interval=0.2,
            message=lambda: f"{what}\n{self.summary()}\n{supervisor.report()}",
        )

    def assert_nothing_lost(self, supervisor: Supervisor) -> None:
        """Fail at once (not at the end of a long wait) when every queue of the vhost is empty
        but good messages never took effect: the broker dropped them (a quorum queue's delivery
        limit) or they were acked without their effect."""
        if self.goods_handled() or not self.drained():
            return
        time.sleep(1.0)  # a retry copy may be between the outbox and its queue
        if self.drained() and not self.goods_handled():
            raise AssertionError(
                f"good messages lost: every queue is empty but they never took effect\n"
                f"{self.summary()}\n{supervisor.report()}"
            )

    def settle(self, supervisor: Supervisor, timeout: float) -> None:
        """Wait until the pill is a dead letter, every good message took effect and every
        queue is drained."""
        self.wait(
            lambda: (
                BAD_ID in self.dead_letters()
                and self.goods_handled()
                and self.drained()  # last: a rabbitmqctl call
            ),
            "the pill dead-lettered, every good message handled, every queue drained",
            timeout,
            supervisor,
        )

    def assert_quiet(self, supervisor: Supervisor, seconds: float = 1.0) -> None:
        """Once settled, nothing more happens: no restart, no new effect, the process alive."""
        restarts, effects = supervisor.restarts, self.effects()
        time.sleep(seconds)
        assert supervisor.restarts == restarts, supervisor.report()
        assert supervisor.current.returncode is None, (
            f"the last consume process exited\n{supervisor.report()}"
        )
        assert self.effects() == effects, self.summary()

    def assert_neighbours_handled_once(self, supervisor: Supervisor) -> None:
        """Every good message took effect exactly once and none is a dead letter; the pill's
        own effect always rolled back."""
        effects = self.effects()
        assert {m: effects[m] for m in self.good_ids} == dict.fromkeys(self.good_ids, 1), (
            self.context(supervisor)
        )
        blamed = sorted(set(self.dead_letters()) & set(self.good_ids))
        assert not blamed, (
            f"innocent neighbours dead-lettered: {blamed}\n{self.context(supervisor)}"
        )
        assert effects[BAD_ID] == 0, self.context(supervisor)


def exited_on_purpose(proc: ManageProcess) -> bool:
    """The process logged an error naming the pill before exiting."""
    return any(
        (" ERROR " in line or " CRITICAL " in line) and BAD_ID in line
        for line in proc.log().splitlines()
    )


# --------------------------------------------------------------------------- crash loops


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_message_that_kills_its_process_becomes_a_dead_letter(
    rig: FaultRig, queue_type: str
) -> None:
    crash_limit = 3
    env = {"RM_TEST_CRASH_LIMIT": str(crash_limit)}
    if queue_type == "quorum":
        # A delivery limit as low as the crash limit: the broker must not drop the neighbours
        # that came back with the pill each time its process died.
        env |= {"RM_TEST_QUEUE_TYPE": "quorum", "RM_TEST_QUORUM_DELIVERY_LIMIT": "3"}
    run = PoisonRun(rig, **env)
    run.publish_backlog({"kill": {LABEL: True}}, good=20)
    if queue_type == "quorum":
        arguments = support.queue_arguments(run.queue, rig.vhost) or {}
        assert arguments.get("x-queue-type") == "quorum", arguments
    supervisor = run.supervise(max_restarts=crash_limit + 3)
    try:
        run.settle(supervisor, timeout=90)
        run.assert_quiet(supervisor)
        # Died CRASH_LIMIT times on it, each restarted; the last process lives on.
        assert supervisor.restarts == crash_limit, run.context(supervisor)
        assert supervisor.exit_codes == [-signal.SIGKILL] * crash_limit, run.context(supervisor)
        letter = run.dead_letters()[BAD_ID]
        assert letter.reason == "worker_crashed", run.context(supervisor)
        assert letter.attempts == crash_limit, run.context(supervisor)
        assert bytes(letter.body) == run.bad_body, run.context(supervisor)
        last_to_die = supervisor.processes[-2].pid
        assert str(crash_limit) in letter.exception_message, letter.exception_message
        assert str(last_to_die) in letter.exception_message, (
            f"the dead letter does not name the last process that died (pid {last_to_die}): "
            f"{letter.exception_message!r}"
        )
        run.assert_neighbours_handled_once(supervisor)
        assert set(run.dead_letters()) == {BAD_ID}, run.context(supervisor)
        support.no_suspect_left(lambda: run.context(supervisor))
    finally:
        supervisor.stop()


@pytest.mark.skipif(
    support.BROKER.name != "rabbitmq3",
    reason="the crash guard's count is the database's, the same on every broker: once, on 3.10",
)
def test_a_second_copy_of_a_dead_lettered_killer_costs_one_death_not_crash_limit(
    rig: FaultRig,
) -> None:
    """The copy runs fresh and kills one process (the guard watches redeliveries only); its
    redelivery counts the dead letter's deaths and is dead-lettered without running again."""
    crash_limit = 2
    run = PoisonRun(rig, RM_TEST_CRASH_LIMIT=str(crash_limit))
    run.publish_backlog({"kill": {LABEL: True}}, good=3)
    supervisor = run.supervise(max_restarts=2 * crash_limit + 2)
    try:
        run.settle(supervisor, timeout=90)
        assert supervisor.restarts == crash_limit, run.context(supervisor)
        first_letter = run.dead_letters()[BAD_ID].last_failed_at
        run.publish_pill_again()
        run.wait(
            lambda: run.dead_letters()[BAD_ID].last_failed_at > first_letter and run.drained(),
            "the second copy dead-lettered and the queue drained",
            60,
            supervisor,
        )
        run.assert_quiet(supervisor, seconds=2.0)
        assert supervisor.restarts == crash_limit + 1, run.context(supervisor)
        letter = run.dead_letters()[BAD_ID]
        assert (letter.reason, letter.attempts) == ("worker_crashed", crash_limit + 1), run.context(
            supervisor
        )
        assert f"{crash_limit + 1} time(s)" in letter.exception_message, letter.exception_message
        run.assert_neighbours_handled_once(supervisor)
        support.no_suspect_left(lambda: run.context(supervisor))
    finally:
        supervisor.stop()


def test_a_message_that_kills_its_process_once_is_handled_on_redelivery(rig: FaultRig) -> None:
    run = PoisonRun(rig, RM_TEST_CRASH_LIMIT="3")
    supervisor = run.supervise(max_restarts=3)
    try:
        supervisor.current.wait_consuming(60)
        # The good messages reach the process while it handles the pill.
        run.publish({"kill_once": {LABEL: True}}, good=5)
        run.wait(
            lambda: run.effects()[BAD_ID] >= 1 and run.goods_handled() and run.drained(),
            "the pill handled on its redelivery, every good message handled, the queue drained",
            60,
            supervisor,
        )
        run.assert_quiet(supervisor)
        assert supervisor.restarts == 1, run.context(supervisor)
        assert supervisor.exit_codes == [-signal.SIGKILL], run.context(supervisor)
        assert run.effects()[BAD_ID] == 1, run.context(supervisor)
        assert not run.dead_letters(), run.context(supervisor)
        effects = run.effects()
        handled = {m: effects[m] for m in run.good_ids}
        assert handled == dict.fromkeys(run.good_ids, 1), run.context(supervisor)
        support.no_suspect_left(lambda: run.context(supervisor))
    finally:
        supervisor.stop()


# --------------------------------------------------------------------------- time limits


def test_a_handler_spinning_past_its_time_limit_is_interrupted(rig: FaultRig) -> None:
    run = PoisonRun(rig, RM_TEST_HANDLER_TIMEOUT="1")
    supervisor = run.supervise(max_restarts=2)
    try:
        supervisor.current.wait_consuming(60)
        # The good messages reach the process while it handles the pill.
        run.publish({"spin": {LABEL: 30}}, good=5)
        # Interrupted after 1 s and retried through the outbox: the messages behind it
        # are not held for the 30 s it would spin.
        run.wait(
            run.goods_handled,
            "the good messages handled while the pill spins (interrupted after 1 s)",
            15,
            supervisor,
        )
        run.settle(supervisor, timeout=30)
        run.assert_quiet(supervisor)
        assert supervisor.restarts == 0 and not supervisor.exit_codes, run.context(supervisor)
        letter = run.dead_letters()[BAD_ID]
        assert letter.reason == "timeout", run.context(supervisor)
        assert letter.attempts == MAX_ATTEMPTS, run.context(supervisor)
        assert bytes(letter.body) == run.bad_body, run.context(supervisor)
        run.assert_neighbours_handled_once(supervisor)
        assert set(run.dead_letters()) == {BAD_ID}, run.context(supervisor)
    finally:
        supervisor.stop()


def test_a_handler_blocked_past_its_time_limit_exits_and_is_dead_lettered(rig: FaultRig) -> None:
    crash_limit = 2
    run = PoisonRun(
        rig,
        RM_TEST_HANDLER_TIMEOUT="1",
        RM_TEST_HANDLER_TIMEOUT_GRACE="1",
        RM_TEST_CRASH_LIMIT=str(crash_limit),
    )
    supervisor = run.supervise(max_restarts=crash_limit + 3)
    try:
        supervisor.current.wait_consuming(60)
        # The good messages reach the process while it handles the pill.
        run.publish({"sleep": {LABEL: 1000}}, good=5)
        # time.sleep cannot be interrupted: 1 s of limit and 1 s of grace later the process
        # gives up on itself and exits.
        run.wait(
            lambda: bool(supervisor.exit_codes),
            "the consume process to exit past the handler's time limit and its grace",
            20,
            supervisor,
        )
        run.settle(supervisor, timeout=60)
        run.assert_quiet(supervisor)
        assert supervisor.restarts == crash_limit, run.context(supervisor)
        assert supervisor.exit_codes == [TIMED_OUT_EXIT_CODE] * crash_limit, run.context(supervisor)
        for proc in supervisor.processes[:-1]:
            assert exited_on_purpose(proc), (
                f"pid {proc.pid} exited without an ERROR line naming {BAD_ID}:\n{proc.log()}"
            )
        letter = run.dead_letters()[BAD_ID]
        assert letter.reason == "timeout", run.context(supervisor)
        assert letter.attempts == crash_limit, run.context(supervisor)
        assert bytes(letter.body) == run.bad_body, run.context(supervisor)
        run.assert_neighbours_handled_once(supervisor)
        assert set(run.dead_letters()) == {BAD_ID}, run.context(supervisor)
        support.no_suspect_left(lambda: run.context(supervisor))
    finally:
        supervisor.stop()


def healthz(port: int) -> tuple[int, Any]:
    """(status, JSON body) of the consume process's ``/healthz``, also for a 503."""
    url = f"http://127.0.0.1:{port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, None  # not listening (yet, or any more)


def test_healthz_is_unhealthy_while_a_handler_is_past_its_time_limit(rig: FaultRig) -> None:
    # A long grace: the process stays up (unhealthy) for 6 s before it exits.
    run = PoisonRun(rig, RM_TEST_HANDLER_TIMEOUT="1", RM_TEST_HANDLER_TIMEOUT_GRACE="6")
    proc = run.start_consume("--metrics-port", "0").wait_consuming(60)
    port = proc.ops_port()
    wait_until(
        lambda: healthz(port)[0] == 200,
        timeout=20,
        message=lambda: f"/healthz ok (now {healthz(port)})\n{proc.log()[-3000:]}",
    )
    publisher = Publisher(rig.vhost)
    try:
        publisher.publish(rig.exchange, ROUTING_KEY, {"sleep": {LABEL: 1000}}, message_id=BAD_ID)
    finally:
        publisher.close()

    def unhealthy() -> bool:
        assert proc.returncode is None, f"exited before /healthz said so:\n{proc.log()[-3000:]}"
        status, body = healthz(port)
        return status == 503 and body.get("status") == "unhealthy"

    wait_until(
        unhealthy,
        timeout=5,
        interval=0.2,
        message=lambda: (
            f"/healthz 503 while the handler is past its 1 s limit (now {healthz(port)})\n"
            f"{proc.log()[-3000:]}"
        ),
    )
    print(f"/healthz past the time limit: {healthz(port)}")  # shown with -rP
    assert proc.wait(30) == TIMED_OUT_EXIT_CODE, proc.log()[-3000:]
