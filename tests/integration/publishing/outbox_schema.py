"""What the tests of the outbox's migrations (0014, 0015) read of its schema on PostgreSQL, and
how they move it between migrations. The fixtures built on these (``far_day``,
``legacy_layout``) are in this directory's ``conftest.py``."""

from __future__ import annotations

import io

from django.core.management import call_command
from django.db import connection

from reliable_messaging.storage.partitions import OUTBOX_TABLE


def migrate(*target: str) -> None:
    call_command("migrate", "reliable_messaging", *target, stdout=io.StringIO())


def leaves() -> list[str]:
    """The tables that hold the outbox's rows (the leaves of its partition tree)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relid::regclass::text FROM pg_partition_tree(%s::regclass) WHERE isleaf",
            [OUTBOX_TABLE],
        )
        return sorted(row[0] for row in cursor)


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
