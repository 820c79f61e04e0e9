"""Migration operations that leave a live system writing while they run.

``AddIndexOnline`` and ``RemoveIndexOnline`` build and drop an index CONCURRENTLY on
PostgreSQL (a plain CREATE INDEX blocks every insert into the table until the build ends, a
minute or more on a large outbox or inbox) and as usual elsewhere. A migration using them sets
``atomic = False``, as PostgreSQL requires. ``ElsewhereThanPostgreSQL`` wraps an operation
whose SQL a migration replaces with its own on PostgreSQL.
"""

from __future__ import annotations

from typing import Any

from django.db import NotSupportedError
from django.db.migrations.operations import AddIndex, RemoveIndex
from django.db.migrations.operations.base import Operation


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
