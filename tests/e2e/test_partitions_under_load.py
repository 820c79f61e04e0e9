"""Partition upkeep under weeks of load, in a minute: three ``consume`` processes run batches
of about four seconds back to back while an upkeep, whose clock moves a day per run, makes the
coming days and drops the expired ones. Every run must succeed during the load, no claim may
wait on a lock for long, and every message takes effect once."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import psycopg
import pytest
from django.utils import timezone

from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import INBOX_CLAIM_FUNCTION
from tests.conftest import database_url
from tests.markers import postgresql_only
from tests.support import ConsumeProcess, Publisher, wait_until
from tests.testapp.models import Effect

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
    postgresql_only,
]

DAY = dt.timedelta(days=1)
# What a claim may wait on a lock while the upkeep works: nothing the upkeep takes conflicts
# with a claim, so the bound is what any lock the upkeep could hold lasts (DDL_LOCK_TIMEOUT),
# measured here with room for a loaded machine.
CLAIM_WAIT_BOUND = 0.5
HANDLER_SLEEP = 0.5  # x a batch of 8: transactions of about four seconds
# Expired partitions are those before the moved clock minus this: the consume processes'
# own upkeep (DEDUP_RETENTION of a day, on the real clock) never drops what the test drops.
RETENTION = 30 * DAY
RUNS = 5


@pytest.fixture
def long_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of eight deliveries: set before ``consume`` builds its environment."""
    monkeypatch.setenv("RM_TEST_CONSUMER_BATCH_SIZE", "8")
    monkeypatch.setenv("RM_TEST_PREFETCH", "16")


class ClaimLockWaits:
    """Polls pg_stat_activity every 20 ms for inbox claims waiting on a lock; keeps the
    longest wait seen."""

    CLAIM = f"%{INBOX_CLAIM_FUNCTION}(%"

    def __init__(self) -> None:
        self.longest = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-lock-waits", daemon=True)

    def __enter__(self) -> ClaimLockWaits:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(database_url(), autocommit=True) as conn:
            while not self._stop.wait(0.02):
                row = conn.execute(
                    "SELECT max(extract(epoch FROM clock_timestamp() - query_start)) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE %s",
                    [self.CLAIM],
                ).fetchone()
                self.samples += 1
                if row and row[0] is not None:
                    self.longest = max(self.longest, float(row[0]))


def test_days_are_made_and_dropped_while_long_batches_run_back_to_back(
    long_batches: None, consume: Any, ns: str
) -> None:
    processes: list[ConsumeProcess] = [
        consume("--queue", f"{ns}.alpha", "--concurrency", "2") for _ in range(3)
    ]
    for process in processes:
        process.wait_consuming()
    ids: list[str] = []
    stop = threading.Event()

    def publish() -> None:
        publisher = Publisher()
        try:
            while not stop.wait(1 / 14):
                message_id = publisher.publish(
                    f"rmtest.{ns}", "order.placed", {"sleep": {"alpha": HANDLER_SLEEP}}
                )
                assert message_id is not None
                ids.append(message_id)
        finally:
            publisher.close()

    publishing = threading.Thread(target=publish, name="steady-publishing", daemon=True)
    publishing.start()
    start = timezone.now()
    runs: list[tuple[int, bool, float, str | None]] = []
    try:
        # The batches fill up: every worker is in a transaction of several seconds.
        time.sleep(5)
        with ClaimLockWaits() as waits:
            # Weeks of old days, as a long-running system has them (made under the load).
            for back in (40, 32, 24, 16):
                partitions.ensure_partitions("default", now=start - back * DAY)
            upkeep = partitions.PartitionUpkeep("default", retention=RETENTION)
            for day in range(1, RUNS + 1):
                now = start + day * DAY
                upkeep.clock = lambda now=now: now  # type: ignore[misc]
                began = time.monotonic()
                ok = upkeep.run_once()
                runs.append((day, ok, time.monotonic() - began, upkeep.problem))
                made = [p.name for p in partitions.partitions("default")]
                assert ok, (runs, upkeep.problem)
                assert partitions.day_name((now + partitions.AHEAD_DAYS * DAY).date()) in made
                assert not partitions.expired("default", now - RETENTION), made
            for process in processes:
                assert process.returncode is None, process.log()
    finally:
        stop.set()
        publishing.join(10)
    print(f"upkeep runs (day, ok, seconds, problem): {runs}")
    print(f"longest claim lock wait: {waits.longest:.3f}s over {waits.samples} samples")
    assert waits.samples > 100
    assert waits.longest < 3 * CLAIM_WAIT_BOUND, waits.longest
    # Nothing lost or doubled.
    wait_until(
        lambda: Effect.objects.filter(consumer="alpha").count() >= len(ids),
        timeout=120,
        message=lambda: f"{Effect.objects.filter(consumer='alpha').count()} of {len(ids)}",
    )
    effects = list(Effect.objects.filter(consumer="alpha").values_list("message_id", flat=True))
    assert sorted(effects) == sorted(ids)
