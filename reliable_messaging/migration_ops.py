"""Migration operations that leave a live system writing while they run.

``AddIndexOnline`` and ``RemoveIndexOnline`` build and drop an index CONCURRENTLY on
PostgreSQL (a plain CREATE INDEX blocks every insert into the table until the build ends, a
minute or more on a large outbox or inbox) and as usual elsewhere. A migration using them sets
``atomic = False``, as PostgreSQL requires. ``ElsewhereThanPostgreSQL`` wraps an operation
whose SQL a migration replaces with its own on PostgreSQL.

The functions at the end are for the migrations that change the partitioned outbox's indexes
by hand (0014, 0015): statements run under a short lock wait, tried again while a lock is what
stops them, a build CONCURRENTLY that can be run again, and the outbox's partitions as the
catalog lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.db import NotSupportedError, OperationalError, transaction
from django.db.migrations.operations import AddIndex, RemoveIndex
from django.db.migrations.operations.base import Operation

from reliable_messaging.storage.partitions import (
    ADVISORY_CLASS,
    DDL_LOCK_TIMEOUT,
    LOCK_NOT_AVAILABLE,
    OUTBOX_TABLE,
    UPKEEP_LOCK,
)

T = TypeVar("T")


def _online(schema_editor: Any, operation: object) -> bool:
    if schema_editor.connection.vendor != "postgresql":
        return False
    if schema_editor.connection.in_atomic_block:
        raise NotSupportedError(
            f"{type(operation).__name__} cannot run inside a transaction: "
            "set atomic = False on the migration"
        )
    return True


def _create(schema_editor: Any, model: Any, index: Any) -> None:
    # An earlier build that was interrupted leaves an INVALID index of this name.
    schema_editor.execute(
        f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(index.name)}"
    )
    schema_editor.add_index(model, index, concurrently=True)


def _drop(schema_editor: Any, model: Any, index: Any) -> None:
    schema_editor.remove_index(model, index, concurrently=True)


class AddIndexOnline(AddIndex):
    """``AddIndex``, built CONCURRENTLY on PostgreSQL."""

    atomic = False

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not _online(schema_editor, self):
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            _create(schema_editor, model, self.index)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not _online(schema_editor, self):
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            _drop(schema_editor, model, self.index)


class RemoveIndexOnline(RemoveIndex):
    """``RemoveIndex``, dropped CONCURRENTLY on PostgreSQL."""

    atomic = False

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not _online(schema_editor, self):
            super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            state = from_state.models[app_label, self.model_name_lower]
            _drop(schema_editor, model, state.get_index_by_name(self.name))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not _online(schema_editor, self):
            super().database_backwards(app_label, schema_editor, from_state, to_state)
            return
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            state = to_state.models[app_label, self.model_name_lower]
            _create(schema_editor, model, state.get_index_by_name(self.name))


class ElsewhereThanPostgreSQL(Operation):
    """``operation``, whose database side runs everywhere but on PostgreSQL: there it changes
    the migration state only, and the migration changes the database itself (the partitioned
    outbox, where Django's own SQL would not apply)."""

    def __init__(self, operation: Operation) -> None:
        self.operation = operation

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (self.__class__.__name__, [self.operation], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        self.operation.state_forwards(app_label, state)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            self.operation.database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor != "postgresql":
            self.operation.database_backwards(app_label, schema_editor, from_state, to_state)

    def describe(self) -> str:
        return f"{self.operation.describe()} (its SQL elsewhere than on PostgreSQL)"


# -- DDL on the partitioned outbox while it is written ------------------------------------------

# A lock wait cut short is tried again this many times, a second apart, before the migration
# gives up (it can be run again: every step looks at what is there first).
ATTEMPTS = 30
RETRY_AFTER = 1.0
DEADLOCK = "40P01"


def in_brief_transaction(connection: Any, work: Callable[[Any], T]) -> T:
    """Run ``work(cursor)`` in one transaction whose lock waits last ``DDL_LOCK_TIMEOUT``, so
    that the inserts queued behind a waiting DDL statement wait no longer; serialized with
    partition upkeep (which creates and attaches partitions), and tried again while a lock is
    what stops it. Returns what ``work`` returned."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)", [ADVISORY_CLASS, UPKEEP_LOCK]
                )
                cursor.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                return work(cursor)
        except OperationalError as exc:
            busy = getattr(exc.__cause__, "sqlstate", None) in (LOCK_NOT_AVAILABLE, DEADLOCK)
            if not busy or attempt == ATTEMPTS:
                raise
            time.sleep(RETRY_AFTER)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def briefly(connection: Any, statements: Sequence[str]) -> None:
    """Run ``statements`` in one transaction as :func:`in_brief_transaction` does."""

    def execute(cursor: Any) -> None:
        for statement in statements:
            cursor.execute(statement)

    in_brief_transaction(connection, execute)


def one(connection: Any, sql: str, params: Sequence[Any]) -> Any:
    """The first column of the first row ``sql`` returns, or None when it returns none."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return None if row is None else row[0]


def build_concurrently(connection: Any, name: str, create: str) -> None:
    """Run ``create``, a CREATE INDEX CONCURRENTLY of the index ``name``, outside a
    transaction."""
    with connection.cursor() as cursor:
        # An earlier build that was interrupted leaves an INVALID index of this name.
        cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
        cursor.execute(create)


def outbox_tree(
    connection: Any, top: str = OUTBOX_TABLE
) -> list[tuple[str, str | None, bool, int]]:
    """(table, its parent, whether it is a leaf, its depth under ``top``) of ``top`` (the
    outbox, by default) and every partition under it, shallowest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, p.relname, t.isleaf, t.level "
            "FROM pg_partition_tree(to_regclass(%s)) t JOIN pg_class c ON c.oid = t.relid "
            "LEFT JOIN pg_class p ON p.oid = t.parentrelid ORDER BY t.level, c.relname",
            [top],
        )
        return [(name, parent, bool(leaf), int(level)) for name, parent, leaf, level in cursor]
