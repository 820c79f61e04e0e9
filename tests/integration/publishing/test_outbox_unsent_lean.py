"""The outbox's unsent partition without the (status, sent_at) and message_id indexes: the sent
side holds them as partitioned indexes of the model's names, on every day partition; a publish
writes no index entry but its primary key's and the due index's; the counts of pending and
failed rows and a sent row's look-up by message_id are still read through an index."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import OUTBOX, OUTBOX_SENT, OUTBOX_TABLE, OUTBOX_UNSENT
from tests.integration.publishing.outbox_schema import assert_valid_indexes, index_bytes
from tests.markers import postgresql_only

pytestmark = [
    pytest.mark.django_db(transaction=True),
    postgresql_only,
]

STATUS_SENT = "rm_outbox_status_sent_idx"
MESSAGE_ID = "rm_outbox_message_id_idx"
MOVED = {STATUS_SENT: "btree (status, sent_at)", MESSAGE_ID: "btree (message_id)"}
FAILED = f"{OUTBOX_UNSENT}_failed"
DUE = "rm_outbox_due_idx"


def index_of(table: str) -> dict[str, str]:
    """name: definition (from ``USING`` on) of each index of ``table``, named after the index at
    the top of its partition tree (itself, when it is in none): a partition's copy of the due
    index is ``rm_outbox_due_idx``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(pg_partition_root(indexrelid), indexrelid)::regclass::text, "
            "indexrelid FROM pg_index WHERE indrelid = %s::regclass",
            [table],
        )
        tops = cursor.fetchall()
        found = {}
        for top, index in tops:
            cursor.execute("SELECT pg_get_indexdef(%s)", [index])
            found[top] = cursor.fetchone()[0].split(" USING ")[1]
        return found


def tables_under(index: str) -> set[str]:
    """The tables that hold ``index`` (a partitioned index) or one of its partitions."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indrelid::regclass::text FROM pg_partition_tree(%s::regclass) t "
            "JOIN pg_index i ON i.indexrelid = t.relid",
            [index],
        )
        return {row[0] for row in cursor}


def tree_of(top: str) -> set[str]:
    """``top`` (a partitioned table or index) and every partition under it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT relid::regclass::text FROM pg_partition_tree(%s::regclass)", [top])
        return {row[0] for row in cursor}


def assert_on_the_sent_side_only() -> None:
    """The layout of the outbox's indexes (see the module's docstring)."""
    assert_valid_indexes()
    assert set(index_of(OUTBOX_UNSENT)) == {
        f"{OUTBOX_UNSENT}_pkey",
        f"{OUTBOX_UNSENT}_idem",
        DUE,
        "rm_outbox_key_order_idx",
        FAILED,
    }
    assert index_of(OUTBOX_UNSENT)[FAILED] == "btree (id) WHERE ((status)::text = 'failed'::text)"
    for name, definition in MOVED.items():
        # The sent side's own partitioned index, holding a copy on each of its partitions.
        assert tables_under(name) == tree_of(OUTBOX_SENT), name
        for table in tree_of(OUTBOX_SENT):
            assert index_of(table)[name] == definition, (table, name)
        assert name not in index_of(OUTBOX_TABLE)


def test_the_unsent_partition_has_neither_and_every_day_of_the_sent_side_has_both(
    far_day: str,
) -> None:
    # The days made when the test database was, and the one the upkeep made just now: each is
    # checked below.
    days = {p.name for p in partitions.partitions("default", OUTBOX)}
    assert far_day in days and days < tree_of(OUTBOX_SENT)
    assert_on_the_sent_side_only()
    for name in MOVED:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT indrelid::regclass::text FROM pg_index WHERE indexrelid = %s::regclass",
                [name],
            )
            assert cursor.fetchone() == (OUTBOX_SENT,)


def test_a_publish_writes_no_entry_into_the_unsent_indexes_but_the_pkey_and_due_ones() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f'TRUNCATE "{OUTBOX_TABLE}"')  # every index back to its empty size
        cursor.execute(
            "SELECT indexrelid::regclass::text, "
            "coalesce(pg_partition_root(indexrelid), indexrelid)::regclass::text "
            "FROM pg_index WHERE indrelid = %s::regclass",
            [OUTBOX_UNSENT],
        )
        indexes = dict(cursor.fetchall())
    written = {name for name, top in indexes.items() if top in (f"{OUTBOX_UNSENT}_pkey", DUE)}
    assert len(written) == 2, indexes
    empty = {name: index_bytes(name) for name in indexes}

    with transaction.atomic():
        for n in range(2000):
            publish("a.b", {"n": n})

    grown = {name for name in indexes if index_bytes(name) > empty[name]}
    assert grown == written


def scans(plan: dict[str, Any]) -> Iterator[tuple[str, str, str | None]]:
    """(table, node type, index name) of each scan of a table in ``plan``; a bitmap scan's
    index is that of the bitmap index scan under it."""
    relation = plan.get("Relation Name")
    if relation is not None:
        index = plan.get("Index Name")
        if index is None and plan["Node Type"] == "Bitmap Heap Scan":
            index = plan["Plans"][0].get("Index Name")
        yield relation, plan["Node Type"], index
    for child in plan.get("Plans", []):
        yield from scans(child)


def plan_of(run: Callable[[], object]) -> list[tuple[str, str, str | None]]:
    """The scans of the statement ``run`` sends, planned with sequential scans priced out, so
    that the plan shows whether an index can answer it (on a few rows a sequential scan is
    cheaper anyway)."""
    with CaptureQueriesContext(connection) as queries:
        run()
    sql = queries.captured_queries[-1]["sql"]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
        (plan,) = cursor.fetchone()
    plan = plan if isinstance(plan, list) else json.loads(plan)
    return list(scans(plan[0]["Plan"]))


def test_pending_and_failed_counts_and_a_sent_row_by_message_id_are_read_through_an_index() -> None:
    with transaction.atomic():
        for n in range(20):
            publish("a.b", {"n": n})
        failed = [publish("a.b", {"failed": n}) for n in range(5)]
        sent = publish("a.b", {"sent": True})
    now = timezone.now()
    OutboxMessage.objects.filter(message_id__in=failed).update(status=OutboxStatus.FAILED)
    OutboxMessage.objects.filter(message_id=sent).update(status=OutboxStatus.SENT, sent_at=now)
    day = partitions.day_name(now.date(), OUTBOX)
    outbox = OutboxMessage.objects
    assert outbox.pending().count() == 20 and outbox.failed().count() == 5

    pending = plan_of(lambda: outbox.pending().count())
    assert [(t, i in tree_of(DUE)) for t, _, i in pending] == [(OUTBOX_UNSENT, True)], pending
    # Read through the partial index of failed rows, which a publish writes nothing into.
    failed_plan = plan_of(lambda: outbox.failed().count())
    assert [(t, i) for t, _, i in failed_plan] == [(OUTBOX_UNSENT, FAILED)], failed_plan
    by_message_id = plan_of(lambda: list(outbox.filter(message_id=sent)))
    on_the_day = [(node, i) for t, node, i in by_message_id if t == day]
    assert len(on_the_day) == 1 and on_the_day[0][1] in tree_of(MESSAGE_ID), by_message_id
    assert OutboxMessage.objects.get(message_id=sent).status == OutboxStatus.SENT
