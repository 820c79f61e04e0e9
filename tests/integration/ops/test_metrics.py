"""The metrics helpers, the health state and the database gauges, read back the way a scraper
reads them (the default registry, or a registry holding the collector)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest
from django.db import connection, transaction
from django.utils import timezone
from prometheus_client import REGISTRY, CollectorRegistry

from reliable_messaging import metrics
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, OutboxStatus
from reliable_messaging.core.liveness import HealthGroup, HealthState
from reliable_messaging.metrics import HealthCollector
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.ops.collectors import DatabaseCollector
from tests.support import ROOT

from .conftest import sample

# -- process counters ----------------------------------------------------------------------------


def test_consumer_counters_count_by_consumer_and_outcome() -> None:
    name = "tests.ops.unit-consumer"
    received = sample("reliable_messaging_consumer_received_total", consumer=name)
    redelivered = sample("reliable_messaging_consumer_redelivered_total", consumer=name)

    for flag in (False, False, True):
        metrics.consumer_received(name, redelivered=flag)
    metrics.consumer_outcome(name, "processed", duration=0.02)
    metrics.consumer_outcome(name, "processed", duration=0.3)
    metrics.consumer_outcome(name, "duplicate")

    assert sample("reliable_messaging_consumer_received_total", consumer=name) == received + 3
    assert sample("reliable_messaging_consumer_redelivered_total", consumer=name) == redelivered + 1
    assert (
        sample("reliable_messaging_consumer_messages_total", consumer=name, outcome="processed")
        == 2
    )
    assert (
        sample("reliable_messaging_consumer_messages_total", consumer=name, outcome="duplicate")
        == 1
    )
    # Only outcomes with a handler run are timed.
    assert sample("reliable_messaging_handler_duration_seconds_count", consumer=name) == 2
    assert sample("reliable_messaging_handler_duration_seconds_sum", consumer=name) == (
        pytest.approx(0.32)
    )
    assert (
        sample("reliable_messaging_handler_duration_seconds_bucket", consumer=name, le="0.025") == 1
    )


def test_every_outcome_and_cache_result_is_accepted_and_a_typo_is_refused() -> None:
    name = "tests.ops.labels"
    for outcome in sorted(metrics.CONSUMER_OUTCOMES):
        metrics.consumer_outcome(name, outcome)
        assert (
            sample("reliable_messaging_consumer_messages_total", consumer=name, outcome=outcome)
            == 1
        )
    for result in sorted(metrics.DEDUP_RESULTS):
        metrics.dedup_cache(name, result)
        assert sample("reliable_messaging_dedup_cache_total", consumer=name, result=result) == 1

    with pytest.raises(ValueError, match="unknown consumer outcome 'procesed'"):
        metrics.consumer_outcome(name, "procesed")
    with pytest.raises(ValueError, match="unknown dedup cache result"):
        metrics.dedup_cache(name, "hits")
    with pytest.raises(ValueError, match="unknown relay failure kind"):
        metrics.relay_failed("lost")


def test_relay_counters_and_the_blocked_gauge() -> None:
    published = sample("reliable_messaging_relay_published_total")
    claimed = sample("reliable_messaging_relay_claimed_total")
    latencies = sample("reliable_messaging_relay_confirm_latency_seconds_count")
    blocks = sample("reliable_messaging_relay_blocks_total")
    blocked = sample("reliable_messaging_relay_blocked")
    failed = {k: sample("reliable_messaging_relay_failed_total", kind=k) for k in ("nacked",)}

    metrics.relay_claimed(7)
    metrics.relay_published(5)
    metrics.relay_published()
    metrics.relay_confirm_latency(0.004)
    metrics.relay_failed("nacked", 2)
    metrics.relay_blocked(True)
    assert sample("reliable_messaging_relay_blocked") == blocked + 1
    metrics.relay_blocked(False)

    assert sample("reliable_messaging_relay_claimed_total") == claimed + 7
    assert sample("reliable_messaging_relay_published_total") == published + 6
    assert sample("reliable_messaging_relay_confirm_latency_seconds_count") == latencies + 1
    assert sample("reliable_messaging_relay_failed_total", kind="nacked") == failed["nacked"] + 2
    assert sample("reliable_messaging_relay_blocks_total") == blocks + 1
    assert sample("reliable_messaging_relay_blocked") == blocked


def test_every_relay_failure_kind_is_exported_before_it_happens() -> None:
    # rate() over a series that appears only at the first failure would miss that failure.
    for kind in metrics.RELAY_FAILURE_KINDS:
        assert (
            REGISTRY.get_sample_value("reliable_messaging_relay_failed_total", {"kind": kind})
            is not None
        )


# -- health --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_state_reports_each_reason_in_words() -> None:
    clock = FakeClock()
    health = HealthState(stall_after=30, clock=clock)
    assert health.check() == (False, ["broker not connected"])

    health.set_broker(True)
    assert health.check() == (True, [])

    health.set_database(False, "connection refused")
    assert health.check() == (False, ["database failing: connection refused"])
    health.set_database(True)
    assert health.check() == (True, [])

    clock.now += 29
    assert health.check()[0]
    clock.now += 2
    ok, reasons = health.check()
    assert not ok and reasons == ["no heartbeat for 31s: the main loop looks stuck"]
    health.heartbeat()
    assert health.check() == (True, [])

    health.set_broker(False)
    health.stopping()
    assert health.check() == (False, ["stopping", "broker not connected"])


def test_health_group_is_healthy_only_when_every_member_is() -> None:
    lanes = {"lane 1": HealthState(), "lane 2": HealthState()}
    group = HealthGroup(lanes)
    lanes["lane 1"].set_broker(True)
    assert group.check() == (False, ["lane 2: broker not connected"])
    lanes["lane 2"].set_broker(True)
    assert group.check() == (True, [])


def test_health_collector_exports_one_gauge() -> None:
    health = HealthState()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HealthCollector(health))
    assert registry.get_sample_value("reliable_messaging_healthy") == 0
    health.set_broker(True)
    assert registry.get_sample_value("reliable_messaging_healthy") == 1


# -- database gauges -----------------------------------------------------------------------------


def database_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return registry


def outbox_row(status: str, age: dt.timedelta, **values: object) -> OutboxMessage:
    return OutboxMessage.objects.create(
        message_id=f"m-{OutboxMessage.objects.count()}",
        routing_key="ops.test",
        body="{}",
        status=status,
        created_at=timezone.now() - age,
        **values,
    )


@pytest.mark.django_db
def test_outbox_lag_goes_by_the_database_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """publish() stamps rows with the database's clock: a web process whose own clock runs an
    hour ahead must not report an hour of lag."""
    outbox_row(OutboxStatus.PENDING, dt.timedelta(minutes=1))
    ahead = timezone.now() + dt.timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: ahead)
    age = database_registry().get_sample_value(
        "reliable_messaging_outbox_oldest_pending_age_seconds"
    )
    assert age is not None and 60 <= age < 600


def dead_letter(consumer: str, reason: str, status: str, message_id: str) -> None:
    DeadLetter.objects.create(
        consumer=consumer,
        message_id=message_id,
        queue="q",
        body=b"{}",
        reason=reason,
        status=status,
    )


@pytest.mark.django_db
def test_database_gauges_read_the_outbox_dead_letters_and_inbox() -> None:
    registry = database_registry()
    assert registry.get_sample_value("reliable_messaging_database_up") == 1
    assert registry.get_sample_value("reliable_messaging_outbox_pending_messages") == 0
    assert registry.get_sample_value("reliable_messaging_outbox_oldest_pending_age_seconds") == 0

    outbox_row(OutboxStatus.PENDING, dt.timedelta(minutes=10))
    outbox_row(OutboxStatus.PENDING, dt.timedelta(minutes=1))
    outbox_row(OutboxStatus.SENT, dt.timedelta(hours=2), sent_at=timezone.now())
    outbox_row(OutboxStatus.FAILED, dt.timedelta(hours=1), attempts=10)
    dead_letter("billing", DeadLetterReason.PERMANENT, DeadLetterStatus.DEAD, "a")
    dead_letter("billing", DeadLetterReason.PERMANENT, DeadLetterStatus.DEAD, "b")
    dead_letter("billing", DeadLetterReason.INVALID_JSON, DeadLetterStatus.RESOLVED, "c")
    dead_letter("shipping", DeadLetterReason.RETRIES_EXHAUSTED, DeadLetterStatus.DEAD, "a")
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="billing", message_id=f"p-{n}") for n in range(3)
    )
    with connection.cursor() as cursor:
        # The inbox figure comes from the planner's statistics, as autovacuum would keep them.
        cursor.execute(f"ANALYZE {ProcessedMessage._meta.db_table}")

    assert registry.get_sample_value("reliable_messaging_outbox_pending_messages") == 2
    assert registry.get_sample_value("reliable_messaging_outbox_failed_messages") == 1
    age = registry.get_sample_value("reliable_messaging_outbox_oldest_pending_age_seconds")
    assert age is not None and 600 <= age < 900
    dead = {
        (labels["status"], labels["consumer"], labels["reason"]): value
        for family in registry.collect()
        if family.name == "reliable_messaging_dead_letters"
        for _, labels, value, *_ in family.samples
    }
    assert dead == {
        ("dead", "billing", "permanent"): 2,
        ("resolved", "billing", "invalid_json"): 1,
        ("dead", "shipping", "retries_exhausted"): 1,
    }
    assert registry.get_sample_value("reliable_messaging_inbox_messages") == 3
    assert registry.get_sample_value("reliable_messaging_database_up") == 1


class RollBack(Exception):
    """Raised to roll a savepoint back on purpose."""


@pytest.mark.django_db
def test_a_database_error_during_a_scrape_exports_database_up_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = database_registry()
    table = OutboxMessage._meta.db_table
    # A real error from PostgreSQL: the table is missing for the length of a savepoint.
    with pytest.raises(RollBack), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
        families = list(registry.collect())
        raise RollBack
    assert [(f.name, [s.value for s in f.samples]) for f in families] == [
        ("reliable_messaging_database_up", [0.0])
    ]
    assert "metrics: cannot read the database" in caplog.text
    # And the next scrape is whole again.
    assert registry.get_sample_value("reliable_messaging_database_up") == 1


# -- what importing the counters costs -----------------------------------------------------------


def test_the_counters_and_liveness_import_no_reader_and_no_status() -> None:
    """A consume or relay process imports metrics and liveness; neither may pull in the ORM
    readers, the status report, pika or Django's ORM (nor need Django set up)."""
    script = (
        "import sys\n"
        "import reliable_messaging.core.liveness, reliable_messaging.metrics\n"
        "heavy = ['reliable_messaging.ops.collectors', 'reliable_messaging.ops.status', "
        "'reliable_messaging.models', 'pika', 'django.db.models']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

    # The readers live in collectors only: metrics (the bottom tier) never reaches up to them.
    for name in ("DatabaseCollector", "BrokerCollector", "outbox_lag", "inbox_rows"):
        assert not hasattr(metrics, name)
