"""The inbox partitioned by day on PostgreSQL: duplicates found across partitions, also when two
copies straddle midnight at once; partitions made ahead, and expired days dropped whole."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from unittest import mock

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging.broker.topology import consumer_queues
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.envelope import Delivery, Message, encode_payload
from reliable_messaging.core.outcomes import Acknowledge
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import ProcessedMessage
from reliable_messaging.storage import partitions
from reliable_messaging.storage.inbox import claim_inbox_rows, insert_inbox_row
from reliable_messaging.storage.partitions import INBOX_TABLE
from reliable_messaging.storage.retention import purge_messages
from tests.support import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

DAY = dt.timedelta(days=1)


def today() -> dt.date:
    return timezone.now().astimezone(dt.UTC).date()


def names() -> list[str]:
    return [p.name for p in partitions.partitions("default")]


def where(consumer: str, message_id: str) -> list[str]:
    """The partitions holding the key's row."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT tableoid::regclass::text FROM {INBOX_TABLE} "
            "WHERE consumer = %s AND message_id = %s",
            [consumer, message_id],
        )
        return [row[0] for row in cursor.fetchall()]


def put(consumer: str, message_id: str, at: dt.datetime) -> None:
    ProcessedMessage.objects.create(consumer=consumer, message_id=message_id, processed_at=at)


def test_the_inbox_is_partitioned_by_day_with_the_coming_days_ready() -> None:
    assert partitions.is_partitioned("default")
    found = names()
    for offset in range(-1, partitions.AHEAD_DAYS + 1):
        assert partitions.day_name(today() + offset * DAY) in found
    put("c", "now", timezone.now())
    assert where("c", "now") == [partitions.day_name(today())]
    # Making sure again creates nothing.
    assert partitions.ensure_partitions("default") == []


def test_each_partition_has_the_inbox_indexes_and_lookups_use_them() -> None:
    name = partitions.day_name(today())
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, name)
    indexes = {
        key: (info["columns"], bool(info["unique"]), bool(info["primary_key"]))
        for key, info in found.items()
        if info["index"] or info["unique"] or info["primary_key"]
    }
    assert indexes == {
        f"{name}_pkey": (["id"], True, True),
        f"{name}_uniq": (["message_id", "consumer"], True, False),
        f"{name}_consumer": (["consumer"], False, False),
        f"{name}_processed_at": (["processed_at"], False, False),
    }
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {INBOX_TABLE} (consumer, message_id, processed_at) "
            "SELECT 'c' || (g % 3), 'm-' || g, now() FROM generate_series(1, 3000) AS g"
        )
        cursor.execute(f"ANALYZE {INBOX_TABLE}")
    with transaction.atomic(), connection.cursor() as cursor:
        # The empty partitions would rather be read whole: tell the planner not to.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(
            f"EXPLAIN SELECT 1 FROM {INBOX_TABLE} WHERE message_id = %s AND consumer = %s",
            ["m-5", "c2"],
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "Seq Scan" not in plan and f"Index Only Scan using {name}_uniq" in plan, plan


def test_a_message_processed_days_ago_is_a_duplicate_today() -> None:
    partitions.ensure_partitions("default", now=timezone.now() - 5 * DAY)
    long_ago = timezone.now() - 4 * DAY
    put("billing", "m-1", long_ago)
    assert where("billing", "m-1") == [partitions.day_name(long_ago.date())]
    with transaction.atomic():
        assert insert_inbox_row("default", "billing", "m-1") is False
        assert insert_inbox_row("default", "shipping", "m-1") is True
        assert insert_inbox_row("default", "billing", "m-2") is True
    assert where("billing", "m-1") == [partitions.day_name(long_ago.date())]


def spec_of(name: str) -> ConsumerSpec:
    def handler(message: Message) -> None:
        Effect.objects.create(consumer=name, message_id=message.message_id, attempt=1)

    return ConsumerSpec(name=name, queue=f"{name}.q", handler=handler)


def delivery_for(spec: ConsumerSpec, message_id: str) -> Delivery:
    return Delivery(
        body=encode_payload({}),
        queue=consumer_queues(spec)[0],
        exchange="rmtest",
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
        headers={},
    )


@pytest.fixture
def before_midnight() -> Iterator[dt.datetime]:
    """A moment of yesterday, a breath before midnight UTC."""
    yield partitions.day_start(today()) - dt.timedelta(milliseconds=100)


@pytest.mark.parametrize("path", ["batch", "single"])
def test_two_copies_at_once_either_side_of_midnight_take_effect_once(
    before_midnight: dt.datetime, path: str
) -> None:
    """The first copy's inbox row goes to yesterday's partition and its handler is still
    running when the second copy, after midnight, would go to today's: no unique index spans
    both, so the second waits for the first on the key's advisory lock, then finds its row."""
    name = f"midnight-{path}"
    running = threading.Event()
    release = threading.Event()
    effects: list[str] = []
    clock = mock.patch("django.utils.timezone.now", return_value=before_midnight)
    clock.start()

    def slow_handler(message: Message) -> None:
        clock.stop()  # the second copy runs after midnight
        Effect.objects.create(consumer=name, message_id=message.message_id, attempt=1)
        effects.append("first")
        running.set()
        release.wait(10)

    slow = ConsumerSpec(name=name, queue=f"{name}.q", handler=slow_handler)
    fast = spec_of(name)
    first_outcome: list[object] = []

    def first() -> None:
        try:
            first_outcome.extend(
                process_batch([Job(DeliveryProcessor(slow), delivery_for(slow, "m-night"))])
            )
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert running.wait(10)
        assert where(name, "m-night") == []  # not committed yet
        threading.Timer(1.0, release.set).start()
        started = time.monotonic()
        if path == "batch":
            outcome = process_batch([Job(DeliveryProcessor(fast), delivery_for(fast, "m-night"))])
            waited = time.monotonic() - started
            assert outcome == [Acknowledge("duplicate")], outcome
        else:
            with transaction.atomic():
                fresh = insert_inbox_row("default", name, "m-night")
            waited = time.monotonic() - started
            assert fresh is False
        assert waited >= 0.5, "the second copy did not wait for the first"
    finally:
        release.set()
        thread.join(15)
        clock.stop()
    assert first_outcome == [Acknowledge("processed")]
    assert Effect.objects.filter(consumer=name, message_id="m-night").count() == 1
    assert where(name, "m-night") == [partitions.day_name(before_midnight.date())]


def test_a_claim_on_a_day_with_no_partition_makes_it_on_the_spot() -> None:
    """No default partition: a claim stamped on a day nobody made (every upkeep failing for
    longer than the days made ahead, or a clock far ahead) makes its day first."""
    later = timezone.now() + 30 * DAY
    assert partitions.day_name(later.date()) not in names()
    partitions.forget_coverage()
    try:
        with mock.patch("reliable_messaging.storage.inbox.timezone.now", return_value=later):
            with transaction.atomic():
                assert insert_inbox_row("default", "c", "from-the-future") is True
            with transaction.atomic():
                assert insert_inbox_row("default", "c", "from-the-future") is False
    finally:
        partitions.forget_coverage()
    assert where("c", "from-the-future") == [partitions.day_name(later.date())]


def test_two_processes_making_partitions_at_once_make_each_once() -> None:
    base = timezone.now() + 60 * DAY
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def make() -> None:
        try:
            results.append(partitions.ensure_partitions("default", now=base))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=make) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    created = sorted(name for result in results for name in result)
    expected = sorted(
        partitions.day_name(base.date() + offset * DAY)
        for offset in range(-1, partitions.AHEAD_DAYS + 1)
    )
    assert created == expected


def test_the_consumer_makes_the_coming_days_partitions_while_it_runs() -> None:
    name = partitions.day_name(today() + partitions.AHEAD_DAYS * DAY)
    with connection.cursor() as cursor:
        cursor.execute(f'DROP TABLE "{name}"')
    upkeep = partitions.PartitionUpkeep("default", interval=0.2)
    upkeep.start()
    try:
        wait_until(lambda: name in names(), timeout=10)
    finally:
        upkeep.stop()


def test_purge_drops_expired_days_whole_and_deletes_only_stray_rows(
    settings: object,
) -> None:
    """DEDUP_RETENTION is a day in the test settings."""
    partitions.ensure_partitions("default", now=timezone.now() - 10 * DAY)
    partitions.ensure_partitions("default", now=timezone.now() - 5 * DAY)
    for days_ago in (9, 8, 3):
        for n in range(5):
            put("c", f"d{days_ago}-{n}", timezone.now() - days_ago * DAY)
    put("c", "recent", timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {INBOX_TABLE}")
    old = [partitions.day_name(today() - n * DAY) for n in range(11, 1, -1)]
    assert set(old) - set(names()) == set()
    with CaptureQueriesContext(connection) as queries:
        result = purge_messages()
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    others = ("outboxmessage", "suspect", "deadlettergroup")  # the last: empty failure groups
    assert all(any(name in sql for name in others) for sql in deletes), deletes
    # Every day that ended more than a day ago is gone; yesterday's is kept.
    remaining = names()
    assert not set(old) & set(remaining), remaining
    assert partitions.day_name(today() - DAY) in remaining
    assert set(result.inbox_partitions) == set(old)
    assert result.inbox == 15  # estimated in the dropped days
    assert set(ProcessedMessage.objects.values_list("message_id", flat=True)) == {"recent"}


def test_purge_drops_a_day_a_long_transaction_reads_once_it_ends_and_claims_go_on() -> None:
    """A transaction reading the inbox (a batch running long) does not stop the purge: the
    expired day is detached concurrently, which waits for that transaction to end without
    making the claims that start meanwhile wait, and then dropped."""
    partitions.ensure_partitions("default", now=timezone.now() - 10 * DAY)
    expired_day = partitions.day_name(today() - 9 * DAY)
    holding = threading.Event()
    done = threading.Event()
    purged: list[object] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                assert insert_inbox_row("default", "c", "busy")  # reads every partition
                holding.set()
                done.wait(20)
        finally:
            connection.close()

    def purge() -> None:
        try:
            purged.append(purge_messages())
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    purger = threading.Thread(target=purge)
    try:
        assert holding.wait(10)
        purger.start()
        # The detach is under way (it waits for the holder); claims go on meanwhile.
        wait_until(_detaching, timeout=10)
        for n in range(5):
            with transaction.atomic():
                assert insert_inbox_row("default", "c", f"meanwhile-{n}")
        assert not done.is_set() and holder.is_alive() and purger.is_alive()
    finally:
        done.set()
        holder.join(20)
        purger.join(30)
    assert purged, "the purge did not finish after the long transaction ended"
    assert expired_day in purged[0].inbox_partitions  # type: ignore[attr-defined]
    assert expired_day not in names()
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s)", [expired_day])
        assert cursor.fetchone()[0] is None


def _detaching() -> bool:
    """Whether a DETACH ... CONCURRENTLY waits for the transactions that read the table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE query LIKE %s "
            "AND wait_event_type = 'Lock')",
            ["%DETACH PARTITION%CONCURRENTLY%"],
        )
        return bool(cursor.fetchone()[0])


@pytest.fixture(autouse=True)
def coming_days_ready() -> None:
    """The partitions a new installation has (a purge run by an earlier test with a clock far
    ahead may have dropped them)."""
    partitions.ensure_partitions("default")


@pytest.mark.parametrize("level", ["SERIALIZABLE", "REPEATABLE READ"])
def test_two_copies_either_side_of_midnight_under_stricter_isolation(
    before_midnight: dt.datetime, level: str
) -> None:
    """What the isolation checks say: under SERIALIZABLE the second copy fails to serialize
    (retried as a database error) instead of taking effect; under REPEATABLE READ its snapshot,
    taken before the lock wait, misses the first copy's row: both would take effect, which is
    why the checks refuse REPEATABLE READ on PostgreSQL."""
    name = f"strict-{level[0]}"
    inserted = threading.Event()
    release = threading.Event()

    def first() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
                with mock.patch("django.utils.timezone.now", return_value=before_midnight):
                    assert insert_inbox_row("default", name, "m") is True
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    outcome = "inserted"
    try:
        assert inserted.wait(10)
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
                    cursor.execute("SELECT 1")  # the snapshot is taken here
                # The first copy commits while the second waits for its lock.
                threading.Timer(0.5, release.set).start()
                if not insert_inbox_row("default", name, "m"):
                    outcome = "duplicate"
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcome = "serialization failure" if "serializ" in str(exc) else repr(exc)
    finally:
        release.set()
        thread.join(15)
    if level == "SERIALIZABLE":
        assert outcome in {"duplicate", "serialization failure"}
    else:
        assert outcome == "inserted"


def scans_of_today() -> tuple[int, int, int, int]:
    """Today's partition: its sequential scans, the scans of its unique index and the entries
    they read, and the scans of its index of consumers, as PostgreSQL counts them (this
    backend's counts flushed first)."""
    name = partitions.day_name(today())
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute(
            "SELECT t.seq_scan, "
            "sum(i.idx_scan) FILTER (WHERE i.indexrelname = %s), "
            "sum(i.idx_tup_read) FILTER (WHERE i.indexrelname = %s), "
            "sum(i.idx_scan) FILTER (WHERE i.indexrelname = %s) "
            "FROM pg_stat_user_tables AS t JOIN pg_stat_user_indexes AS i USING (relid) "
            "WHERE t.relname = %s GROUP BY t.seq_scan",
            [f"{name}_uniq", f"{name}_uniq", f"{name}_consumer", name],
        )
        seq, uniq, uniq_read, by_consumer = cursor.fetchone()
    return seq, uniq, uniq_read, by_consumer


def test_the_claim_looks_keys_up_in_the_unique_index_however_empty_the_inbox_was_when_planned() -> (
    None
):
    """The batch claim's plan is made once per connection and kept: made while every partition
    was empty and analyzed (the planner would then read a partition whole, or by consumer), it
    still looks each key up in the unique index after today's partition has filled."""
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {INBOX_TABLE}")
    with transaction.atomic():
        assert list(claim_inbox_rows("default", [("c", "first")], 1.0)[0]) == [("c", "first")]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {INBOX_TABLE} (consumer, message_id, processed_at) "
            "SELECT 'c', 'filler-' || g, now() FROM generate_series(1, 20000) AS g"
        )
    before = seq, uniq, uniq_read, by_consumer = scans_of_today()
    keys = [("c", f"m-{n}") for n in range(50)] + [("c", "filler-7")]
    with transaction.atomic():
        claimed, busy = claim_inbox_rows("default", keys, 1.0)
    assert sorted(claimed) == sorted(keys[:-1]) and not busy
    after = scans_of_today()
    assert after[0] == seq and after[3] == by_consumer, (before, after)
    assert after[1] >= uniq + len(keys), (before, after)
    # Looked up, not read whole: a key found reads its entry, a key not found reads none (the
    # 20,000 entries read at each claim were the sign of a plan made on the empty inbox).
    assert after[2] - uniq_read <= 2 * len(keys), (before, after)
