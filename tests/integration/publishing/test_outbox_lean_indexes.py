"""The outbox's indexes on the idempotency key (migration 0014): no ``varchar_pattern_ops``
index, and on each partition a unique index of the keys that are not NULL, so that a row
without a key (almost every row) writes no entry there; the migration on a new installation's
layout and on a legacy one, both ways."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import IntegrityError, connection, transaction

from reliable_messaging import publish
from reliable_messaging.models import OutboxMessage
from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import (
    OUTBOX,
    OUTBOX_CURRENT,
    OUTBOX_LEGACY,
    OUTBOX_TABLE,
    OUTBOX_UNSENT,
)
from tests.integration.publishing.outbox_schema import (
    assert_valid_indexes,
    index_bytes,
    leaves,
    migrate,
)
from tests.markers import postgresql_only

pytestmark = [
    pytest.mark.django_db(transaction=True),
    postgresql_only,
]

PARTIAL = "(idempotency_key) WHERE (idempotency_key IS NOT NULL)"
# The name Django gave the varchar_pattern_ops index of the unique field (migration 0002).
LIKE_INDEX = "reliable_messaging_outboxmessage_idempotency_key_e3557cfe_like"


def key_indexes(table: str) -> dict[str, str]:
    """name: definition (from ``USING`` on) of each index of ``table`` on idempotency_key."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s "
            "AND indexdef LIKE '%%idempotency_key%%'",
            [table],
        )
        return {
            name: ("UNIQUE " if " UNIQUE " in d else "") + d.split(" USING ")[1]
            for name, d in cursor
        }


def pattern_indexes() -> list[str]:
    """Every varchar_pattern_ops index of the outbox or any of its partitions."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE indexdef LIKE '%%varchar_pattern_ops%%' "
            "AND tablename IN (SELECT relid::regclass::text "
            "FROM pg_partition_tree(%s::regclass))",
            [OUTBOX_TABLE],
        )
        return sorted(row[0] for row in cursor)


def key_constraint(table: str) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'u'",
            [table],
        )
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def insert_into(table: str, message_id: str, key: str | None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{table}" (message_id, exchange, routing_key, body, headers, status, '
            "attempts, last_error, created_at, idempotency_key) "
            "VALUES (%s, '', 'a.b', '{}', '{}', 'pending', 0, '', now(), %s)",
            [message_id, key],
        )


def test_no_pattern_index_and_a_partial_unique_key_index_on_each_new_partition(
    far_day: str,
) -> None:
    assert pattern_indexes() == []
    for table in (OUTBOX_UNSENT, far_day):
        assert key_indexes(table) == {f"{table}_idem": f"UNIQUE btree {PARTIAL}"}, table


def test_the_unsent_partition_refuses_a_key_twice_and_stores_nothing_without_one() -> None:
    index = f"{OUTBOX_UNSENT}_idem"
    with connection.cursor() as cursor:
        cursor.execute(f'TRUNCATE "{OUTBOX_TABLE}"')  # every index back to its empty size
    empty = index_bytes(index)
    with transaction.atomic():
        for n in range(1000):
            publish("a.b", {"n": n})
        for n in range(100):
            insert_into(OUTBOX_UNSENT, f"raw-{n}", None)
    assert index_bytes(index) == empty, "rows without a key wrote entries to the key index"

    insert_into(OUTBOX_UNSENT, "first", "k-1")
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        insert_into(OUTBOX_UNSENT, "second", "k-1")
    assert refused.value.__cause__.diag.constraint_name == index  # type: ignore[union-attr]
    assert set(
        OutboxMessage.objects.filter(idempotency_key="k-1").values_list("message_id", flat=True)
    ) == {"first"}


def test_the_migration_goes_back_to_0013_and_forward_again() -> None:
    days = [p.name for p in partitions.partitions("default", OUTBOX)]
    migrate("0013")
    # What 0013 left: the pattern index on every partition, a full unique constraint on each.
    assert LIKE_INDEX in pattern_indexes()
    assert all(pattern_index_of(table) for table in leaves())
    assert_valid_indexes()
    for table in leaves():
        assert key_constraint(table) == f"{table}_idem", table
        assert key_indexes(table)[f"{table}_idem"] == "UNIQUE btree (idempotency_key)", table

    migrate()
    assert pattern_indexes() == []
    assert_valid_indexes()
    for table in (OUTBOX_UNSENT,):
        assert key_constraint(table) is None
        assert key_indexes(table) == {f"{table}_idem": f"UNIQUE btree {PARTIAL}"}, table
    # The days that exist keep their full constraint until they expire.
    for table in days:
        assert key_constraint(table) == f"{table}_idem", table
    with transaction.atomic():
        first = publish("a.b", {}, idempotency_key="after-the-round-trip")
        assert publish("a.b", {}, idempotency_key="after-the-round-trip") == first


def pattern_index_of(table: str) -> bool:
    return any("varchar_pattern_ops" in d for d in key_indexes(table).values())


def test_the_migration_on_a_legacy_layout_both_ways(
    legacy_layout: Callable[[str], None],
) -> None:
    legacy_layout("0013")
    legacy_constraint = f"{OUTBOX_TABLE}_idempotency_key_key"  # 0002's, kept by 0010
    assert key_constraint(OUTBOX_LEGACY) == legacy_constraint
    assert pattern_index_of(OUTBOX_LEGACY) and pattern_index_of(OUTBOX_CURRENT)

    migrate()
    assert pattern_indexes() == []
    assert_valid_indexes()
    assert key_constraint(OUTBOX_LEGACY) is None
    assert key_indexes(OUTBOX_LEGACY) == {legacy_constraint: f"UNIQUE btree {PARTIAL}"}
    assert key_indexes(OUTBOX_UNSENT) == {f"{OUTBOX_UNSENT}_idem": f"UNIQUE btree {PARTIAL}"}
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_into(OUTBOX_LEGACY, "again", "legacy-key")
    with transaction.atomic():
        found = publish("a.b", {"n": 3}, idempotency_key="legacy-key")
    assert found == OutboxMessage.objects.get(idempotency_key="legacy-key").message_id

    migrate("0013")
    assert_valid_indexes()
    assert LIKE_INDEX in pattern_indexes()
    assert all(pattern_index_of(table) for table in leaves())
    assert key_constraint(OUTBOX_LEGACY) == legacy_constraint
    assert key_constraint(OUTBOX_UNSENT) == f"{OUTBOX_UNSENT}_idem"
    migrate()
    assert pattern_indexes() == []
    assert key_indexes(OUTBOX_LEGACY) == {legacy_constraint: f"UNIQUE btree {PARTIAL}"}
