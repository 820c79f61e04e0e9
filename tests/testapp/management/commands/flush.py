"""The suite's ``flush``, which pytest-django runs after every transactional test: on
PostgreSQL the tables that hold rows are emptied by ``DELETE`` in one transaction (``TRUNCATE``
for those past ``LARGE`` rows), instead of Django's ``TRUNCATE`` of every table, which gives each
of the partitioned tables' many relations a new file (about 0.3 s a test here). Then
``post_migrate`` as Django's own flush sends it. Anything else goes to Django's command."""

from __future__ import annotations

from typing import Any

from django.core.management.commands.flush import Command as DjangoFlush
from django.core.management.sql import emit_post_migrate_signal
from django.db import DatabaseError, connections, transaction

# Past this many rows a table is truncated: with autovacuum off here, deleted rows would stay
# in its pages for the rest of the session.
LARGE = 1000


class Command(DjangoFlush):
    def handle(self, **options: Any) -> None:
        database = options["database"]
        connection = connections[database]
        if (
            connection.vendor != "postgresql"
            or options["interactive"]
            or options.get("reset_sequences", True)
        ):
            return super().handle(**options)
        tables = connection.introspection.django_table_names(
            only_existing=True, include_views=False
        )
        try:
            empty(database, tables)
        except DatabaseError:
            return super().handle(**options)
        if not options.get("inhibit_post_migrate", False):
            emit_post_migrate_signal(options["verbosity"], False, database)
        return None


def empty(database: str, tables: list[str]) -> None:
    """Empty ``tables`` in one transaction, firing no trigger."""
    connection = connections[database]
    quote = connection.ops.quote_name
    counts = " UNION ALL ".join(
        f"SELECT {i}, (SELECT count(*) FROM (SELECT 1 FROM {quote(table)} LIMIT {LARGE + 1}) s)"
        for i, table in enumerate(tables)
    )
    with transaction.atomic(using=database), connection.cursor() as cursor:
        # No trigger fires, as under TRUNCATE: the dead letters' own would write their groups'
        # deltas for the rows deleted (foreign keys are triggers too: every table is emptied).
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(counts)
        filled = {tables[i]: rows for i, rows in cursor.fetchall() if rows}
        large = [table for table, rows in filled.items() if rows > LARGE]
        if large:
            cursor.execute(f"TRUNCATE {', '.join(quote(table) for table in large)} CASCADE")
        for table in filled.keys() - set(large):
            cursor.execute(f"DELETE FROM {quote(table)}")
