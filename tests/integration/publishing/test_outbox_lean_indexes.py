"""The outbox's indexes on the idempotency key: no ``varchar_pattern_ops`` index, and on each
partition a unique index of the keys that are not NULL, so that a row without a key (almost
every row) writes no entry there."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from reliable_messaging import publish
from reliable_messaging.models import OutboxMessage
from reliable_messaging.storage.partitions import OUTBOX_TABLE, OUTBOX_UNSENT
from tests.integration.publishing.outbox_schema import index_bytes
from tests.markers import postgresql_only

pytestmark = [
    pytest.mark.django_db(transaction=True),
    postgresql_only,
]

PARTIAL = "(idempotency_key) WHERE (idempotency_key IS NOT NULL)"


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
