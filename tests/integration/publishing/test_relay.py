"""The relay against the real broker: delivery, properties, failures, order, parallel relays,
and the outbox admin."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter, defaultdict

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import RelayReport, build_relay

from .conftest import OutboxEnv, Received

pytestmark = pytest.mark.django_db(transaction=True)


def relay_once(**kwargs: object) -> RelayReport:
    return build_relay(once=True, **kwargs).run()  # type: ignore[arg-type]


def make_due(*message_ids: str) -> None:
    """Skip a failed row's backoff: make it due now instead of waiting."""
    OutboxMessage.objects.filter(message_id__in=message_ids).update(
        next_attempt_at=timezone.now() - dt.timedelta(seconds=1)
    )


def row(message_id: str) -> OutboxMessage:
    return OutboxMessage.objects.get(message_id=message_id)


def sent_counts(log: str) -> int:
    match = re.search(r"relay: sent (\d+),", log)
    assert match, log
    return int(match.group(1))


def assert_each_once(delivered: list[Received], expected_ids: set[str]) -> None:
    counts = Counter(m.message_id for m in delivered)
    duplicates = {k: v for k, v in counts.items() if v > 1}
    assert not duplicates, f"delivered more than once: {duplicates}"
    assert set(counts) == expected_ids


# --------------------------------------------------------------------------- draining


def test_relay_once_drains_every_row_once_with_properties_and_headers(ob: OutboxEnv) -> None:
    queue = ob.queue()
    with transaction.atomic():
        ids = [
            publish(
                f"order.event.{i % 3}",
                {"n": i, "amount": "9.99"},
                headers={"tenant": "acme", "n": i, "flags": {"vip": True, "tags": ["a", "b"]}}
                if i % 2
                else None,
                ordering_key=f"order-{i % 4}" if i % 10 == 0 else None,
            )
            for i in range(300)
        ]

    code, log = ob.run_relay_once(120, "--batch-size", "50")
    assert code == 0, log
    assert sent_counts(log) == 300
    batches = int(re.search(r"in (\d+) batch", log).group(1))  # type: ignore[union-attr]
    assert batches >= 300 // 50, log

    rows = {r.message_id: r for r in OutboxMessage.objects.all()}
    assert set(rows) == set(ids)
    assert all(r.status == OutboxStatus.SENT and r.sent_at is not None for r in rows.values())
    assert all(r.attempts == 0 and r.last_error == "" for r in rows.values())

    delivered = ob.broker.drain(queue, expected=300)
    assert_each_once(delivered, set(ids))
    for message in delivered:
        r = rows[message.message_id]
        props = message.properties
        assert message.exchange == ob.exchange
        assert message.routing_key == r.routing_key
        assert message.body.decode() == r.body
        assert props.content_type == "application/json"
        assert props.delivery_mode == 2
        assert props.timestamp == int(r.created_at.timestamp())
        headers = message.headers
        assert headers["x-rm-outbox-id"] == r.pk
        assert headers["x-rm-published-at"] == int(r.created_at.timestamp() * 1000)
        if r.ordering_key is None:
            assert "x-rm-ordering-key" not in headers
        else:
            assert headers["x-rm-ordering-key"] == r.ordering_key
        n = message.payload["n"]
        if n % 2:
            assert headers["tenant"] == "acme" and headers["n"] == n
            assert headers["flags"] == {"vip": True, "tags": ["a", "b"]}
        else:
            assert "tenant" not in headers


def test_once_with_nothing_pending_exits_zero(ob: OutboxEnv) -> None:
    code, log = ob.run_relay_once(60)
    assert code == 0, log
    assert "sent 0" in log


# --------------------------------------------------------------------------- failed sends


def test_unroutable_row_is_recorded_and_left_pending_while_others_are_sent(ob: OutboxEnv) -> None:
    ob.set(REQUIRE_ROUTE=["nowhere.#"])  # a command: unroutable, it is retried (not unrouted)
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        ok1 = publish("ok.one", {"n": 1})
        lost = publish("nowhere.two", {"n": 2})
        ok2 = publish("ok.three", {"n": 3})
        ok3 = publish("ok.four", {"n": 4})
    before = timezone.now()

    code, log = ob.run_relay_once(60)
    assert code == 1, log
    assert "1 are pending after failed sends" in log

    bad = row(lost)
    assert bad.status == OutboxStatus.PENDING
    assert bad.attempts == 1
    assert bad.last_error.startswith("unroutable: 312 NO_ROUTE"), bad.last_error
    assert "nowhere.two" in bad.last_error
    assert bad.next_attempt_at is not None and bad.next_attempt_at > before  # backed off
    assert bad.sent_at is None
    for good in (ok1, ok2, ok3):
        assert row(good).status == OutboxStatus.SENT
    assert_each_once(ob.broker.drain(queue, expected=3), {ok1, ok2, ok3})

    # Once a queue is bound for it, the next run (after its backoff) sends it.
    ob.broker.bind(queue, ob.exchange, "nowhere.#")
    make_due(lost)
    code, log = ob.run_relay_once(60)
    assert code == 0, log
    assert row(lost).status == OutboxStatus.SENT and row(lost).last_error == ""
    assert_each_once(ob.broker.drain(queue, expected=1), {lost})


# --------------------------------------------------------------------------- admin


def test_admin_retry_action_makes_failed_rows_pending_and_the_relay_sends_them(
    ob: OutboxEnv, admin_client
) -> None:  # type: ignore[no-untyped-def]
    ob.set(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["later.#"])  # commands: failed, not unrouted
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        failing = [publish("later.a", {"n": 1}), publish("later.b", {"n": 2})]
        pending_id = publish("ok.pending", {"n": 3})
    relay_once()  # both unroutable rows fail at once (max attempts 1); the other is sent
    assert {row(m).status for m in failing} == {OutboxStatus.FAILED}
    assert row(pending_id).status == OutboxStatus.SENT
    ob.broker.drain(queue, expected=1)
    late_pending = publish("ok.late", {"n": 4})  # pending, never tried

    url = reverse("admin:reliable_messaging_outboxmessage_changelist")
    page = admin_client.get(url)
    assert page.status_code == 200
    text = page.content.decode()
    for message_id in (*failing, pending_id, late_pending):
        assert message_id in text
    assert "unroutable" in text

    selected = [row(m).pk for m in (*failing, pending_id, late_pending)]
    response = admin_client.post(
        url, {"action": "retry_failed", "_selected_action": selected}, follow=True
    )
    assert response.status_code == 200
    assert "2 failed rows are pending again." in response.content.decode()
    for message_id in failing:
        r = row(message_id)
        assert (r.status, r.attempts) == (OutboxStatus.PENDING, 0)
        assert r.next_attempt_at is not None and r.next_attempt_at <= timezone.now()
    assert row(pending_id).status == OutboxStatus.SENT  # a sent row is left alone
    assert row(late_pending).status == OutboxStatus.PENDING

    ob.broker.bind(queue, ob.exchange, "later.#")
    report = relay_once()
    assert report.sent == 3 and report.left_failed == 0
    assert_each_once(ob.broker.drain(queue, expected=3), {*failing, late_pending})


def test_admin_changelist_renders_and_filters_by_status(ob: OutboxEnv, admin_client) -> None:  # type: ignore[no-untyped-def]
    pending_id = publish("a.pending", {"n": 1}, ordering_key="k-1")
    sent = publish("a.sent", {"n": 2})
    failed = publish("a.failed", {"n": 3})
    OutboxMessage.objects.filter(message_id=sent).update(
        status=OutboxStatus.SENT, sent_at=timezone.now()
    )
    OutboxMessage.objects.filter(message_id=failed).update(
        status=OutboxStatus.FAILED, attempts=10, last_error="unroutable: " + "x" * 200
    )
    url = reverse("admin:reliable_messaging_outboxmessage_changelist")

    page = admin_client.get(url)
    assert page.status_code == 200
    text = page.content.decode()
    assert all(m in text for m in (pending_id, sent, failed))
    assert "Oldest pending row waits for" in text
    assert "Retry the selected failed rows" in text

    only_failed = admin_client.get(url, {"status__exact": "failed"}).content.decode()
    assert failed in only_failed and pending_id not in only_failed and sent not in only_failed

    detail = admin_client.get(
        reverse("admin:reliable_messaging_outboxmessage_change", args=[row(failed).pk])
    )
    assert detail.status_code == 200
    assert (
        admin_client.get(reverse("admin:reliable_messaging_outboxmessage_add")).status_code == 403
    )


# --------------------------------------------------------------------------- order


def test_per_key_order_with_two_relays_in_parallel(ob: OutboxEnv) -> None:
    queue = ob.queue()
    keys = [f"key-{k}" for k in range(5)]
    published: dict[str | None, list[str]] = defaultdict(list)
    with transaction.atomic():
        for seq in range(20):
            for key in keys:
                published[key].append(
                    publish("order.seq", {"key": key, "seq": seq}, ordering_key=key)
                )
            published[None].append(publish("order.free", {"key": None, "seq": seq}))
    all_ids = {m for ids in published.values() for m in ids}

    relays = [ob.relay_process("--once", "--batch-size", "7") for _ in range(2)]
    codes = [p.wait(120) for p in relays]
    assert codes == [0, 0], [p.log() for p in relays]
    # Together the relays sent each row once.
    assert sum(sent_counts(p.log()) for p in relays) == len(all_ids)

    assert OutboxMessage.objects.exclude(status=OutboxStatus.SENT).count() == 0
    delivered = ob.broker.drain(queue, expected=len(all_ids))
    assert_each_once(delivered, all_ids)
    for key in keys:
        order = [m.message_id for m in delivered if m.payload["key"] == key]
        assert order == published[key], f"{key} delivered out of order"
        assert [m.payload["seq"] for m in delivered if m.payload["key"] == key] == list(range(20))
