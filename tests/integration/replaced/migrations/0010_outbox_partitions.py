"""On PostgreSQL the outbox becomes a partitioned table (see ``partitions.py``).

Its unsent rows (pending, failed) get a partition of their own, the one the relay reads; its
sent and unrouted rows go into one partition per UTC day of ``sent_at``, dropped whole by the
purge once expired.

An empty outbox (a new installation) is simply replaced. One with rows is kept as it is and
becomes the partition of every id up to a cut-over id, the layout above taking the ids after
it (the outbox is then partitioned by id first). What that costs on a live system:

- a CHECK constraint ``id < cut-over`` is added NOT VALID (a moment's exclusive lock), then
  validated: one sequential scan of the table, during which ``publish()`` goes on inserting
  (the cut-over lies ``ID_MARGIN`` ids past the last one given out, far more than are used
  meanwhile);
- then, in one short transaction under an exclusive lock, the table is renamed, the
  partitioned table created and the old one attached (the validated CHECK spares a scan; its
  indexes become the partitioned table's, none is built);
- no row is copied. The old table's pending rows are sent from where they are, and its sent
  rows are deleted in batches by the purge once expired, as before. Its failed rows stay until
  someone deals with them, as every failed row does.

Reversing copies every row into a plain table in one transaction, with the outbox locked (for
a large outbox, a maintenance window). Elsewhere (SQLite) nothing changes.
"""

import re
from typing import Any

from django.db import migrations, transaction

from reliable_messaging import partitions
from reliable_messaging.partitions import (
    OUTBOX,
    OUTBOX_CURRENT,
    OUTBOX_LEGACY,
    OUTBOX_SENT,
    OUTBOX_TABLE,
    OUTBOX_UNSENT,
    SENT_SQL,
    UNSENT_SQL,
)

LEGACY_RANGE = "rm_outbox_legacy_range"
# How far past the last id given out the cut-over lies: inserts made while the CHECK is
# validated need ids below it (a bigint has room for many such jumps).
ID_MARGIN = 100_000_000
SEQUENCE = f'"{OUTBOX_TABLE}_id_seq"'


def _own_indexes(cursor: Any, table: str) -> list[tuple[str, str]]:
    """(name, CREATE INDEX statement) of each index of ``table`` that no constraint owns."""
    cursor.execute(
        "SELECT c.relname, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(%s) "
        "AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid) "
        "ORDER BY c.relname",
        [table],
    )
    return [(name, re.sub(r" ON ONLY ", " ON ", sql)) for name, sql in cursor.fetchall()]


def _triggers(cursor: Any, table: str) -> list[tuple[str, str]]:
    cursor.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
        "WHERE tgrelid = to_regclass(%s) AND NOT tgisinternal ORDER BY tgname",
        [table],
    )
    return list(cursor.fetchall())


def _status_level(cursor: Any, table: str) -> None:
    """Make ``table`` (partitioned by status) hold the unsent partition and the sent one, the
    latter partitioned by day of sent_at (no default partition: see ``partitions.py``)."""
    for statement in partitions.outbox_leaf_sql(OUTBOX_UNSENT):
        cursor.execute(statement)
    cursor.execute(
        f'ALTER TABLE "{table}" ATTACH PARTITION "{OUTBOX_UNSENT}" '
        f"FOR VALUES IN ({UNSENT_SQL})"
    )
    cursor.execute(
        f'CREATE TABLE "{OUTBOX_SENT}" (LIKE "{OUTBOX_TABLE}" INCLUDING DEFAULTS '
        "INCLUDING CONSTRAINTS) PARTITION BY RANGE (sent_at)"
    )
    cursor.execute(
        f'ALTER TABLE "{table}" ATTACH PARTITION "{OUTBOX_SENT}" '
        f"FOR VALUES IN ({SENT_SQL})"
    )


class PartitionOutbox(partitions.PartitioningOperation):
    model_name = "outboxmessage"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not self._applies(app_label, schema_editor, to_state):
            return
        connection = schema_editor.connection
        with connection.cursor() as cursor:
            cursor.execute(f'SELECT EXISTS (SELECT 1 FROM "{OUTBOX_TABLE}")')  # noqa: S608
            has_rows = cursor.fetchone()[0]
            cutover = None
            if has_rows:
                cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [OUTBOX_TABLE])
                sequence = cursor.fetchone()[0]
                cursor.execute(f'SELECT max(id) FROM "{OUTBOX_TABLE}"')  # noqa: S608
                newest = cursor.fetchone()[0] or 0
                given = partitions.sequence_value(cursor, sequence) if sequence else 0
                cutover = max(newest, given) + ID_MARGIN
                cursor.execute(
                    f'ALTER TABLE "{OUTBOX_TABLE}" DROP CONSTRAINT IF EXISTS {LEGACY_RANGE}'
                )
                cursor.execute(
                    f'ALTER TABLE "{OUTBOX_TABLE}" ADD CONSTRAINT {LEGACY_RANGE} '
                    f"CHECK (id < {cutover}) NOT VALID"
                )
                cursor.execute(f'ALTER TABLE "{OUTBOX_TABLE}" VALIDATE CONSTRAINT {LEGACY_RANGE}')
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            self._switch(cursor, cutover)
        partitions.ensure_partitions(connection.alias, spec=OUTBOX)

    @staticmethod
    def _switch(cursor: Any, cutover: int | None) -> None:
        cursor.execute(f'LOCK TABLE "{OUTBOX_TABLE}" IN ACCESS EXCLUSIVE MODE')
        if cutover is None:
            # Still empty? Rows that arrived after the first look keep the old table.
            cursor.execute(f'SELECT max(id) FROM "{OUTBOX_TABLE}"')  # noqa: S608
            newest = cursor.fetchone()[0]
            if newest is not None:
                cutover = int(newest) + ID_MARGIN
                cursor.execute(
                    f'ALTER TABLE "{OUTBOX_TABLE}" ADD CONSTRAINT {LEGACY_RANGE} '
                    f"CHECK (id < {cutover})"
                )
        indexes = _own_indexes(cursor, OUTBOX_TABLE)
        triggers = _triggers(cursor, OUTBOX_TABLE)
        cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [OUTBOX_TABLE])
        sequence = cursor.fetchone()[0]
        next_id = partitions.sequence_value(cursor, sequence) if sequence else 0
        cursor.execute(f'ALTER TABLE "{OUTBOX_TABLE}" RENAME TO "{OUTBOX_LEGACY}"')
        for name, _ in triggers:
            cursor.execute(f'DROP TRIGGER "{name}" ON "{OUTBOX_LEGACY}"')
        for number, (name, _) in enumerate(indexes):
            # The partitioned table's indexes take these names; the old ones become theirs.
            cursor.execute(f'ALTER INDEX "{name}" RENAME TO "{OUTBOX_LEGACY}_{number}"')
        cursor.execute(f'ALTER TABLE "{OUTBOX_LEGACY}" ALTER COLUMN id DROP IDENTITY IF EXISTS')
        cursor.execute(f'ALTER TABLE "{OUTBOX_LEGACY}" ALTER COLUMN id DROP DEFAULT')
        if sequence:
            cursor.execute(f"DROP SEQUENCE IF EXISTS {sequence}")
        cursor.execute(f"CREATE SEQUENCE {SEQUENCE}")
        if cutover is not None:
            next_id = max(next_id, cutover - 1)
        if next_id > 0:
            cursor.execute(f"SELECT setval('{SEQUENCE}', %s)", [next_id])
        cursor.execute(
            f'CREATE TABLE "{OUTBOX_TABLE}" (LIKE "{OUTBOX_LEGACY}" INCLUDING DEFAULTS) '
            + ("PARTITION BY RANGE (id)" if cutover is not None else "PARTITION BY LIST (status)")
        )
        cursor.execute(
            f'ALTER TABLE "{OUTBOX_TABLE}" ADD CONSTRAINT "{OUTBOX_TABLE}_attempts_check" '
            "CHECK (attempts >= 0)"
        )
        cursor.execute(
            f"ALTER TABLE \"{OUTBOX_TABLE}\" ALTER COLUMN id SET DEFAULT nextval('{SEQUENCE}')"
        )
        cursor.execute(f'ALTER SEQUENCE {SEQUENCE} OWNED BY "{OUTBOX_TABLE}".id')
        if cutover is not None:
            # The old table's own CHECK on attempts, of the same name, stands for this one.
            cursor.execute(
                f'ALTER TABLE "{OUTBOX_TABLE}" ATTACH PARTITION "{OUTBOX_LEGACY}" '
                f"FOR VALUES FROM (MINVALUE) TO ({cutover})"
            )
            cursor.execute(f'ALTER TABLE "{OUTBOX_LEGACY}" DROP CONSTRAINT {LEGACY_RANGE}')
            cursor.execute(
                f'CREATE TABLE "{OUTBOX_CURRENT}" (LIKE "{OUTBOX_TABLE}" INCLUDING DEFAULTS '
                "INCLUDING CONSTRAINTS) PARTITION BY LIST (status)"
            )
            cursor.execute(
                f'ALTER TABLE "{OUTBOX_TABLE}" ATTACH PARTITION "{OUTBOX_CURRENT}" '
                f"FOR VALUES FROM ({cutover}) TO (MAXVALUE)"
            )
            _status_level(cursor, OUTBOX_CURRENT)
        else:
            cursor.execute(f'DROP TABLE "{OUTBOX_LEGACY}"')
            _status_level(cursor, OUTBOX_TABLE)
        # Created on the partitioned table, each index is created on (or, where the old table
        # has its match, taken from) every partition.
        for _, statement in indexes:
            cursor.execute(statement)
        for _, statement in triggers:
            cursor.execute(statement)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not self._applies(app_label, schema_editor, to_state):
            return
        plain = f"{OUTBOX_TABLE}_plain"
        alias = schema_editor.connection.alias
        with transaction.atomic(using=alias), schema_editor.connection.cursor() as cursor:
            cursor.execute(f'LOCK TABLE "{OUTBOX_TABLE}" IN ACCESS EXCLUSIVE MODE')
            indexes = _own_indexes(cursor, OUTBOX_TABLE)
            triggers = _triggers(cursor, OUTBOX_TABLE)
            next_id = partitions.sequence_value(cursor, SEQUENCE)
            cursor.execute(
                f'CREATE TABLE "{plain}" (LIKE "{OUTBOX_TABLE}" INCLUDING CONSTRAINTS)'
            )
            cursor.execute(
                f'ALTER TABLE "{plain}" ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY'
            )
            cursor.execute(
                f'INSERT INTO "{plain}" SELECT * FROM "{OUTBOX_TABLE}"'  # noqa: S608
            )
            cursor.execute(f'DROP TABLE "{OUTBOX_TABLE}" CASCADE')
            cursor.execute(f'ALTER TABLE "{plain}" RENAME TO "{OUTBOX_TABLE}"')
            cursor.execute(f'ALTER SEQUENCE "{plain}_id_seq" RENAME TO "{OUTBOX_TABLE}_id_seq"')
            if next_id > 0:
                cursor.execute(f"SELECT setval('{SEQUENCE}', %s)", [next_id])
            cursor.execute(
                f'ALTER TABLE "{OUTBOX_TABLE}" ADD CONSTRAINT "{OUTBOX_TABLE}_pkey" '
                "PRIMARY KEY (id)"
            )
            cursor.execute(
                f'ALTER TABLE "{OUTBOX_TABLE}" ADD CONSTRAINT '
                f'"{OUTBOX_TABLE}_idempotency_key_key" UNIQUE (idempotency_key)'
            )
            for _, statement in indexes:
                cursor.execute(statement)
            for _, statement in triggers:
                cursor.execute(statement)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0009_inbox_partitions"),
    ]

    operations = [PartitionOutbox()]
