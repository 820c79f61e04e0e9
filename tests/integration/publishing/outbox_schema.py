"""What the tests of the outbox's indexes read of its schema on PostgreSQL."""

from __future__ import annotations

from django.db import connection

from reliable_messaging.storage.partitions import OUTBOX_TABLE


def index_bytes(name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_relation_size(%s::regclass)", [name])
        return int(cursor.fetchone()[0])


def assert_valid_indexes() -> None:
    """No index of the outbox or of any of its partitions is INVALID."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid "
            "AND indrelid IN (SELECT relid FROM pg_partition_tree(%s::regclass))",
            [OUTBOX_TABLE],
        )
        assert cursor.fetchall() == []
