"""``publish()``: the outbox row lives and dies with the caller's transaction."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import uuid
from collections import Counter
from decimal import Decimal

import psycopg
import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import build_relay
from tests.testapp.models import Effect

from .conftest import OutboxEnv


def committed_rows(message_id: str) -> int:
    """How many outbox rows with ``message_id`` another connection sees (i.e. committed)."""
    conf = connection.settings_dict
    with psycopg.connect(
        dbname=conf["NAME"],
        user=conf.get("USER") or "postgres",
        host=conf.get("HOST") or "127.0.0.1",
        port=conf.get("PORT") or 5432,
        connect_timeout=10,
        autocommit=True,
    ) as other:
        row = other.execute(
            "SELECT count(*) FROM reliable_messaging_outboxmessage WHERE message_id = %s",
            [message_id],
        ).fetchone()
    assert row is not None
    return int(row[0])


# --------------------------------------------------------------------------- transactions


@pytest.mark.django_db(transaction=True)
def test_rolled_back_publish_is_never_sent_and_committed_one_is_sent_exactly_once(
    ob: OutboxEnv,
) -> None:
    queue = ob.queue()

    with pytest.raises(RuntimeError, match="business rule"), transaction.atomic():
        rolled_back = publish("order.placed", {"order": "rolled back"})
        # Visible in its own transaction, invisible to everyone else until commit.
        assert OutboxMessage.objects.filter(message_id=rolled_back).exists()
        assert committed_rows(rolled_back) == 0
        raise RuntimeError("business rule says no")

    with transaction.atomic():
        committed = publish("order.placed", {"order": "committed"})
        with pytest.raises(ValueError), transaction.atomic():  # an inner savepoint rolls back
            in_savepoint = publish("order.placed", {"order": "savepoint"})
            raise ValueError("inner failure")
        assert committed_rows(committed) == 0

    assert committed_rows(committed) == 1
    assert not OutboxMessage.objects.filter(message_id__in=[rolled_back, in_savepoint]).exists()

    report = build_relay(once=True).run()
    assert report.sent == 1
    # A second relay run finds nothing more to send.
    assert build_relay(once=True).run().sent == 0

    delivered = ob.broker.drain(queue, expected=1)
    assert Counter(m.message_id for m in delivered) == {committed: 1}
    assert delivered[0].payload == {"order": "committed"}
    assert OutboxMessage.objects.get(message_id=committed).status == OutboxStatus.SENT


@pytest.mark.django_db(transaction=True)
def test_publish_without_a_transaction_commits_at_once(ob: OutboxEnv) -> None:
    assert connection.get_autocommit() and not connection.in_atomic_block
    message_id = publish("order.placed", {"n": 1})
    assert committed_rows(message_id) == 1


@pytest.mark.django_db(transaction=True)
def test_using_default_alias(ob: OutboxEnv) -> None:
    with transaction.atomic(using="default"):
        message_id = publish("order.placed", {"n": 1}, using="default")
    assert committed_rows(message_id) == 1
    with pytest.raises(RuntimeError), transaction.atomic(using="default"):
        dropped = publish("order.placed", {"n": 2}, using="default")
        raise RuntimeError("rollback")
    assert committed_rows(dropped) == 0


# --------------------------------------------------------------------------- the row written


@pytest.mark.django_db
def test_returns_a_new_uuid_by_default_and_keeps_a_given_id(ob: OutboxEnv) -> None:
    generated = publish("order.placed", {"n": 1})
    assert isinstance(generated, str)
    # Time-ordered (UUIDv7): consumers' inbox rows of these ids go in at the index's right edge.
    assert uuid.UUID(generated).version == 7
    assert str(uuid.UUID(generated)) == generated  # canonical 36-character text
    second = publish("order.placed", {"n": 2})
    assert second > generated

    assert publish("order.placed", {"n": 3}, message_id="order-42-placed") == "order-42-placed"
    given_uuid = uuid.uuid4()
    from_uuid = publish("order.placed", {"n": 4}, message_id=given_uuid)  # type: ignore[arg-type]
    assert from_uuid == str(given_uuid)

    assert set(OutboxMessage.objects.values_list("message_id", flat=True)) == {
        generated,
        OutboxMessage.objects.get(body='{"n":2}').message_id,
        "order-42-placed",
        str(given_uuid),
    }


@pytest.mark.django_db
def test_row_records_destination_headers_and_ordering_key(ob: OutboxEnv) -> None:
    message_id = publish(
        "order.shipped",
        {"n": 1},
        headers={
            "tenant": "acme",
            "trace": {"id": "t-1", "hops": [1, 2]},
            "sampled": True,
            "parent": None,
        },
        ordering_key="order-7",
    )
    other = publish("audit.log", [1, 2], exchange=f"rmtest.{ob.ns}.audit")
    row = OutboxMessage.objects.get(message_id=message_id)
    assert (row.exchange, row.routing_key, row.ordering_key) == (
        ob.exchange,
        "order.shipped",
        "order-7",
    )
    assert row.headers == {
        "tenant": "acme",
        "trace": {"id": "t-1", "hops": [1, 2]},
        "sampled": True,
        "parent": None,
    }
    assert (row.status, row.attempts, row.last_error, row.sent_at) == (
        OutboxStatus.PENDING,
        0,
        "",
        None,
    )
    other_row = OutboxMessage.objects.get(message_id=other)
    assert other_row.exchange == f"rmtest.{ob.ns}.audit"
    assert other_row.ordering_key is None and other_row.idempotency_key is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("ordering_key", "idempotency_key"),
    [(None, None), ("order-8", None), (None, "charge-8"), ("order-8", "charge-8")],
)
def test_each_combination_of_keys_is_stored_and_a_key_not_given_is_not_written(
    ob: OutboxEnv, ordering_key: str | None, idempotency_key: str | None
) -> None:
    # A key the call does not give is left out of the INSERT (PostgreSQL parses, checks and
    # plans every column a statement names; most publishes have neither key), and reads NULL.
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        message_id = publish(
            "order.paid",
            {"n": 8},
            ordering_key=ordering_key,
            idempotency_key=idempotency_key,
            headers={"tenant": "acme"},
        )
    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert ('"ordering_key"' in inserts[0]) is (ordering_key is not None)
    assert ('"idempotency_key"' in inserts[0]) is (idempotency_key is not None)
    row = OutboxMessage.objects.get(message_id=message_id)
    assert (row.ordering_key, row.idempotency_key) == (ordering_key, idempotency_key)
    assert (row.routing_key, row.body, row.headers) == ("order.paid", '{"n":8}', {"tenant": "acme"})
    assert (row.status, row.attempts, row.last_error) == (OutboxStatus.PENDING, 0, "")
    assert row.next_attempt_at is not None and row.created_at == row.next_attempt_at


@pytest.mark.django_db
def test_payload_encodes_decimal_datetime_date_and_uuid(ob: OutboxEnv) -> None:
    order_uuid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    payload = {
        "amount": Decimal("9.99"),
        "tiny": Decimal("0.10"),
        "placed_at": dt.datetime(2024, 5, 1, 12, 30, 15, 250000, tzinfo=dt.UTC),
        "ship_on": dt.date(2024, 5, 3),
        "order_uuid": order_uuid,
        "lines": [{"price": Decimal("1.50"), "id": order_uuid}],
        "text": "naïve ✓",
    }
    message_id = publish("order.placed", payload)
    body = OutboxMessage.objects.get(message_id=message_id).body
    assert json.loads(body) == {
        "amount": "9.99",
        "tiny": "0.10",
        "placed_at": "2024-05-01T12:30:15.250000+00:00",
        "ship_on": "2024-05-03",
        "order_uuid": "12345678-1234-5678-1234-567812345678",
        "lines": [{"price": "1.50", "id": "12345678-1234-5678-1234-567812345678"}],
        "text": "naïve ✓",
    }


@pytest.mark.django_db
@pytest.mark.parametrize(
    "payload",
    [{"obj": object()}, {"nan": float("nan")}, {"inf": float("inf")}, {"raw": b"bytes"}],
    ids=["object", "nan", "inf", "bytes"],
)
def test_unencodable_payload_raises_type_error_at_publish_time(
    ob: OutboxEnv, payload: object
) -> None:
    with transaction.atomic():
        with pytest.raises(TypeError, match="payload cannot be encoded as JSON"):
            publish("order.placed", payload)
        # Nothing was written and the caller's transaction is still usable.
        Effect.objects.create(consumer="after", message_id="m", attempt=1)
    assert not OutboxMessage.objects.exists()
    assert Effect.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "headers",
    [{"obj": object()}, {"nan": float("nan")}, {"big": 2**70}, {1: "int key"}, ["a", "list"]],
    ids=["object", "nan", "int-out-of-range", "int-key", "list"],
)
def test_unencodable_headers_raise_type_error_at_publish_time(
    ob: OutboxEnv, headers: object
) -> None:
    with pytest.raises(TypeError, match="header"):
        publish("order.placed", {"ok": True}, headers=headers)  # type: ignore[arg-type]
    assert not OutboxMessage.objects.exists()


@pytest.mark.django_db
def test_invalid_routing_key_and_message_id_are_refused(ob: OutboxEnv) -> None:
    with pytest.raises(ValueError, match="routing_key"):
        publish("", {})
    with pytest.raises(ValueError, match="message_id"):
        publish("a.b", {}, message_id="")
    with pytest.raises(ValueError, match="message_id"):
        publish("a.b", {}, message_id="x" * 256)
    assert not OutboxMessage.objects.exists()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00")),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(
                st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=8
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@pytest.mark.django_db
@hsettings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payload=json_values)
def test_any_json_payload_round_trips_through_the_outbox_row(
    ob: OutboxEnv, payload: object
) -> None:
    with transaction.atomic():
        message_id = publish("prop.test", payload)
        body = OutboxMessage.objects.get(message_id=message_id).body
        assert json.loads(body) == payload
        transaction.set_rollback(True)


# --------------------------------------------------------------------------- idempotency_key


@pytest.mark.django_db(transaction=True)
def test_idempotency_key_second_publish_returns_the_first_id_and_writes_nothing(
    ob: OutboxEnv,
) -> None:
    first = publish("order.placed", {"attempt": 1}, idempotency_key="order-1-placed")
    with transaction.atomic():
        again = publish(
            "order.placed", {"attempt": 2}, idempotency_key="order-1-placed", message_id="other-id"
        )
        # The duplicate left the caller's transaction usable.
        Effect.objects.create(consumer="after-duplicate", message_id=again, attempt=1)
        in_same_tx = publish("order.placed", {"attempt": 3}, idempotency_key="order-2-placed")
        assert (
            publish("order.placed", {"attempt": 4}, idempotency_key="order-2-placed") == in_same_tx
        )
    assert again == first
    rows = OutboxMessage.objects.filter(idempotency_key="order-1-placed")
    assert [(r.message_id, json.loads(r.body)) for r in rows] == [(first, {"attempt": 1})]
    assert OutboxMessage.objects.filter(idempotency_key="order-2-placed").count() == 1
    assert OutboxMessage.objects.count() == 2
    assert not OutboxMessage.objects.filter(message_id="other-id").exists()
    assert Effect.objects.get().message_id == first


def _in_thread(target, results: dict, errors: list, key) -> threading.Thread:  # type: ignore[no-untyped-def]
    def run() -> None:
        try:
            results[key] = target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_idempotency_key_under_concurrency_one_row_and_one_id_for_all(ob: OutboxEnv) -> None:
    workers = 6
    key = f"concurrent-{ob.ns}"
    barrier = threading.Barrier(workers)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def publisher(index: int):  # type: ignore[no-untyped-def]
        def work() -> str:
            barrier.wait(timeout=30)
            with transaction.atomic():
                message_id = publish("order.placed", {"worker": index}, idempotency_key=key)
                # The caller's transaction stays usable after a duplicate was absorbed.
                Effect.objects.create(consumer="worker", message_id=message_id, attempt=index)
                time.sleep(0.2)  # hold the uncommitted row so the others' inserts wait on it
            return message_id

        return work

    threads = [_in_thread(publisher(i), results, errors, i) for i in range(workers)]
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a publishing thread hung"
    assert not errors, errors

    rows = list(OutboxMessage.objects.filter(idempotency_key=key))
    assert len(rows) == 1
    assert set(results.values()) == {rows[0].message_id}
    assert len(results) == workers
    assert OutboxMessage.objects.count() == 1
    assert Effect.objects.filter(message_id=rows[0].message_id).count() == workers


@pytest.mark.django_db(transaction=True)
def test_idempotency_key_freed_when_the_first_publisher_rolls_back(ob: OutboxEnv) -> None:
    """B publishes the key while A's uncommitted row holds it; A rolls back: B's row wins."""
    key = f"rollback-{ob.ns}"
    a_inserted = threading.Event()
    b_publishing = threading.Event()
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def first() -> str:
        with pytest.raises(RuntimeError), transaction.atomic():
            message_id = publish("order.placed", {"who": "A"}, idempotency_key=key)
            a_inserted.set()
            assert b_publishing.wait(30)
            time.sleep(0.3)  # let B's insert reach the unique index and wait on A
            raise RuntimeError("A rolls back")
        return message_id

    def second() -> str:
        assert a_inserted.wait(30)
        with transaction.atomic():
            b_publishing.set()
            return publish("order.placed", {"who": "B"}, idempotency_key=key)

    threads = [_in_thread(first, results, errors, "A"), _in_thread(second, results, errors, "B")]
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    row = OutboxMessage.objects.get(idempotency_key=key)
    assert row.message_id == results["B"] != results["A"]
    assert json.loads(row.body) == {"who": "B"}
    assert committed_rows(results["A"]) == 0


@pytest.mark.django_db
def test_idempotency_key_is_unique_in_the_table(ob: OutboxEnv) -> None:
    publish("a.b", {}, idempotency_key="k")
    with pytest.raises(IntegrityError), transaction.atomic():
        OutboxMessage.objects.create(
            message_id="x", routing_key="a.b", body="{}", idempotency_key="k"
        )
