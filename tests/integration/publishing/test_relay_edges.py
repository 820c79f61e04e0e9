"""The relay at its edges (issue 12): a row the broker refuses with a channel close, LISTEN
after a reconnect, the LISTEN connection's parameters, psycopg 3 missing, a skewed clock, and
events nobody subscribes to (``REQUIRE_ROUTE``). Real PostgreSQL and RabbitMQ throughout."""

from __future__ import annotations

import datetime as dt
import logging
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.checks import check_settings
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.ops.collectors import database_status
from reliable_messaging.ops.status import Thresholds, find_problems
from reliable_messaging.publishing import wake_after_commit
from reliable_messaging.publishing.listener import OutboxListener
from reliable_messaging.publishing.relay import RelayReport, build_relay
from reliable_messaging.storage.retention import purge_messages
from tests import support
from tests.markers import direct_only
from tests.support import wait_until

from .conftest import OutboxEnv, RelayProcess

pytestmark = pytest.mark.django_db(transaction=True)


def relay_once() -> RelayReport:
    return build_relay(once=True).run()


def row(message_id: str) -> OutboxMessage:
    return OutboxMessage.objects.get(message_id=message_id)


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        value: dt.datetime = cursor.fetchone()[0]
    return value


# --------------------------------------------------------------------------- 1. channel closes


def test_a_row_the_broker_refuses_with_403_fails_and_the_rows_after_it_are_sent(
    ob: OutboxEnv,
) -> None:
    # Publishing to an internal exchange is refused with 403 ACCESS_REFUSED and a channel
    # close, as a missing write permission is; the exchange probe sees it exists.
    internal = f"rmtest.{ob.ns}.internal"
    with ob.broker.channel() as ch:
        ch.exchange_declare(internal, exchange_type="topic", durable=True, internal=True)
    ob.set(OUTBOX_MAX_ATTEMPTS=2, RELAY_POLL_INTERVAL=0.2)
    queue = ob.queue()
    with transaction.atomic():
        before = [publish(f"good.{n}", {"n": n}) for n in range(3)]
        bad = publish("bad.x", {"n": 99}, exchange=internal)
        after = [publish(f"good.{n}", {"n": n}) for n in range(3, 6)]
    good = {*before, *after}

    relay = ob.relay_process()
    wait_until(
        lambda: (
            row(bad).status == OutboxStatus.FAILED
            and OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == len(good)
        ),
        timeout=30,
        message=lambda: f"the bad row failed and the others sent; log:\n{relay.log()}",
    )
    refused = row(bad)
    assert refused.attempts == 2
    assert "403" in refused.last_error and "ACCESS_REFUSED" in refused.last_error
    assert internal in refused.last_error
    time.sleep(1.0)  # anything still being re-sent would show up now
    delivered = Counter(m.message_id for m in ob.broker.drain(queue, expected=len(good)))
    assert set(delivered) == good
    # Rows after the refused one never reached the broker (it ignores a channel's frames after
    # closing it): sent once, in the next batch. Rows published before it in the same batch
    # lost their confirms with the channel, so they stay pending and go once more (a row is
    # marked sent only after its confirm; consumers absorb the copy). Never more than that:
    # no re-publishing loop.
    assert [delivered[m] for m in after] == [1, 1, 1], delivered
    assert all(delivered[m] in (1, 2) for m in before), delivered
    assert relay.returncode is None


# --------------------------------------------------------------------------- 2. LISTEN again


def _relay_connection_names(process: RelayProcess) -> list[str]:
    """Names (management API) of the broker connections ``process`` opened as "relay"."""
    broker_port = urllib.parse.urlsplit(support.broker_url()).port or 5672
    out = subprocess.run(
        ["ss", "-tnpH", "state", "established", f"( dport = :{broker_port} )"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    ports = {
        int(match.group(1))
        for line in out.splitlines()
        if f"pid={process.pid}," in line
        for match in [re.search(rf":(\d+)\s+\S+:{broker_port}\b", line)]
        if match
    }
    connections = support.management("GET", "/connections?columns=name,peer_port,client_properties")
    assert isinstance(connections, list)
    return [
        c["name"]
        for c in connections
        if c.get("peer_port") in ports
        and (c.get("client_properties") or {}).get("connection_name") == "relay"
    ]


def test_listen_still_wakes_the_relay_after_a_broker_reconnect(ob: OutboxEnv) -> None:
    # Polling every 30 s: only a NOTIFY wake-up explains a delivery within 5 s.
    ob.set(RELAY_POLL_INTERVAL=30.0)
    queue = ob.queue()
    relay = ob.relay_process().wait_connected()
    first = publish("notify.first", {"n": 1})
    wait_until(lambda: ob.broker.count(queue) == 1, timeout=10, message="the first row")

    names = wait_until(
        lambda: _relay_connection_names(relay), timeout=10, message="the relay's connection"
    )
    for name in names:
        support.management("DELETE", f"/connections/{urllib.parse.quote(name, safe='')}")
    wait_until(
        lambda: relay.log().count("relay: publishing the outbox") >= 2,
        timeout=30,
        message=lambda: f"the relay reconnected; log:\n{relay.log()}",
    )
    time.sleep(1.0)  # settled into its 30 s idle wait

    second = publish("notify.second", {"n": 2})
    wait_until(
        lambda: ob.broker.count(queue) == 2,
        timeout=5,
        interval=0.02,
        message=lambda: f"the row sent after the reconnect by a NOTIFY; log:\n{relay.log()}",
    )
    assert [m.message_id for m in ob.broker.drain(queue, expected=2)] == [first, second]


# --------------------------------------------------------------------------- 3. OPTIONS


@direct_only  # through a pooler the LISTEN is not a session of its own
def test_the_listen_connection_uses_the_database_options(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"rm-listen-{ob.ns}"
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "application_name", name)
    listener = OutboxListener("default")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                "AND query LIKE 'LISTEN%%'",
                [name],
            )
            assert cursor.fetchone()[0] == 1
    finally:
        listener.close()


# --------------------------------------------------------------------------- 4. no psycopg 3


def test_missing_psycopg_is_said_once_and_names_the_extra(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ob.set(RELAY_POLL_INTERVAL=0.2)
    queue = ob.queue()
    monkeypatch.setitem(sys.modules, "psycopg", None)  # "import psycopg" raises ImportError
    # publish() remembers per process whether it can wake the relay: what it finds out here,
    # without psycopg, must not outlive the test (later tests of this worker expect wake-ups).
    monkeypatch.setattr(wake_after_commit, "_can_notify", {})
    message_id = publish("poll.x", {"n": 1})
    with caplog.at_level(logging.WARNING, logger="reliable_messaging.relay"):
        build_relay(max_seconds=11.0).run()  # said once, not every 5 s
    said = [r.getMessage() for r in caplog.records if "LISTEN" in r.getMessage()]
    assert len(said) == 1, said
    assert 'pip install "reliable-messaging[postgres]"' in said[0]
    assert row(message_id).status == OutboxStatus.SENT  # polling still sends
    assert ob.broker.count(queue) == 1


# --------------------------------------------------------------------------- 5. clock skew


@pytest.mark.parametrize("skew_hours", [1, -1], ids=["relay-ahead", "relay-behind"])
def test_the_relay_goes_by_the_database_clock(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch, skew_hours: int
) -> None:
    queue = ob.queue()
    with transaction.atomic():
        due = publish("clock.due", {"n": 1})
        later = publish("clock.later", {"n": 2})
        refused = publish("clock.refused", {"n": 3}, exchange=f"rmtest.{ob.ns}.missing")
    OutboxMessage.objects.filter(message_id__in=[due, refused]).update(
        next_attempt_at=Now() - dt.timedelta(seconds=1)
    )
    OutboxMessage.objects.filter(message_id=later).update(
        next_attempt_at=Now() + dt.timedelta(seconds=60)
    )
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + dt.timedelta(hours=skew_hours))

    report = relay_once()

    assert report.sent == 1
    assert row(due).status == OutboxStatus.SENT
    assert (row(later).status, row(later).attempts) == (OutboxStatus.PENDING, 0)
    # The failed row's backoff (1 s) counts from the database's clock too.
    refused_at = row(refused).next_attempt_at
    assert refused_at is not None
    retry_in = (refused_at - db_now()).total_seconds()
    assert row(refused).attempts == 1 and 0 < retry_in <= 5, retry_in
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [due]


# --------------------------------------------------------------------------- 6. REQUIRE_ROUTE


def test_an_event_nobody_subscribes_to_is_unrouted_not_retried(ob: OutboxEnv) -> None:
    queue = ob.queue(bindings=["order.#"])
    with transaction.atomic():
        first = publish("order.placed", {"n": 1})
        event = publish("payment.captured", {"n": 2})
        last = publish("order.shipped", {"n": 3})

    code, log = ob.run_relay_once(60)
    assert code == 0, log
    assert "marked unrouted" in log and event in log
    unrouted = row(event)
    assert (unrouted.status, unrouted.attempts) == (OutboxStatus.UNROUTED, 0)
    assert unrouted.sent_at is not None and "no queue" in unrouted.last_error
    assert {row(first).status, row(last).status} == {OutboxStatus.SENT}

    # Never tried again, not even when a queue is bound for it later.
    ob.broker.bind(queue, ob.exchange, "payment.#")
    assert relay_once().sent == 0
    assert row(event).status == OutboxStatus.UNROUTED
    assert [m.message_id for m in ob.broker.drain(queue, expected=2)] == [first, last]

    # messaging_status shows it without calling it a problem.
    figures = database_status()
    assert figures.outbox_unrouted == 1 and figures.outbox_failed == 0
    assert figures.outbox_pending == 0
    assert not [
        p for p in find_problems(_no_broker(), figures, Thresholds()) if "outbox" in p.threshold
    ]

    # Retention purges it like a sent row.
    purged = purge_messages(now=timezone.now() + dt.timedelta(days=365))
    assert purged.outbox == 3
    assert not OutboxMessage.objects.exists()


def _no_broker():  # type: ignore[no-untyped-def]
    from reliable_messaging.broker.queues import BrokerStatus

    return BrokerStatus(url="", reachable=False)


@pytest.mark.parametrize("value", ["billing.#", ["ok", ""], ["a..b"], [1], {"a": 1}], ids=repr)
def test_a_malformed_require_route_is_a_check_error(value: object) -> None:
    with override_settings(RELIABLE_MESSAGING={"REQUIRE_ROUTE": value}):
        ids = [m.id for m in check_settings()]
    assert "reliable_messaging.E045" in ids


def test_a_valid_require_route_passes_the_checks() -> None:
    with override_settings(RELIABLE_MESSAGING={"REQUIRE_ROUTE": ["billing.command.#", "*.x"]}):
        ids = [m.id for m in check_settings()]
    assert "reliable_messaging.E045" not in ids


# --------------------------------------------------------------------------- default LOGGING


def test_with_the_default_logging_the_relay_says_it_started_and_what_it_did(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project fresh from startproject configures no handler for this app's loggers: the
    relay still says what it sends to, and its summary, once each."""
    monkeypatch.setenv("RM_DEFAULT_LOGGING", "1")
    queue = ob.queue()
    with transaction.atomic():
        for n in range(3):
            publish("say.hello", {"n": n})
    code, log = ob.run_relay_once(120)
    assert code == 0, log
    assert log.count("relay: sending the outbox of database 'default' to amqp://") == 1, log
    assert ", until nothing is due" in log
    assert "relay: sent 3," in log
    assert "guest:guest" not in log  # the broker's password is never shown
    assert ob.broker.count(queue) == 3
