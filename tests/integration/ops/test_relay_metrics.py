"""What the relay counts and reports, against the real broker and database: the counters after
a known scenario, failed sends by kind, its health, and ``manage.py relay --metrics-port``."""

from __future__ import annotations

import signal

import pytest
from django.db import transaction
from prometheus_client import CollectorRegistry

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.models import OutboxMessage
from reliable_messaging.ops.collectors import DatabaseCollector
from reliable_messaging.publishing.relay import build_relay
from tests.integration.publishing.conftest import OutboxEnv
from tests.support import wait_until

from .conftest import http_json, sample, scraped

pytestmark = pytest.mark.django_db(transaction=True)


def database_gauge(name: str) -> float | None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return registry.get_sample_value(name)


def test_twenty_rows_through_a_real_relay(ob: OutboxEnv) -> None:
    queue = ob.queue()
    with transaction.atomic():
        ids = {publish("ops.twenty", {"n": n}) for n in range(20)}
    assert database_gauge("reliable_messaging_outbox_pending_messages") == 20
    assert database_gauge("reliable_messaging_outbox_oldest_pending_age_seconds") > 0  # type: ignore[operator]
    before = {
        name: sample(name)
        for name in (
            "reliable_messaging_relay_claimed_total",
            "reliable_messaging_relay_published_total",
            "reliable_messaging_relay_confirm_latency_seconds_count",
        )
    }

    report = build_relay(once=True, batch_size=8).run()

    assert report.sent == 20
    assert sample("reliable_messaging_relay_published_total") == (
        before["reliable_messaging_relay_published_total"] + 20
    )
    assert sample("reliable_messaging_relay_claimed_total") == (
        before["reliable_messaging_relay_claimed_total"] + 20
    )
    # One confirm latency per message.
    assert sample("reliable_messaging_relay_confirm_latency_seconds_count") == (
        before["reliable_messaging_relay_confirm_latency_seconds_count"] + 20
    )
    assert database_gauge("reliable_messaging_outbox_pending_messages") == 0
    assert database_gauge("reliable_messaging_outbox_oldest_pending_age_seconds") == 0
    assert {m.message_id for m in ob.broker.drain(queue, expected=20)} == ids


def test_failed_sends_are_counted_by_kind(ob: OutboxEnv) -> None:
    # A row nobody receives is retried (and counted as returned) only when it is a command.
    ob.set(REQUIRE_ROUTE=["nowhere.#"])
    ob.queue(bindings=["ok.#"])
    ob.queue(
        "full", bindings=["full.#"], arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    )
    kinds = ("returned", "nacked", "refused", "timeout")
    before = {k: sample("reliable_messaging_relay_failed_total", kind=k) for k in kinds}
    with transaction.atomic():
        publish("ok.1", {"n": 1})
        publish("nowhere.2", {"n": 2})  # unroutable: returned
        publish("full.3", {"n": 3})  # rejected by a full queue: nacked
        publish("ok.4", {"n": 4}, exchange=f"rmtest.{ob.ns}.missing")  # refused

    report = build_relay(once=True).run()

    assert (report.sent, report.returned, report.nacked) == (1, 1, 1)
    after = {k: sample("reliable_messaging_relay_failed_total", kind=k) for k in kinds}
    assert {k: after[k] - before[k] for k in kinds} == {
        "returned": 1,
        "nacked": 1,
        "refused": 1,
        "timeout": 0,
    }
    assert database_gauge("reliable_messaging_outbox_pending_messages") == 3


def test_the_relay_reports_its_health(ob: OutboxEnv) -> None:
    health = HealthState()
    assert not health.check()[0]  # not connected yet
    runner = ob.relay_thread(health=health)
    wait_until(lambda: health.check()[0], timeout=30, message=lambda: str(health.check()))
    ob.stop_relay(runner)
    assert health.check() == (False, ["stopping", "broker not connected"])


def test_relay_command_serves_metrics_and_healthz_and_logs_progress(ob: OutboxEnv) -> None:
    queue = ob.queue()
    relay = ob.relay_process(
        "--metrics-port", "0", "--progress-interval", "0.5", "--lanes", "2"
    ).wait_connected()
    base = f"http://127.0.0.1:{relay.ops_port()}"
    # Both lanes must be connected before the process is healthy.
    wait_until(
        lambda: http_json(f"{base}/healthz") == (200, {"status": "ok"}),
        timeout=30,
        message=lambda: f"/healthz ok; log:\n{relay.log()}",
    )

    with transaction.atomic():
        for n in range(10):
            publish("ops.cmd", {"n": n})
    wait_until(
        lambda: OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 10,
        timeout=30,
        message=lambda: f"10 rows sent; log:\n{relay.log()}",
    )
    wait_until(
        lambda: scraped(f"{base}/metrics", "reliable_messaging_relay_published_total") == 10,
        timeout=10,
        message="the 10 rows in the process's metrics",
    )
    assert scraped(f"{base}/metrics", "reliable_messaging_healthy") == 1
    relay.wait_for_log("relay: 10 sent so far", timeout=10)
    assert len(ob.broker.drain(queue, expected=10)) == 10

    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()
    # A progress line only while there is something to say: rows pending (the relay may be slow
    # to send them on a busy machine), then the one for the rows; none once idle.
    lines = [line for line in relay.log().splitlines() if "sent so far" in line]
    assert "relay: 10 sent so far" in lines[-1], relay.log()
    assert all(not line.endswith(" 0 pending") for line in lines[:-1]), relay.log()
    assert "GET /" not in relay.log()
