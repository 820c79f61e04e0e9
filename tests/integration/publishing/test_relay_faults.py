"""The relay under faults, as real processes: kill -9, SIGTERM, a broker restart; and the
LISTEN/NOTIFY wake-up. Nothing committed may be lost; duplicates are allowed after a crash."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest
from django.db import connections, transaction
from django.db.models.functions import Now

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import LEASE_MARGIN, MAX_IN_FLIGHT
from tests import support
from tests.support import wait_until

from .conftest import OutboxEnv, ensure_broker_running

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def sent_rows() -> int:
    return OutboxMessage.objects.filter(status=OutboxStatus.SENT).count()


def publish_many(count: int, per_transaction: int = 1000) -> set[str]:
    ids: set[str] = set()
    for start in range(0, count, per_transaction):
        with transaction.atomic():
            ids.update(
                publish("bulk.x", {"n": n})
                for n in range(start, min(count, start + per_transaction))
            )
    return ids


def test_kill_9_mid_batch_loses_nothing(ob: OutboxEnv) -> None:
    # The rows a killed relay had in flight go again when their lease (the confirm timeout
    # and a margin) runs out: a short one keeps the test short.
    ob.set(RELAY_CONFIRM_TIMEOUT=2)
    queue = ob.queue()
    total = 3000
    ids = publish_many(total)

    relay = ob.relay_process("--batch-size", "20")
    wait_until(
        lambda: ob.broker.count(queue) > 0 or relay.returncode is not None,
        timeout=60,
        interval=0.01,
        message=lambda: f"the first rows on the queue; relay log:\n{relay.log()}",
    )
    relay.kill()  # SIGKILL: no cleanup, a batch may be published and not yet marked sent
    assert relay.returncode == -signal.SIGKILL
    sent_at_kill = sent_rows()
    assert sent_at_kill < total, "the relay finished before it could be killed mid-run"
    leased = OutboxMessage.objects.filter(
        status=OutboxStatus.PENDING, next_attempt_at__gt=Now()
    ).count()
    assert leased <= 20 * MAX_IN_FLIGHT, leased  # at most the batches that were in flight

    # A relay started now sends everything else at once and those rows when the lease ends.
    wait_until(
        lambda: (
            not OutboxMessage.objects.filter(
                status=OutboxStatus.PENDING, next_attempt_at__gt=Now()
            ).exists()
        ),
        timeout=2 + LEASE_MARGIN + 5,
        message="the killed relay's lease ran out",
    )
    code, log = ob.run_relay_once(120, "--batch-size", "200")
    assert code == 0, log
    assert OutboxMessage.objects.exclude(status=OutboxStatus.SENT).count() == 0

    delivered = ob.broker.drain(queue, expected=total)
    counts = Counter(m.message_id for m in delivered)
    assert set(counts) == ids  # every committed row arrived at least once
    assert len(delivered) >= total


def test_sigterm_mid_drain_exits_zero_and_finishes_the_batch_in_flight(ob: OutboxEnv) -> None:
    queue = ob.queue()
    total = 3000
    ids = publish_many(total)
    relay = ob.relay_process("--batch-size", "20")
    wait_until(
        lambda: sent_rows() > 0 or relay.returncode is not None,
        timeout=60,
        interval=0.01,
        message=lambda: f"the first rows sent; relay log:\n{relay.log()}",
    )
    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()
    assert "received SIGTERM" in relay.log()
    sent_by_first = set(
        OutboxMessage.objects.filter(status=OutboxStatus.SENT).values_list("message_id", flat=True)
    )
    assert 0 < len(sent_by_first) < total, "the relay was not stopped mid-drain"
    assert not OutboxMessage.objects.filter(attempts__gt=0).exists()
    # Every row it marked sent is on the queue (the batch in flight was finished, not dropped).
    assert ob.broker.count(queue) == len(sent_by_first)

    # A graceful stop commits the batch in flight: no row was published without being marked
    # sent, so the rest goes out with no duplicate at all.
    code, log = ob.run_relay_once(120, "--batch-size", "500")
    assert code == 0, log
    delivered = ob.broker.drain(queue, expected=total)
    counts = Counter(m.message_id for m in delivered)
    assert set(counts) == ids
    assert max(counts.values()) == 1, "a gracefully stopped relay caused duplicates"


def test_sigterm_of_an_idle_relay_exits_zero(ob: OutboxEnv) -> None:
    relay = ob.relay_process().wait_connected()
    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()
    assert "sent 0" in relay.log()


def test_relay_reconnects_by_itself_after_a_broker_restart(ob: OutboxEnv) -> None:
    queue = ob.queue()  # durable: survives stop_app
    relay = ob.relay_process("--batch-size", "10").wait_connected()
    stop = threading.Event()
    published: list[str] = []
    errors: list[BaseException] = []

    def publisher() -> None:
        try:
            for n in range(3000):  # bounded; normally stopped long before
                if stop.is_set():
                    return
                published.append(publish("loop.x", {"n": n}))
                time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sent_rows() >= 20, timeout=30, message="rows sent before the restart")
        try:
            support.rabbitmqctl("stop_app", timeout=120)
            count = len(published)
            wait_until(
                lambda: len(published) >= count + 30,
                timeout=30,
                message="rows published while the broker is down",
            )
        finally:
            ensure_broker_running()
        count = len(published)
        wait_until(lambda: len(published) >= count + 30, timeout=30, message="rows after restart")
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and not errors, errors

    ids = set(published)
    wait_until(
        lambda: sent_rows() == len(ids),
        timeout=90,
        interval=0.2,
        message=lambda: f"all {len(ids)} rows sent (now {sent_rows()}); log:\n{relay.log()}",
    )
    assert relay.returncode is None, f"the relay exited instead of reconnecting:\n{relay.log()}"
    assert "reconnecting" in relay.log() or "connection closed" in relay.log()

    delivered = ob.broker.drain(queue, expected=len(ids))
    assert {m.message_id for m in delivered} == ids

    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()


def test_relay_rides_out_a_database_outage(ob: OutboxEnv) -> None:
    """PostgreSQL stopped under a running relay: no crash, nothing lost; once the database is
    back the relay resumes by itself (new LISTEN connection included) and sends what is due."""
    queue = ob.queue()
    relay = ob.relay_process().wait_connected()
    before = publish("db.before", {"n": 1})
    wait_until(lambda: sent_rows() == 1, timeout=30, message="the first row sent")
    connections.close_all()  # the test's own connection would break anyway
    support.pg_ctl("stop")
    try:
        assert not support.pg_isready()
        time.sleep(3)  # several ticks and LISTEN retries against a dead database
        assert relay.returncode is None, f"the relay died with the database:\n{relay.log()}"
    finally:
        support.ensure_postgresql_up()
    assert "database unavailable" in relay.log() or "LISTEN connection lost" in relay.log()
    after = publish("db.after", {"n": 2})
    wait_until(
        lambda: sent_rows() == 2,
        timeout=60,
        interval=0.2,
        message=lambda: f"the row published after the outage sent; log:\n{relay.log()}",
    )
    assert relay.returncode is None
    delivered = ob.broker.drain(queue, expected=2)
    assert Counter(m.message_id for m in delivered) == {before: 1, after: 1}
    relay.send(signal.SIGTERM)
    assert relay.wait(timeout=20) == 0, relay.log()


def test_notify_wakes_an_idle_relay(ob: OutboxEnv) -> None:
    # Polling every 30 s: only the NOTIFY sent on commit can explain a delivery within 3 s.
    ob.set(RELAY_POLL_INTERVAL=30.0)
    queue = ob.queue()
    relay = ob.relay_thread()
    assert relay.relay.listen

    warmup = publish("notify.warmup", {"n": 0})
    wait_until(lambda: ob.broker.count(queue) == 1, timeout=30, message="the warm-up row")
    # The broker holds the row before the relay has recorded its confirm.
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=warmup).status == OutboxStatus.SENT,
        timeout=10,
        message="the warm-up row marked sent",
    )
    time.sleep(1.0)  # let the relay settle into its 30 s idle wait

    with transaction.atomic():
        message_id = publish("notify.new", {"n": 1})
    wait_until(
        lambda: ob.broker.count(queue) == 2,
        timeout=3,
        interval=0.02,
        message="the new row delivered by a NOTIFY wake-up",
    )
    assert not relay.done.is_set(), relay.error
    ob.stop_relay(relay)
    delivered = ob.broker.drain(queue, expected=2)
    assert [m.message_id for m in delivered] == [warmup, message_id]


def test_a_running_relay_never_sends_an_uncommitted_row(ob: OutboxEnv) -> None:
    ob.set(RELAY_POLL_INTERVAL=0.1)
    queue = ob.queue()
    relay = ob.relay_thread()
    with transaction.atomic():
        message_id = publish("open.tx", {"n": 1})
        time.sleep(1.0)  # the relay polls about ten times meanwhile
        assert ob.broker.count(queue) == 0
    wait_until(lambda: ob.broker.count(queue) == 1, timeout=30, message="the committed row")
    with pytest.raises(RuntimeError), transaction.atomic():
        publish("open.tx", {"n": 2})
        raise RuntimeError("rolled back")
    time.sleep(0.5)
    ob.stop_relay(relay)
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [message_id]
