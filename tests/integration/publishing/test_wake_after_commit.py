"""publish() wakes the relay after the commit, from a connection of its own.

A NOTIFY run by the caller's transaction makes its commit take PostgreSQL's instance-wide
notification lock; a notification names the backend that sent it, so "no notification comes
from the caller's backend" is the same as "nothing in the caller's commit path took that lock".
One test adds a NOTIFY trigger on the outbox to show that this check notices one.
"""

from __future__ import annotations

import math
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.conf import messaging_settings
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing import wake_after_commit
from reliable_messaging.publishing.claims import OutboxClaims
from reliable_messaging.publishing.listener import NOTIFY_CHANNEL, listen_conninfo
from reliable_messaging.publishing.scheduling import TRAIL_LAST
from reliable_messaging.publishing.wake_after_commit import (
    MAX_SPACING,
    SPACING,
    WakeUpSender,
    sender,
)
from tests.conftest import subprocess_env
from tests.markers import ON_POSTGRESQL, direct_only, postgresql_only
from tests.support import ROOT, wait_until

from .conftest import OutboxEnv

pytestmark = [pytest.mark.django_db(transaction=True)]
on_sqlite = pytest.mark.skipif(ON_POSTGRESQL, reason="what happens elsewhere than PostgreSQL")

# The wake-up as a trigger would send it: from inside the publishing transaction.
NOTIFY_TRIGGER = f"""
CREATE FUNCTION rm_test_outbox_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('{NOTIFY_CHANNEL}', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER rm_test_outbox_notify AFTER INSERT ON reliable_messaging_outboxmessage
    FOR EACH STATEMENT EXECUTE FUNCTION rm_test_outbox_notify();
"""
DROP_NOTIFY_TRIGGER = """
DROP TRIGGER IF EXISTS rm_test_outbox_notify ON reliable_messaging_outboxmessage;
DROP FUNCTION IF EXISTS rm_test_outbox_notify();
"""


class Listener:
    """A LISTENing session of the test's own: the notifications that reached it, with the
    backend each came from."""

    def __init__(self) -> None:
        dsn = messaging_settings.relay_listen_dsn  # where the relays LISTEN
        self.connection = psycopg.connect(listen_conninfo("default", dsn), autocommit=True)
        self.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def received(self, wait: float) -> list[int]:
        """The sender pids of what arrives within ``wait`` seconds (all of it, not the first)."""
        pids: list[int] = []
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([self.connection.fileno()], [], [], left)
            if ready:
                self.connection.pgconn.consume_input()
                while (notify := self.connection.pgconn.notifies()) is not None:
                    pids.append(notify.be_pid)
        return pids

    def close(self) -> None:
        self.connection.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    listening = Listener()
    try:
        yield listening
    finally:
        listening.close()


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def statements_of(block: Any) -> list[str]:
    """The SQL the caller's connection executed while ``block()`` ran."""
    seen: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        block()
    return seen


def publish_in_a_transaction(count: int = 1) -> list[str]:
    with transaction.atomic():
        return [publish("wake.x", {"n": n}) for n in range(count)]


@postgresql_only
@direct_only
def test_the_callers_transaction_sends_no_notify(ob: OutboxEnv, listener: Listener) -> None:
    caller = backend_pid()
    statements = statements_of(publish_in_a_transaction)
    assert not [s for s in statements if "notify" in s.lower()], statements
    pids = listener.received(wait=2.0)
    assert pids, "the relay was not woken"
    assert caller not in pids, "the caller's own transaction sent a NOTIFY"


@postgresql_only
@direct_only
def test_a_notify_trigger_fails_that_check(ob: OutboxEnv, listener: Listener) -> None:
    caller = backend_pid()
    with connection.cursor() as cursor:
        cursor.execute(NOTIFY_TRIGGER)
    try:
        publish_in_a_transaction()
        assert caller in listener.received(wait=2.0)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(DROP_NOTIFY_TRIGGER)


@postgresql_only
def test_many_publishes_in_one_transaction_send_one_wake_up(
    ob: OutboxEnv, listener: Listener
) -> None:
    assert sender.flush()
    listener.received(wait=0.2)  # anything earlier tests left behind
    requested = sender.requested
    publish_in_a_transaction(count=50)
    assert sender.flush()
    assert sender.requested == requested + 1
    assert len(listener.received(wait=1.0)) == 1


@postgresql_only
def test_a_savepoint_rolled_back_keeps_the_outer_wake_up(ob: OutboxEnv, listener: Listener) -> None:
    with transaction.atomic():
        try:
            with transaction.atomic():
                publish("wake.lost", {})  # registers the callback inside the savepoint
                raise RuntimeError("roll the savepoint back")
        except RuntimeError:
            pass
        kept = publish("wake.kept", {})  # registers it again, outside
    assert len(listener.received(wait=2.0)) == 1
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == [kept]


@postgresql_only
def test_a_rollback_sends_no_wake_up(ob: OutboxEnv, listener: Listener) -> None:
    requested = sender.requested
    with pytest.raises(RuntimeError), transaction.atomic():
        publish("wake.x", {"n": 1})
        raise RuntimeError("roll back")
    assert sender.flush()
    assert sender.requested == requested
    assert listener.received(wait=1.0) == []


@postgresql_only
@direct_only
def test_publish_in_autocommit_wakes_the_relay(ob: OutboxEnv, listener: Listener) -> None:
    caller = backend_pid()
    publish("wake.auto", {"n": 1})
    pids = listener.received(wait=2.0)
    assert pids
    assert caller not in pids


@postgresql_only
@pytest.mark.slow
def test_the_real_relay_is_woken_after_the_commit(ob: OutboxEnv) -> None:
    # Polling every 30 s: only the wake-up sent after the commit explains a delivery within 5 s.
    ob.set(RELAY_POLL_INTERVAL=30.0)
    queue = ob.queue()
    relay = ob.relay_process().wait_connected()
    warmup = publish("wake.warmup", {"n": 0})
    wait_until(lambda: ob.broker.count(queue) == 1, timeout=30, message="the warm-up row")
    time.sleep(1.0)  # settled into its 30 s idle wait
    ids = publish_in_a_transaction(count=20)
    wait_until(
        lambda: ob.broker.count(queue) == 21,
        timeout=5,
        interval=0.02,
        message=lambda: f"the rows delivered after a wake-up; log:\n{relay.log()}",
    )
    assert [m.message_id for m in ob.broker.drain(queue, expected=21)] == [warmup, *ids]


@postgresql_only
@direct_only
def test_a_process_that_keeps_committing_spreads_its_wake_ups_and_a_quiet_one_is_woken_at_once(
    listener: Listener,
) -> None:
    """A commit every millisecond for a second: at most about 1 / MAX_SPACING NOTIFYs reach
    the relay, not one per SPACING; after a quiet spell the pause is back to SPACING, so the
    next commit's wake-up goes out at once."""
    own = WakeUpSender()
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            own.request("default")
            time.sleep(0.001)
        assert own.flush()
        # Only this sender's NOTIFYs (a notification names the backend that sent it).
        own_pid = own._connections["default"].info.backend_pid
        busy = listener.received(wait=0.3).count(own_pid)
        assert own.sent == busy
        # The pause doubles from SPACING to MAX_SPACING in the first few NOTIFYs, then stays.
        ramp = math.ceil(math.log2(MAX_SPACING / SPACING)) + 1
        assert busy <= 1.0 / MAX_SPACING + ramp + 2, (busy, own.sent)
        assert own.pause == SPACING  # the last pause ended with nothing waiting
        time.sleep(0.1)
        own.request("default")
        assert listener.received(wait=0.5).count(own_pid) == 1
        assert own.flush()
        assert own.pause == SPACING
    finally:
        own.close()


@postgresql_only
@pytest.mark.slow
def test_a_relay_that_sent_rows_finds_the_next_ones_without_a_wake_up_then_sleeps(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy publisher holds its wake-ups back for up to MAX_SPACING: what covers its rows
    meanwhile is the relay, which keeps looking for a while after it sent something. Rows
    committed with no wake-up at all, one every 20 ms, are sent as they come; once they stop,
    the relay stops looking within the trail and sleeps until woken."""
    assert MAX_SPACING < TRAIL_LAST  # a held-back wake-up is never needed during a trail
    # Polling every 30 s: within this test, only a wake-up or the trail explains a delivery.
    ob.set(RELAY_POLL_INTERVAL=30.0)
    # When the relay claims, seen from here: the trail's end is observed, not timed, so a
    # loaded machine (claims that take longer) cannot make the relay look as if it kept polling.
    looked_at: list[float] = []
    claim = OutboxClaims.claim

    def counted(claims: OutboxClaims) -> Any:
        looked_at.append(time.monotonic())
        return claim(claims)

    monkeypatch.setattr(OutboxClaims, "claim", counted)
    queue = ob.queue()
    relay = ob.relay_thread()
    publish("trail.warmup", {"n": 0})  # announced: the relay sends it and begins its trail
    wait_until(lambda: ob.broker.count(queue) == 1, timeout=30, interval=0.01, message="warm-up")
    monkeypatch.setitem(wake_after_commit._can_notify, "default", False)
    requested = sender.requested
    quiet = []
    for n in range(50):
        quiet.append(publish("trail.quiet", {"n": n}))
        time.sleep(0.02)
    sent_as_they_came = ob.broker.count(queue) - 1
    wait_until(
        lambda: ob.broker.count(queue) == 51,
        timeout=2,
        interval=0.02,
        message="the unannounced rows sent within 2 s of the last one",
    )
    assert sender.requested == requested  # none of them asked for a wake-up
    # Sent while the stream went on, not in one sweep at its end.
    assert sent_as_they_came >= 25, sent_as_they_came

    # The trail ends: the relay stops claiming, for longer than the trail's longest wait (its
    # waits double from TRAIL_FIRST to TRAIL_LAST, about 1.3 s in all on a quiet machine).
    quiet_for = TRAIL_LAST + 2.0
    wait_until(
        lambda: time.monotonic() - looked_at[-1] > quiet_for,
        timeout=30,
        interval=0.1,
        message="the relay stopping its claims after the trail",
    )
    looked = len(looked_at)
    late = publish("trail.late", {"n": 0})
    time.sleep(1.5)
    assert len(looked_at) == looked, "the relay kept polling after its trail"
    assert ob.broker.count(queue) == 51
    monkeypatch.setitem(wake_after_commit._can_notify, "default", True)
    woken = publish("trail.woken", {"n": 0})
    wait_until(lambda: ob.broker.count(queue) == 53, timeout=5, message="a wake-up sends both")
    assert not relay.done.is_set(), relay.error
    ob.stop_relay(relay)
    delivered = [m.message_id for m in ob.broker.drain(queue, expected=53)]
    assert delivered[1:51] == quiet
    assert sorted(delivered[51:]) == sorted([late, woken])


@postgresql_only
@pytest.mark.slow
def test_a_failed_wake_up_does_not_reach_the_caller_and_the_poll_delivers(
    ob: OutboxEnv,
) -> None:
    ob.set(RELAY_POLL_INTERVAL=1.0)
    queue = ob.queue()
    assert sender.flush()
    sender.close()
    # Nothing listens on port 1: the sender cannot connect.
    sender._conninfo["default"] = "host=127.0.0.1 port=1 dbname=nowhere connect_timeout=2"
    failed = sender.failed
    try:
        ids = publish_in_a_transaction(count=3)  # does not raise
        assert sender.flush(timeout=10)
        assert sender.failed == failed + 1
        relay = ob.relay_thread()
        wait_until(
            lambda: ob.broker.count(queue) == 3,
            timeout=30,
            message="the rows delivered by the relay's poll",
        )
        ob.stop_relay(relay)
    finally:
        sender._conninfo.pop("default", None)
        sender._retry_at.clear()
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 3
    assert sorted(m.message_id for m in ob.broker.drain(queue, expected=3)) == sorted(ids)


@on_sqlite
def test_sqlite_has_no_wake_up_machinery() -> None:
    requested = sender.requested
    with transaction.atomic():
        publish("wake.sqlite", {"n": 1})
        assert connection.run_on_commit == []
    publish("wake.sqlite", {"n": 2})  # autocommit
    assert sender.requested == requested
    assert OutboxMessage.objects.count() == 2


# Publishes in a transaction and exits at once, as a script or a short command does.
PUBLISH_AND_EXIT = """
import django
django.setup()
from django.db import transaction
from reliable_messaging import publish
with transaction.atomic():
    publish("wake.exit", {"n": 1})
"""


@postgresql_only
@direct_only
@pytest.mark.slow
def test_a_process_that_publishes_and_exits_at_once_still_wakes_the_relay(
    ob: OutboxEnv, listener: Listener
) -> None:
    """Its wake-up goes out before it exits (the sender's thread is a daemon thread, which the
    interpreter would otherwise stop with the wake-up unsent, leaving the rows to the poll)."""
    done = subprocess.run(
        [sys.executable, "-c", PUBLISH_AND_EXIT],
        cwd=ROOT,
        env=subprocess_env(ob.ns),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert OutboxMessage.objects.filter(routing_key="wake.exit").count() == 1
    assert listener.received(wait=2.0), "the process exited without waking the relay"
