"""Scheduled delivery with real processes: publish(deliver_at/delay) → relay → consume.

tests.alpha is bound to ``order.*`` and tests.gamma (ordered) to ``seq.*``; their handlers write an
Effect row in their transaction, stamped with this machine's clock when it took effect. Each
``consume`` runs with ``--no-relay``: the relay under test is the only one sending.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone

from reliable_messaging import cancel_scheduled, publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from tests.conftest import database_url, subprocess_env
from tests.markers import postgresql_only
from tests.support import ConsumeProcess, RelayProcess, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def effects(label: str) -> dict[str, list[Effect]]:
    found: dict[str, list[Effect]] = {}
    for effect in Effect.objects.filter(consumer=label).order_by("id"):
        found.setdefault(effect.message_id, []).append(effect)
    return found


def assert_on_time(due: dict[str, dt.datetime]) -> None:
    """Sent within a second of its due time (the relay's precision, what scheduling decides),
    and handled never before it. How soon the consumer then handles it is the consumer's
    latency, which a loaded host stretches whatever the schedule."""
    handled = effects("alpha")
    sent = dict(
        OutboxMessage.objects.filter(message_id__in=due).values_list("message_id", "sent_at")
    )
    for message_id, at in due.items():
        (effect,) = handled[message_id]
        early = (at - effect.created_at).total_seconds()
        assert early <= 0, f"{message_id} took effect {early:.3f}s before its due time"
        late = (sent[message_id] - at).total_seconds()
        assert 0 <= late < 1.0, f"{message_id} was sent {late:.3f}s after its due time"


def test_scheduled_messages_arrive_within_a_second_of_their_due_time_and_not_before(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """With an idle relay (it sleeps until the next due time, past its 5 s poll); a cancelled
    message never arrives. A relay kept busy by a backlog (it looks every 0.5 s) is tested on
    the twin publisher: test_relay_on_twin.py."""
    env = subprocess_env(ns)
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha", "--no-relay"], env, tmp_path / "consume.log"
    )
    consume.wait_consuming()
    relay = RelayProcess([], env, tmp_path / "relay.log")
    try:
        relay.wait_for_log("relay", timeout=30)
        time.sleep(1.0)  # connected, listening and idle
        start = timezone.now()
        due = {}
        for n in range(3):
            at = start + dt.timedelta(seconds=2 + 1.5 * n)
            due[publish("order.remind", {"n": n}, deliver_at=at)] = at
        delayed = publish("order.remind", {"n": "delay"}, delay=dt.timedelta(seconds=3))
        with transaction.atomic():
            cancelled = publish("order.cancel_if_unpaid", {"n": "x"}, delay=2)
            assert cancel_scheduled(cancelled) is True
        wait_until(
            lambda: all(message_id in effects("alpha") for message_id in [*due, delayed]),
            timeout=30,
            message="every scheduled message handled",
        )
        assert_on_time(due)
        delayed_row = OutboxMessage.objects.get(message_id=delayed)
        assert delayed_row.deliver_at is not None
        assert_on_time({delayed: delayed_row.deliver_at})

        assert cancelled not in effects("alpha")
        assert not OutboxMessage.objects.filter(message_id=cancelled).exists()
    finally:
        relay.close()
        consume.close()


def test_a_relay_killed_while_scheduled_rows_fall_due_loses_and_doubles_nothing(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """3,000 messages due at the same second; the relay is killed -9 while it makes them
    pending and sends them, then started again: each is handled exactly once."""
    env = subprocess_env(ns)
    due_at = timezone.now() + dt.timedelta(seconds=2)
    ids: list[str] = []
    with transaction.atomic():
        ids = [publish("order.burst", {"n": n}, deliver_at=due_at) for n in range(3000)]
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha", "--concurrency", "4", "--no-relay"],
        env,
        tmp_path / "consume.log",
    )
    consume.wait_consuming()
    # Batches of 100: it is killed mid-way through the 3,000 rows (with 2,000-row batches the
    # whole burst could be sent before the kill).
    first = RelayProcess(["--batch-size", "100"], env, tmp_path / "relay-1.log")
    second: RelayProcess | None = None
    try:
        wait_until(
            lambda: OutboxMessage.objects.filter(status=OutboxStatus.SENT).exists(),
            timeout=30,
            interval=0.01,
            message="the relay started sending",
        )
        first.send(signal.SIGKILL)
        first.wait(30)
        left = OutboxMessage.objects.exclude(status=OutboxStatus.SENT).count()
        assert left > 0, "the kill came too late to test anything"
        second = RelayProcess([], env, tmp_path / "relay-2.log")
        wait_until(
            lambda: Effect.objects.filter(consumer="alpha").count() >= 3000,
            timeout=120,
            message="all 3,000 handled",
        )
        time.sleep(1.0)
        handled = effects("alpha")
        assert sorted(handled) == sorted(ids)
        doubled = [message_id for message_id, found in handled.items() if len(found) != 1]
        assert doubled == []
        assert not OutboxMessage.objects.exclude(status=OutboxStatus.SENT).exists()
    finally:
        for proc in (first, second, consume):
            if proc is not None:
                proc.close()


def test_a_scheduled_message_takes_its_place_in_its_keys_order_when_due(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """Key k: a message scheduled 3 s ahead, then two to send at once, then (after it fell due)
    a last one: the two go at once (it holds nothing back), and it comes after them and before
    the last. Key j: a message scheduled 1 s ahead, then one to send at once, both before any
    relay runs, which starts once the first is due: that one goes second (it took its place
    when it became pending, behind the message published while it waited)."""
    env = subprocess_env(ns)
    consume = ConsumeProcess(
        ["--queue", f"{ns}.gamma", "--no-relay"], env, tmp_path / "consume.log"
    )
    consume.wait_consuming()
    relay: RelayProcess | None = None
    try:
        later_at = timezone.now() + dt.timedelta(seconds=3)
        later = publish(
            "seq.k", {"key": "k", "seq": "later"}, ordering_key="k", deliver_at=later_at
        )
        publish("seq.k", {"key": "k", "seq": "first"}, ordering_key="k")
        publish("seq.k", {"key": "k", "seq": "second"}, ordering_key="k")
        publish("seq.j", {"key": "j", "seq": "scheduled"}, ordering_key="j", delay=1)
        publish("seq.j", {"key": "j", "seq": "at once"}, ordering_key="j")
        time.sleep(1.2)
        relay = RelayProcess([], env, tmp_path / "relay.log")
        wait_until(lambda: Effect.objects.filter(message_id=later).exists(), timeout=30)
        # Not before it was due (on a loaded host the relay may start after that: then the
        # three of key k are pending together, in the order below all the same).
        assert Effect.objects.get(message_id=later).created_at >= later_at
        publish("seq.k", {"key": "k", "seq": "last"}, ordering_key="k")
        wait_until(lambda: Effect.objects.filter(consumer="gamma").count() >= 6, timeout=30)
        order: dict[str, list[str]] = {}
        for effect in Effect.objects.filter(consumer="gamma").order_by("id"):
            payload: dict[str, str] = effect.payload or {}
            order.setdefault(payload["key"], []).append(payload["seq"])
        assert order == {
            "k": ["first", "second", "later", "last"],
            "j": ["at once", "scheduled"],
        }
    finally:
        if relay is not None:
            relay.close()
        consume.close()


class _Rollback(Exception):
    """Ends the test's cancelling transaction by a rollback."""


def _transactions(database: str) -> int:
    """Transactions committed and rolled back in ``database`` so far, by the statistics, on a
    connection of its own (one outside the test's open transaction sees them move)."""
    with psycopg.connect(database_url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [database],
        ).fetchone()
    assert row is not None
    return int(row[0])


def _cpu_ticks(pid: int) -> int:
    """User and system clock ticks the process ``pid`` has used (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@postgresql_only
def test_a_due_row_locked_by_an_open_cancel_leaves_the_relay_waiting_not_spinning(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """The docs' pattern: cancel_scheduled() in a transaction that then does slow work, past the
    row's due time. The relay cannot promote the locked row; it must look again after a wait,
    not at once (it ran about 900 transactions a second until the lock ended). The transaction
    then rolls back: the message is due again and is handled."""
    database = connection.settings_dict["NAME"]
    env = subprocess_env(ns)
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha", "--no-relay"], env, tmp_path / "consume.log"
    )
    consume.wait_consuming()
    relay = RelayProcess([], env, tmp_path / "relay.log")
    window = 4.0
    try:
        relay.wait_for_log("relay", timeout=30)
        time.sleep(1.5)  # connected, listening and idle
        before, ticks_before = _transactions(database), _cpu_ticks(relay.pid)
        time.sleep(window)
        idle = _transactions(database) - before - 1  # less the reading's own
        idle_ticks = _cpu_ticks(relay.pid) - ticks_before

        due_at = timezone.now() + dt.timedelta(seconds=1.5)
        message_id = publish("order.remind", {"locked": True}, deliver_at=due_at)
        with contextlib.suppress(_Rollback), transaction.atomic():
            assert cancel_scheduled(message_id) is True  # the row stays locked until the end
            time.sleep(max(0.0, (due_at - timezone.now()).total_seconds()) + 1.0)
            start, ticks_start = _transactions(database), _cpu_ticks(relay.pid)
            time.sleep(window)
            locked = _transactions(database) - start - 1
            locked_ticks = _cpu_ticks(relay.pid) - ticks_start
            raise _Rollback
        wait_until(
            lambda: message_id in effects("alpha"),
            timeout=30,
            message="the message handled once the cancel rolled back",
        )
        print(
            f"over {window:.0f} s: {idle} transactions and {idle_ticks} CPU ticks idle, "
            f"{locked} and {locked_ticks} while the due row was locked"
        )
        # Idle, a few a second (the operations process looks once a second); while locked, a
        # look every 0.5 s at most adds a handful a second: the spin added hundreds.
        assert locked <= idle + 40 * window, (idle, locked)
        hertz = os.sysconf("SC_CLK_TCK")
        assert locked_ticks <= idle_ticks + 0.1 * hertz * window, (idle_ticks, locked_ticks)
        assert len(effects("alpha")[message_id]) == 1
    finally:
        relay.close()
        consume.close()
