"""The inbox keeps three indexes besides its primary key, and none on message_id alone.

The unique constraint becomes (message_id, consumer): it still decides which copy of a message
takes effect (``ON CONFLICT (consumer, message_id)`` infers it whatever its column order), and
now also answers lookups by message_id alone, so the index on message_id goes. With random ids
(UUIDv4 from foreign producers) that index was a second B-tree where every insert lands on a
random page: a page read and a full-page image in the WAL per message once the inbox outgrows
the cache. Lookups by consumer alone (the admin's filter and search) get an index on consumer:
few distinct values, deduplicated, small.

On PostgreSQL every index is built and dropped CONCURRENTLY, and the constraint swapped onto its
ready-built unique index by one short ALTER TABLE, so consumers go on inserting while it runs
(each build scans the table: minutes per hundred million rows); the migration is therefore not
atomic. Elsewhere (SQLite) the usual operations. Reversible.
"""

from typing import Any

from django.db import NotSupportedError, migrations, models
from django.db.migrations.operations.base import Operation

from reliable_messaging.migration_ops import AddIndexOnline, RemoveIndexOnline


class ReplaceUniqueConstraintOnline(Operation):
    """Replace the unique constraint ``old`` of ``model_name`` with ``new`` (plain ones, on
    fields): on PostgreSQL by building the new one's index CONCURRENTLY, then one ALTER TABLE
    that drops the old constraint and adds the new one USING that index (brief lock)."""

    reversible = True
    atomic = False

    def __init__(
        self, model_name: str, old: models.UniqueConstraint, new: models.UniqueConstraint
    ) -> None:
        self.model_name = model_name
        self.old = old
        self.new = new

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (
            self.__class__.__name__,
            [],
            {"model_name": self.model_name, "old": self.old, "new": self.new},
        )

    def state_forwards(self, app_label: str, state: Any) -> None:
        state.remove_constraint(app_label, self.model_name.lower(), self.old.name)
        state.add_constraint(app_label, self.model_name.lower(), self.new)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._swap(app_label, schema_editor, from_state, to_state, self.old, self.new)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._swap(app_label, schema_editor, from_state, to_state, self.new, self.old)

    def _swap(
        self,
        app_label: str,
        schema_editor: Any,
        from_state: Any,
        to_state: Any,
        drop: models.UniqueConstraint,
        add: models.UniqueConstraint,
    ) -> None:
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if schema_editor.connection.vendor != "postgresql":
            old_model = from_state.apps.get_model(app_label, self.model_name)
            schema_editor.remove_constraint(old_model, drop)
            schema_editor.add_constraint(model, add)
            return
        if schema_editor.connection.in_atomic_block:
            raise NotSupportedError(
                f"{type(self).__name__} cannot run inside a transaction: "
                "set atomic = False on the migration"
            )
        quote = schema_editor.quote_name
        table = quote(model._meta.db_table)
        columns = ", ".join(quote(model._meta.get_field(name).column) for name in add.fields)
        # An earlier build that was interrupted leaves an INVALID index of this name.
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quote(add.name)}")
        schema_editor.execute(
            f"CREATE UNIQUE INDEX CONCURRENTLY {quote(add.name)} ON {table} ({columns})"
        )
        schema_editor.execute(
            f"ALTER TABLE {table} DROP CONSTRAINT {quote(drop.name)}, "
            f"ADD CONSTRAINT {quote(add.name)} UNIQUE USING INDEX {quote(add.name)}"
        )

    def describe(self) -> str:
        return f"Replace {self.old.name} with {self.new.name} on {self.model_name}"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0007_outbox_due_index"),
    ]

    operations = [
        # First the index on consumer, so lookups by consumer never lose theirs.
        AddIndexOnline(
            model_name="processedmessage",
            index=models.Index(fields=["consumer"], name="rm_inbox_consumer_idx"),
        ),
        ReplaceUniqueConstraintOnline(
            model_name="processedmessage",
            old=models.UniqueConstraint(
                fields=("consumer", "message_id"), name="rm_inbox_consumer_message_uniq"
            ),
            new=models.UniqueConstraint(
                fields=("message_id", "consumer"), name="rm_inbox_message_consumer_uniq"
            ),
        ),
        RemoveIndexOnline(
            model_name="processedmessage",
            name="rm_inbox_message_id_idx",
        ),
    ]
