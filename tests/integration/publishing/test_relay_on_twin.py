"""The relay's properties on the in-memory publisher (``StubPublisher``): the real relay, claims
and records on PostgreSQL, only the broker is the twin. What only a real broker can answer (real
frame_max, memory alarms, a cluster, RabbitMQ 4.0, mandatory returns from a real exchange) stays
in the tests against RabbitMQ."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection as db_connection
from django.db import transaction
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.envelope import EXPIRES_AT_HEADER, PUBLISHED_AT_HEADER
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing import sent
from reliable_messaging.publishing.lanes import run_lanes
from reliable_messaging.publishing.relay import RelayReport, build_relay
from reliable_messaging.testing_broker import StubPublished, StubPublisher

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def own_settings() -> Iterator[None]:
    """What a test changes with :func:`configure` ends with the test."""
    with override_settings(RELIABLE_MESSAGING={**django_settings.RELIABLE_MESSAGING}):
        yield


@pytest.fixture(autouse=True)
def no_retry_within_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that failed waits its backoff and a minute more. A once-run ends when no row is
    due, and a busy machine's can outlast a first backoff (1 s: a reconnect after a confirm
    timeout alone takes 0.4 to 0.6 s), sending a failed row a second time in the same run.
    The tests say when a row is due again (:func:`make_due`)."""
    backoff = sent.resend_backoff
    monkeypatch.setattr(sent, "resend_backoff", lambda n: backoff(n) + dt.timedelta(minutes=1))


def configure(**values: Any) -> None:
    django_settings.RELIABLE_MESSAGING = {**django_settings.RELIABLE_MESSAGING, **values}


def relay_once(stub: StubPublisher, **kwargs: Any) -> RelayReport:
    return build_relay(transport=stub, once=True, listen=False, **kwargs).run()


def row(message_id: str) -> OutboxMessage:
    return OutboxMessage.objects.get(message_id=message_id)


def make_due(*message_ids: str) -> None:
    """Skip a failed row's backoff."""
    OutboxMessage.objects.filter(message_id__in=message_ids).update(
        next_attempt_at=timezone.now() - dt.timedelta(seconds=1)
    )


def ids(messages: list[StubPublished]) -> list[str]:
    return [m.message_id for m in messages]


def write_row(routing_key: str, headers: dict[str, Any], **fields: Any) -> str:
    """A row publish() would refuse now (written before the refusal existed, or by another
    path)."""
    created = OutboxMessage.objects.create(
        message_id=fields.pop("message_id", f"direct-{time.monotonic_ns()}"),
        exchange=str(django_settings.RELIABLE_MESSAGING["EXCHANGE"]),
        routing_key=routing_key,
        body='{"n": 0}',
        headers=headers,
        next_attempt_at=Now(),
        created_at=fields.pop("created_at", Now()),
        **fields,
    )
    return str(created.message_id)


# --------------------------------------------------------------------------- batches, confirms


@pytest.mark.parametrize("confirms", ["in order", "reverse", "multiple"])
def test_every_row_goes_once_in_batches_whatever_the_order_of_the_confirms(
    confirms: str,
) -> None:
    with transaction.atomic():
        sent = [
            publish(f"order.{i % 3}", {"n": i}, headers={"tenant": "acme"} if i % 2 else None)
            for i in range(25)
        ]
    stub = StubPublisher(confirms=confirms)
    batches: list[int] = []

    report = relay_once(stub, batch_size=10, on_batch=lambda r: batches.append(r.sent))

    assert (report.sent, report.batches, report.nacked) == (25, 3, 0)
    # Batches settled by one ack (multiple) are recorded side by side, in either order.
    assert len(batches) == 3 and batches[-1] == 25
    assert Counter(ids(stub.routed)) == Counter(sent)
    assert not OutboxMessage.objects.exclude(status=OutboxStatus.SENT).exists()
    for message in stub.published:
        r = row(message.message_id)
        assert message.headers["x-rm-outbox-id"] == r.pk
        assert message.headers["x-rm-published-at"] == int(r.created_at.timestamp() * 1000)
        assert (message.routing_key, message.body.decode()) == (r.routing_key, r.body)
        assert message.headers.get("tenant") == r.headers.get("tenant")


def test_a_nacked_row_is_retried_then_failed_after_outbox_max_attempts() -> None:
    configure(OUTBOX_MAX_ATTEMPTS=2)
    with transaction.atomic():
        ok1 = publish("ok.1", {"n": 1})
        refused = publish("full.2", {"n": 2})
        ok2 = publish("ok.3", {"n": 3})
    stub = StubPublisher(confirms="multiple", nack=lambda m: m.routing_key.startswith("full."))
    before = timezone.now()

    report = relay_once(stub)
    assert (report.sent, report.nacked) == (2, 1)
    assert (report.left_pending, report.left_retrying, report.left_failed) == (1, 1, 0)
    bad = row(refused)
    assert (bad.status, bad.attempts, bad.last_error) == (
        OutboxStatus.PENDING,
        1,
        "nacked by the broker",
    )
    assert bad.next_attempt_at is not None
    assert bad.next_attempt_at >= before + dt.timedelta(seconds=1)  # backed off (1 s at first)
    # Not due yet: left alone. (A minute, not the first backoff's second: a loaded machine's
    # next relay run can start that late.)
    OutboxMessage.objects.filter(pk=bad.pk).update(
        next_attempt_at=timezone.now() + dt.timedelta(minutes=1)
    )
    assert relay_once(stub).nacked == 0

    make_due(refused)
    assert relay_once(stub).nacked == 1
    assert (row(refused).status, row(refused).attempts) == (OutboxStatus.FAILED, 2)
    make_due(refused)
    assert relay_once(stub).left_failed == 1  # a failed row is never picked up again
    assert ids(stub.nacked) == [refused, refused]
    assert ids(stub.routed) == [ok1, ok2]


def test_returned_events_are_unrouted_and_returned_commands_retried_then_failed() -> None:
    configure(REQUIRE_ROUTE=["cmd.#"], OUTBOX_MAX_ATTEMPTS=2)
    with transaction.atomic():
        ok = publish("ok.1", {"n": 1})
        event = publish("evt.nobody", {"n": 2})
        command = publish("cmd.nobody", {"n": 3})
    stub = StubPublisher(routes=["ok.#"])

    report = relay_once(stub)
    assert (report.sent, report.returned, report.unrouted) == (1, 2, 1)
    assert row(ok).status == OutboxStatus.SENT
    assert (row(event).status, row(event).attempts) == (OutboxStatus.UNROUTED, 0)
    bad = row(command)
    assert (bad.status, bad.attempts) == (OutboxStatus.PENDING, 1)
    assert bad.last_error.startswith("unroutable: 312 NO_ROUTE"), bad.last_error
    assert "cmd.nobody" in bad.last_error

    make_due(command)
    relay_once(stub)
    assert (row(command).status, row(command).attempts) == (OutboxStatus.FAILED, 2)

    # A queue bound for it later, the admin's retry makes it go.
    stub.routes = ("#",)
    OutboxMessage.objects.filter(message_id=command).update(
        status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now()
    )
    assert relay_once(stub).sent == 1
    assert ids(stub.routed) == [ok, command]


# --------------------------------------------------------------------------- rows refused


def test_a_missing_exchange_fails_its_rows_and_the_batch_goes() -> None:
    missing = "rmtest.twin.missing"
    with transaction.atomic():
        before = publish("a.1", {"n": 1})
        lost = publish("a.2", {"n": 2}, exchange=missing)
        after = [publish(f"a.{i}", {"n": i}) for i in range(3, 10)]
    stub = StubPublisher(missing=[missing])

    report = relay_once(stub)
    assert report.sent == 8
    bad = row(lost)
    assert (bad.status, bad.attempts) == (OutboxStatus.PENDING, 1)
    assert bad.last_error == f"exchange {missing!r} does not exist"
    assert ids(stub.routed) == [before, *after]
    assert stub.channel_closes == []  # the probe kept it from closing the channel


def test_an_exchange_deleted_after_the_probe_fails_its_rows_and_the_others_go_again() -> None:
    doomed = "rmtest.twin.doomed"
    first = publish("a.0", {"n": 0}, exchange=doomed)
    stub = StubPublisher()
    assert relay_once(stub).sent == 1  # the probe now remembers the exchange
    with transaction.atomic():
        ok = [publish(f"a.{i}", {"n": i}) for i in range(1, 4)]
        lost = publish("a.4", {"n": 4}, exchange=doomed)
        later = [publish(f"a.{i}", {"n": i}) for i in range(5, 8)]
    stub.delete_exchange(doomed)

    relay_once(stub)
    assert stub.channel_closes == [(404, f"NOT_FOUND - no exchange '{doomed}' in vhost '/'")]
    bad = row(lost)
    assert (bad.status, bad.attempts) == (OutboxStatus.PENDING, 1)
    assert bad.last_error == f"exchange {doomed!r} does not exist"
    # Confirmed before the close: sent; published after it: sent again on a new channel.
    assert Counter(ids(stub.routed)) == Counter([first, *ok, *later])
    assert not OutboxMessage.objects.filter(message_id__in=ok + later).exclude(
        status=OutboxStatus.SENT
    )
    make_due(lost)
    relay_once(stub)
    assert row(lost).attempts == 2 and len(stub.channel_closes) == 1  # the probe says no now


def test_a_body_the_broker_refuses_fails_at_once_and_the_rows_around_it_go() -> None:
    with transaction.atomic():
        before = [publish("s.before", {"n": n}) for n in range(3)]
        big = publish("s.big", {"pad": "x" * 500})
        after = [publish("s.after", {"n": n}) for n in range(3)]
    size = len(row(big).body.encode())
    too_large = f"PRECONDITION_FAILED - message size {size} is larger than configured max size 300"
    stub = StubPublisher(refuse=lambda m: (406, too_large) if len(m.body) > 300 else None)

    relay_once(stub)
    bad = row(big)
    assert (bad.status, bad.attempts) == (OutboxStatus.FAILED, 1)  # not retried: final
    assert "max_message_size is 300" in bad.last_error, bad.last_error
    assert Counter(ids(stub.routed)) == Counter(before + after)
    assert stub.connections == 1  # a channel close, not the connection


def test_a_header_frame_over_frame_max_fails_for_good_and_the_rows_around_it_go() -> None:
    before = [publish("iso.before", {"n": n}) for n in range(5)]
    big = write_row("iso.big", {"big": "a" * 5_000})
    after = [publish("iso.after", {"n": n}) for n in range(5)]
    stub = StubPublisher(frame_max=4096)

    relay_once(stub, batch_size=4)
    bad = row(big)
    assert (bad.status, bad.attempts) == (OutboxStatus.FAILED, 1)
    assert "frame_max, 4096 bytes" in bad.last_error, bad.last_error
    assert "frame_too_large" in stub.connection_closes[0]
    assert Counter(ids(stub.routed)) == Counter(before + after)
    assert stub.connections == 2  # one reconnect


@pytest.mark.parametrize(
    "bad",
    [
        {"created_at": dt.datetime(1960, 1, 1, tzinfo=dt.UTC)},
        {"headers": {"x-rm-expires-at": 10**20}},
    ],
    ids=["timestamp-before-1970", "header-int-over-64-bits"],
)
def test_a_row_pika_cannot_encode_fails_at_once_and_the_others_go(bad: dict[str, Any]) -> None:
    first = publish("iso.first", {"n": 1})
    fields = dict(bad)
    unsendable = write_row("iso.bad", fields.pop("headers", {}), **fields)
    last = publish("iso.last", {"n": 2})
    stub = StubPublisher()

    relay_once(stub)
    r = row(unsendable)
    assert (r.status, r.attempts) == (OutboxStatus.FAILED, 1)
    assert "cannot encode" in r.last_error, r.last_error
    assert ids(stub.routed) == [first, last]
    assert stub.connections == 1 and stub.channel_closes == []


# --------------------------------------------------------------------------- the connection


def test_a_dropped_connection_loses_no_row_and_marks_none_sent_without_its_confirm() -> None:
    with transaction.atomic():
        sent = [publish("drop.x", {"n": i}) for i in range(30)]
    stub = StubPublisher()

    def drop_mid_batch(message: StubPublished) -> None:
        if message.connection == 1 and len(stub.published) == 15:
            # Every row of this batch is unconfirmed: the connection goes before any ack.
            stub.drop_connection()

    stub.on_publish = drop_mid_batch
    report = relay_once(stub, batch_size=10)

    assert stub.connections == 2
    assert report.sent == 30
    assert Counter(ids(stub.routed)) == Counter(sent)  # each acked exactly once
    on_first = [m for m in stub.routed if m.connection == 1]
    dropped = {m.message_id for m in stub.published if m.connection == 1} - set(ids(on_first))
    assert len(dropped) == 5  # the batch the drop cut short (the rest of it was never read)
    assert {m.message_id for m in stub.published if m.connection == 2} >= dropped  # sent again
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT, attempts=0).count() == 30


def test_a_batch_without_confirms_times_out_and_goes_again_on_a_new_connection() -> None:
    configure(RELAY_CONFIRM_TIMEOUT=0.2)
    with transaction.atomic():
        held = [publish("slow.x", {"n": i}) for i in range(4)]
    stub = StubPublisher(confirms="hold")

    report = relay_once(stub)
    assert report.timed_out == 4 and report.sent == 0
    assert stub.connection_closes[0] == str((200, "confirm timeout"))
    for message_id in held:
        r = row(message_id)
        assert (r.status, r.attempts) == (OutboxStatus.PENDING, 1)
        assert r.last_error == "no confirm from the broker within 0.2s"

    stub.confirms = "in order"
    make_due(*held)
    assert relay_once(stub).sent == 4
    assert Counter(ids(stub.routed)) == Counter(held)


def test_a_blocked_connection_holds_confirms_without_timing_out() -> None:
    configure(RELAY_CONFIRM_TIMEOUT=0.2)
    with transaction.atomic():
        sent = [publish("block.x", {"n": i}) for i in range(6)]
    stub = StubPublisher()

    def block_once(message: StubPublished) -> None:
        if len(stub.published) == 1:
            stub.block()
            stub.call_later(0.6, stub.unblock)  # three confirm timeouts later

    stub.on_publish = block_once
    report = relay_once(stub, batch_size=3)
    assert (report.sent, report.timed_out) == (6, 0)
    assert stub.connections == 1
    assert Counter(ids(stub.routed)) == Counter(sent)


def test_a_database_outage_is_said_once_and_its_end_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The claims fail three times (the database unavailable), then work: one WARNING for the
    outage, each retry at DEBUG, one INFO when the database is back; the row is sent."""
    from django.db import OperationalError

    from reliable_messaging.publishing.claims import OutboxClaims

    claim = OutboxClaims.claim
    failures = iter(range(3))

    def failing(self: OutboxClaims) -> Any:
        if next(failures, None) is not None:
            raise OperationalError("connection refused")
        return claim(self)

    monkeypatch.setattr(OutboxClaims, "claim", failing)
    sent = publish("outage.x", {"n": 1})
    caplog.set_level(logging.DEBUG, logger="reliable_messaging.relay")
    stub = StubPublisher()

    assert relay_once(stub).sent == 1
    assert ids(stub.routed) == [sent]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "database" in r.getMessage()]
    unavailable = [level for level, text in said if "database unavailable" in text]
    assert unavailable == [logging.WARNING, logging.DEBUG, logging.DEBUG], said
    back = [level for level, text in said if "database available again" in text]
    assert back == [logging.INFO], said


# --------------------------------------------------------------------------- order, lanes


def test_keys_keep_their_order_across_lanes_and_a_failed_head_holds_only_its_key() -> None:
    configure(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["stuck.#"])
    keys = [f"key-{k}" for k in range(4)]
    published: dict[str | None, list[str]] = defaultdict(list)
    with transaction.atomic():
        head = publish("stuck.a", {"n": 0}, ordering_key="A")  # unroutable command: failed
        behind = publish("ok.a", {"n": 1}, ordering_key="A")
        for seq in range(8):
            for key in keys:
                published[key].append(publish("ok.seq", {"seq": seq}, ordering_key=key))
            published[None].append(publish("ok.free", {"seq": seq}))
    wire: list[StubPublished] = []  # the order the broker took them in, across both lanes
    stubs = [
        StubPublisher(confirms="reverse", routes=["ok.#"], on_publish=wire.append) for _ in range(2)
    ]

    report = run_lanes(
        [build_relay(transport=s, once=True, listen=False, batch_size=3) for s in stubs]
    )

    everything = [m for ids_ in published.values() for m in ids_]
    assert report.sent == len(everything)
    assert Counter(m.message_id for s in stubs for m in s.routed) == Counter(everything)
    for key in keys:
        assert [m.message_id for m in wire if m.headers.get("x-rm-ordering-key") == key] == (
            published[key]
        )
    assert row(head).status == OutboxStatus.FAILED
    assert (row(behind).status, row(behind).attempts) == (OutboxStatus.PENDING, 0)
    assert behind not in {m.message_id for m in wire}

    # Its cause fixed and the head retried, the key's rows go, in order.
    stubs[0].routes = ("#",)
    OutboxMessage.objects.filter(message_id=head).update(
        status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now()
    )
    assert relay_once(stubs[0]).sent == 2
    assert ids(stubs[0].routed[-2:]) == [head, behind]


# --------------------------------------------------------------------------- scheduled rows


def test_a_scheduled_row_goes_when_due_and_counts_its_age_from_then() -> None:
    # Far enough ahead that the first relay_once comes before it on a loaded machine.
    due_at = timezone.now() + dt.timedelta(seconds=1.5)
    later = publish("sched.x", {"n": 1}, deliver_at=due_at)
    now = publish("sched.now", {"n": 2})
    stub = StubPublisher()

    assert relay_once(stub).sent == 1
    assert ids(stub.routed) == [now]
    time.sleep(max(0.0, (due_at - timezone.now()).total_seconds()) + 0.05)
    assert relay_once(stub).sent == 1
    message = stub.routed[-1]
    assert message.message_id == later
    assert message.headers["x-rm-published-at"] == int(due_at.timestamp() * 1000)
    assert row(later).status == OutboxStatus.SENT


def test_a_past_deliver_at_goes_at_once_and_counts_its_age_from_the_call() -> None:
    called = time.time()
    with transaction.atomic():
        past = publish(
            "past.x", {}, deliver_at=timezone.now() - dt.timedelta(minutes=1), expires=60
        )
    stub = StubPublisher()

    assert relay_once(stub).sent == 1
    [message] = stub.routed
    assert message.message_id == past
    # Neither its published-at nor its deadline is counted from the date a minute ago.
    assert message.headers[PUBLISHED_AT_HEADER] >= int(called * 1000) - 1000  # the DB's clock
    assert message.headers[EXPIRES_AT_HEADER] >= int((called + 60) * 1000)


def _backlog(name: str, count: int) -> None:
    """``count`` rows due now, written in one statement."""
    now = timezone.now()
    OutboxMessage.objects.bulk_create(
        OutboxMessage(
            message_id=f"{name}-{n}",
            exchange=str(django_settings.RELIABLE_MESSAGING["EXCHANGE"]),
            routing_key="noise.x",
            body="{}",
            next_attempt_at=now,
            created_at=now,
        )
        for n in range(count)
    )


def test_a_busy_relay_sends_a_row_falling_due_before_the_rows_written_after_its_due_time() -> None:
    """The relay's first look knows of nothing due before tomorrow; a row due a second later
    is written while a backlog keeps every claim full (a publisher taking 1 ms per message).
    It must still fall due within SCHEDULED_LOOK of its time, so it takes its place in the line
    ahead of the rows written a second after that, and it goes."""
    publish("sched.tomorrow", {}, delay=dt.timedelta(days=1))
    _backlog("first", 5000)
    taken = threading.Event()
    seen: dict[str, Any] = {}

    def on_publish(message: StubPublished) -> None:
        taken.set()
        time.sleep(0.001)  # a slow broker: busy, at no CPU

    def meanwhile() -> None:
        try:
            taken.wait(30)
            due_at = timezone.now() + dt.timedelta(seconds=1)
            seen["busy"] = publish("sched.busy", {}, deliver_at=due_at)
            time.sleep(max(0.0, (due_at - timezone.now()).total_seconds()) + 1.0)
            seen["first pending"] = OutboxMessage.objects.filter(
                message_id__startswith="first-", status=OutboxStatus.PENDING
            ).count()
            _backlog("second", 300)
        finally:
            db_connection.close()

    writer = threading.Thread(target=meanwhile)
    writer.start()
    stub = StubPublisher(on_publish=on_publish)
    try:
        relay_once(stub, batch_size=100)
    finally:
        writer.join(60)

    assert seen["first pending"] > 0, "the backlog was all sent before the second rows came"
    relay_once(stub)  # whatever the first run left due when it ended
    busy = row(seen["busy"])
    assert busy.status == OutboxStatus.SENT
    # Its place in the line is the id it got when it fell due (not the order batches in flight
    # were recorded in, sent_at).
    overtaken = OutboxMessage.objects.filter(message_id__startswith="second-", pk__lt=busy.pk)
    assert not overtaken.exists(), f"{overtaken.count()} rows written after its due time went first"
    assert not OutboxMessage.objects.filter(
        status=OutboxStatus.PENDING, deliver_at__isnull=True
    ).exists()


@pytest.mark.parametrize(
    "bad",
    [{"routing_key": "é" * 200}, {"message_id": "é" * 200}, {"headers": {"k" * 300: 1}}],
    ids=["routing-key-400-bytes", "message-id-400-bytes", "header-name-300-bytes"],
)
def test_a_row_amqp_cannot_carry_fails_and_the_others_go(bad: dict[str, Any]) -> None:
    first = publish("ok.before", {"n": 1})
    fields = dict(bad)
    headers = fields.pop("headers", {})
    routing_key = fields.pop("routing_key", "ok.bad")
    unsendable = write_row(routing_key, headers, **fields)
    last = publish("ok.after", {"n": 3})
    stub = StubPublisher()

    relay_once(stub)
    r = row(unsendable)
    assert (r.status, r.attempts) == (OutboxStatus.FAILED, 1)
    assert "cannot encode" in r.last_error, r.last_error
    assert ids(stub.routed) == [first, last]
