"""What the database does is never charged to a handler, with real ``manage.py consume``
processes (issue 33): a failover to read-only with its sessions terminated, and real deadlocks
between handlers. Only the test's own database is made read-only; PostgreSQL keeps running.
The full-size scenario with its figures is ``bench/failover.py``.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Set

import pytest
from django.db import connection, connections

from reliable_messaging.core.database_errors import CONFLICT_RETRIES
from reliable_messaging.models import DeadLetter
from tests import support
from tests.support import ConsumeProcess, Publisher, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

# WARNING and ERROR lines a process may log over a whole failover: the outage said once (and
# the odd give-back of a batch held too long), never a line per delivery.
LOUD_LINES_BOUND = 8


def exchange(ns: str) -> str:
    return f"rmtest.{ns}"


def loud_lines(proc: ConsumeProcess) -> list[str]:
    return [line for line in proc.log().splitlines() if re.search(r" (WARNING|ERROR) ", line)]


def assert_nothing_charged(
    procs: list[ConsumeProcess], message_ids: list[str], past_the_bound: Set[str] = frozenset()
) -> None:
    """Every message took effect once, at its first attempt; no retry, no dead letter; but for
    ``past_the_bound``, which met more conflicts in a row than the bound and were charged."""
    effects = list(Effect.objects.filter(consumer="alpha").values_list("message_id", "attempt"))
    counts = Counter(message_id for message_id, _ in effects)
    assert sorted(counts) == sorted(message_ids), "every message took effect"
    assert set(counts.values()) == {1}, [m for m, n in counts.items() if n != 1]
    charged = [(m, attempt) for m, attempt in effects if attempt != 1 and m not in past_the_bound]
    assert not charged, charged
    assert not DeadLetter.objects.exists()
    for proc in procs:
        log = proc.log()
        retried = {
            m
            for line in log.splitlines()
            if "outcome=retry" in line
            for m in message_ids
            if f"message_id={m} " in line
        }
        assert retried <= past_the_bound, log
        assert "outcome=dead_lettered" not in log, log
        assert proc.returncode is None


def test_a_failover_to_read_only_holds_deliveries_and_charges_nothing(
    consume, ns: str, publisher: Publisher
) -> None:
    """Two processes, 240 messages in flight, the database read-only with its sessions cut for
    about 8 s, then writable again: every message once, at attempt 1; the outage logged once
    per process, with no traceback."""
    queue = f"{ns}.alpha"
    # No relay beside the handlers: this is the consumer's account of the outage (a relay
    # says each retry of its own while the database is gone).
    procs = [consume("--queue", queue, "--no-relay").wait_consuming() for _ in range(2)]
    message_ids = [f"failover-{n}" for n in range(240)]
    payload = {"sleep": {"alpha": 0.01}}
    for message_id in message_ids[:80]:
        publisher.publish(exchange(ns), "order.placed", payload, message_id=message_id)
    wait_until(
        lambda: Effect.objects.filter(consumer="alpha").count() >= 10,
        timeout=60,
        message="the consumers at work before the failover",
    )
    database = connection.settings_dict["NAME"]
    connections.close_all()
    with support.read_only_failover(database):
        started = time.monotonic()
        for message_id in message_ids[80:]:
            publisher.publish(exchange(ns), "order.placed", payload, message_id=message_id)
        wait_until(
            lambda: any("database unavailable" in proc.log() for proc in procs),
            timeout=30,
            message="a consumer holding deliveries for the read-only database",
        )
        time.sleep(max(0.0, 8.0 - (time.monotonic() - started)))
    connections.close_all()
    wait_until(
        lambda: support.drained(queue),
        timeout=120,
        interval=0.5,
        message="every message processed after the failover",
    )
    assert_nothing_charged(procs, message_ids)
    for proc in procs:
        log = proc.log()
        assert "Traceback" not in log, log
        assert len(loud_lines(proc)) <= LOUD_LINES_BOUND, "\n".join(loud_lines(proc))
    assert any("database available again" in proc.log() for proc in procs)


@pytest.fixture
def one_transaction_per_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes started after this commit each delivery alone (CONSUMER_BATCH_SIZE=1)."""
    monkeypatch.setenv("RM_TEST_CONSUMER_BATCH_SIZE", "1")


def test_deadlocks_between_handlers_run_again_uncharged(
    one_transaction_per_delivery: None, consume, ns: str, publisher: Publisher
) -> None:
    """Handlers lock two hot rows in opposite orders, one transaction per delivery, two
    processes of two threads: PostgreSQL detects deadlocks (counted in its statistics) and
    each victim runs again in place; every message counts once in each hot row."""
    for name in ("hot-1", "hot-2"):
        Effect.objects.create(consumer="hot", message_id=name, attempt=0)
    database = connection.settings_dict["NAME"]
    before = support.deadlocks(database)
    queue = f"{ns}.alpha"
    message_ids = [f"deadlock-{n}" for n in range(60)]
    # Detected sooner than the default second, so the test stays short.
    with support.database_setting(database, "deadlock_timeout", "100ms"):
        procs = [consume("--queue", queue, "--concurrency", "2").wait_consuming() for _ in range(2)]
        for n, message_id in enumerate(message_ids):
            order = ["hot-1", "hot-2"] if n % 2 else ["hot-2", "hot-1"]
            publisher.publish(
                exchange(ns),
                "order.placed",
                {"lock": {"alpha": order}, "lock_pause": 0.02},
                message_id=message_id,
            )
        wait_until(
            lambda: support.drained(queue),
            timeout=180,
            interval=0.5,
            message="every message processed",
        )
    # A delivery that meets more deadlocks in a row than CONFLICT_RETRIES allows is charged, by
    # design; with four handlers crossing locks, that can happen to one under load.
    logs = "".join(proc.log() for proc in procs)
    bound = f"met database conflicts {CONFLICT_RETRIES + 1} times in a row"
    past = {m for m in message_ids if f"message_id={m} {bound}" in logs}
    assert len(past) <= 3, past
    assert_nothing_charged(procs, message_ids, past)
    hot = dict(Effect.objects.filter(consumer="hot").values_list("message_id", "attempt"))
    assert hot == {"hot-1": len(message_ids), "hot-2": len(message_ids)}
    wait_until(
        lambda: support.deadlocks(database) > before,
        timeout=15,
        interval=0.5,
        message="PostgreSQL to count the deadlocks",
    )
    assert any("deadlock detected" in proc.log() for proc in procs)
