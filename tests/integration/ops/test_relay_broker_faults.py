"""The relay's health and flow control while the broker is away or blocks it, as a real
``manage.py relay`` process. These tests stop the broker or raise its memory alarm: run them
alone (they restore the broker in a ``finally``, whatever happens)."""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.in_flight import HOLD_LIMIT
from reliable_messaging.publishing.relay import MAX_IN_FLIGHT
from tests.integration.publishing.conftest import OutboxEnv, ensure_broker_running
from tests.support import rabbitmqctl, wait_until

from .conftest import http_json, scraped

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def sent_ids() -> set[str]:
    return set(
        OutboxMessage.objects.filter(status=OutboxStatus.SENT).values_list("message_id", flat=True)
    )


def open_transactions_older_than(seconds: float) -> list[tuple[str, str]]:
    """Sessions of the test database with a transaction open for over ``seconds``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT state, left(query, 200) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND xact_start < now() - make_interval(secs => %s)",
            [seconds],
        )
        return list(cursor.fetchall())


def broker_status() -> dict[str, object]:
    status: dict[str, object] = json.loads(rabbitmqctl("status", "--formatter", "json"))
    return status


def memory_alarm_raised() -> bool:
    return "memory" in json.dumps(broker_status().get("alarms") or [])


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """Raise RabbitMQ's memory alarm (it blocks publishing connections) by setting a tiny
    watermark; put back the watermark the node had, whatever happens."""
    setting = broker_status()["vm_memory_high_watermark_setting"]
    assert isinstance(setting, dict), setting
    restore = (
        [str(setting["relative"])]
        if "relative" in setting
        else ["absolute", str(setting["absolute"])]
    )
    try:
        rabbitmqctl("set_vm_memory_high_watermark", "0.00001")
        wait_until(memory_alarm_raised, timeout=30, interval=0.2, message="the memory alarm")
        yield
    finally:
        rabbitmqctl("set_vm_memory_high_watermark", *restore)
        wait_until(
            lambda: not memory_alarm_raised(), timeout=60, interval=0.2, message="alarm cleared"
        )


def test_relay_healthz_fails_while_the_broker_is_stopped(ob: OutboxEnv) -> None:
    queue = ob.queue()
    relay = ob.relay_process("--metrics-port", "0").wait_connected()
    port = relay.ops_port()
    healthz, metrics_url = f"http://127.0.0.1:{port}/healthz", f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: http_json(healthz)[0] == 200, timeout=30, message="/healthz ok")
    try:
        rabbitmqctl("stop_app")
        wait_until(
            lambda: (
                http_json(healthz)
                == (
                    503,
                    {"status": "unhealthy", "reasons": ["broker not connected"]},
                )
            ),
            timeout=60,
            interval=0.2,
            message=lambda: f"/healthz 503 (now {http_json(healthz)}); log:\n{relay.log()}",
        )
        assert scraped(metrics_url, "reliable_messaging_healthy") == 0
        assert relay.returncode is None, relay.log()
    finally:
        ensure_broker_running()
    wait_until(
        lambda: http_json(healthz) == (200, {"status": "ok"}),
        timeout=60,
        interval=0.2,
        message=lambda: f"/healthz ok again; log:\n{relay.log()}",
    )
    message_id = publish("ops.after", {"n": 1})
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [message_id]
    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()


def healthz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return dict(json.load(response))


def test_blocked_relay_claims_nothing_and_resumes_by_itself(ob: OutboxEnv) -> None:
    # A short confirm timeout: had the relay charged the blocked batch for its late
    # confirms, its rows would show failed attempts within the block.
    ob.set(RELAY_CONFIRM_TIMEOUT=2.0)
    queue = ob.queue()
    relay = ob.relay_process("--batch-size", "5", "--metrics-port", "0").wait_connected()
    port = relay.ops_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: scraped(metrics_url, "reliable_messaging_healthy") == 1, timeout=30)
    with memory_alarm():
        with transaction.atomic():
            ids = {publish("ops.blocked", {"n": n}) for n in range(20)}
        # The broker blocks a connection when it publishes during the alarm.
        relay.wait_for_log("the broker blocked the connection", timeout=30)
        claimed = scraped(metrics_url, "reliable_messaging_relay_claimed_total")
        # The batches in flight when the block came (the next is claimed while the last
        # one's confirms come back).
        assert claimed is not None and 1 <= claimed <= 5 * MAX_IN_FLIGHT
        with transaction.atomic():
            ids |= {publish("ops.blocked", {"n": n}) for n in range(20, 25)}
        time.sleep(4)  # two confirm timeouts, and the NOTIFY of the new rows

        # No row claimed since the block; none charged a failure; at most the batch that
        # was in flight is sent, every other row waits in the database.
        assert scraped(metrics_url, "reliable_messaging_relay_claimed_total") == claimed
        assert scraped(metrics_url, "reliable_messaging_relay_blocked") == 1
        assert len(sent_ids()) <= claimed
        assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() >= 25 - claimed
        assert not OutboxMessage.objects.filter(attempts__gt=0).exists()
        assert "no confirm from the broker" not in relay.log()
        # The blocked batches traded their transactions for leases after HOLD_LIMIT: no
        # snapshot or row lock is held on the outbox for the length of the block.
        assert open_transactions_older_than(HOLD_LIMIT + 1.0) == [], relay.log()
        # Blocked is not broken: the process stays healthy and running, and says why it waits.
        assert scraped(metrics_url, "reliable_messaging_healthy") == 1
        health = healthz(port)
        assert health["status"] == "ok"
        assert any("blocks publishing" in note for note in health["notes"]), health
        assert relay.returncode is None, relay.log()

    relay.wait_for_log("the broker unblocked the connection; resuming", timeout=30)
    wait_until(
        lambda: sent_ids() == ids,
        timeout=60,
        interval=0.2,
        message=lambda: f"all 25 rows sent (now {len(sent_ids())}); log:\n{relay.log()}",
    )
    delivered = Counter(m.message_id for m in ob.broker.drain(queue, expected=25))
    assert delivered == dict.fromkeys(ids, 1)  # each row exactly once
    assert scraped(metrics_url, "reliable_messaging_relay_blocked") == 0
    assert scraped(metrics_url, "reliable_messaging_relay_blocks_total") == 1
    assert "notes" not in healthz(port)
    log = relay.log()
    assert log.count("WARNING reliable_messaging.relay relay: the broker blocked") == 1, log
    assert log.count("INFO reliable_messaging.relay relay: the broker unblocked") == 1, log
    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()


def test_sigterm_while_blocked_exits_without_waiting_for_the_alarm(ob: OutboxEnv) -> None:
    queue = ob.queue()
    relay = ob.relay_process("--batch-size", "5").wait_connected()
    with memory_alarm():
        with transaction.atomic():
            ids = {publish("ops.stop", {"n": n}) for n in range(10)}
        relay.wait_for_log("the broker blocked the connection", timeout=30)
        relay.send(signal.SIGTERM)
        # Well before pika's blocked-connection timeout (300 s) would end the connection.
        assert relay.wait(timeout=30) == 0, relay.log()
        assert "stopping while the broker blocks the connection" in relay.log()
        assert not OutboxMessage.objects.filter(attempts__gt=0).exists()

    # The rolled-back batch goes again: every row arrives (a row the broker had taken before
    # the stop may arrive twice, which consumers absorb).
    code, log = ob.run_relay_once(120)
    assert code == 0, log
    assert sent_ids() == ids
    assert {m.message_id for m in ob.broker.drain(queue, expected=10)} == ids
