"""On PostgreSQL the inbox becomes a table partitioned by day (see ``partitions.py``).

An empty inbox (a new installation) is simply replaced. One with rows is kept as it is and
becomes the partition of everything processed before the cut-over, the start of the UTC day
after tomorrow (or after its newest row's); the day partitions take over from there. What
that costs on a live system:

- a CHECK constraint on processed_at is added NOT VALID (a moment's exclusive lock), then
  validated: one sequential scan of the table, during which consumers go on inserting;
- then, in one short transaction under an exclusive lock, the table is renamed, the
  partitioned table created and the old one attached (the validated CHECK spares a scan);
- no row is copied, no index rebuilt. Until the cut-over the old table takes the new rows;
  its expired rows are deleted in batches by the purge as before, and it is dropped whole once
  its last day has expired (``DEDUP_RETENTION`` after the cut-over).

Reversing copies every row into a plain table in one transaction, with the inbox locked (for
a large inbox, a maintenance window). Elsewhere (SQLite) nothing changes.
"""

import datetime as dt
from typing import Any

from django.db import migrations, transaction

from reliable_messaging import partitions
from reliable_messaging.partitions import INBOX_TABLE, LEGACY

LEGACY_RANGE = "rm_inbox_legacy_range"


class PartitionInbox(partitions.PartitioningOperation):
    model_name = "processedmessage"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not self._applies(app_label, schema_editor, to_state):
            return
        connection = schema_editor.connection
        today = dt.datetime.now(dt.UTC).date()
        with connection.cursor() as cursor:
            # Rows stamped ahead of the database's clock (an application server's clock, say)
            # stay in the old table too.
            cursor.execute(f'SELECT max(processed_at) FROM "{INBOX_TABLE}"')  # noqa: S608
            newest = cursor.fetchone()[0]
            last_day = today + dt.timedelta(days=1)
            if newest is not None:
                last_day = max(last_day, newest.astimezone(dt.UTC).date())
            cutover = partitions.day_start(last_day + dt.timedelta(days=1))
            cursor.execute(f'ALTER TABLE "{INBOX_TABLE}" DROP CONSTRAINT IF EXISTS {LEGACY_RANGE}')
            cursor.execute(
                f'ALTER TABLE "{INBOX_TABLE}" ADD CONSTRAINT {LEGACY_RANGE} '
                f"CHECK (processed_at < '{cutover.isoformat()}') NOT VALID"
            )
            cursor.execute(f'ALTER TABLE "{INBOX_TABLE}" VALIDATE CONSTRAINT {LEGACY_RANGE}')
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            self._switch(cursor, cutover)
        partitions.ensure_partitions(connection.alias)

    @staticmethod
    def _switch(cursor: Any, cutover: dt.datetime) -> None:
        cursor.execute(f'LOCK TABLE "{INBOX_TABLE}" IN ACCESS EXCLUSIVE MODE')
        cursor.execute(f'SELECT EXISTS (SELECT 1 FROM "{INBOX_TABLE}")')  # noqa: S608
        has_rows = cursor.fetchone()[0]
        cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [INBOX_TABLE])
        sequence = cursor.fetchone()[0]
        next_id = partitions.sequence_value(cursor, sequence) if sequence else 0
        cursor.execute(f'ALTER TABLE "{INBOX_TABLE}" RENAME TO "{LEGACY}"')
        # The ids go on from the old table's sequence, which goes with its column.
        cursor.execute(f'ALTER TABLE "{LEGACY}" ALTER COLUMN id DROP IDENTITY IF EXISTS')
        cursor.execute(f'ALTER TABLE "{LEGACY}" ALTER COLUMN id DROP DEFAULT')
        if sequence:
            cursor.execute(f"DROP SEQUENCE IF EXISTS {sequence}")
        seq = f'"{INBOX_TABLE}_id_seq"'
        cursor.execute(f"CREATE SEQUENCE {seq}")
        if next_id > 0:
            cursor.execute(f"SELECT setval('{seq}', %s)", [next_id])
        cursor.execute(
            f'CREATE TABLE "{INBOX_TABLE}" (LIKE "{LEGACY}") PARTITION BY RANGE (processed_at)'
        )
        cursor.execute(
            f"ALTER TABLE \"{INBOX_TABLE}\" ALTER COLUMN id SET DEFAULT nextval('{seq}')"
        )
        cursor.execute(f'ALTER SEQUENCE {seq} OWNED BY "{INBOX_TABLE}".id')
        if has_rows:
            cursor.execute(
                f'ALTER TABLE "{INBOX_TABLE}" ATTACH PARTITION "{LEGACY}" '
                f"FOR VALUES FROM (MINVALUE) TO ('{cutover.isoformat()}')"
            )
            cursor.execute(f'ALTER TABLE "{LEGACY}" DROP CONSTRAINT {LEGACY_RANGE}')
        else:
            cursor.execute(f'DROP TABLE "{LEGACY}"')

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if not self._applies(app_label, schema_editor, to_state):
            return
        plain = f"{INBOX_TABLE}_plain"
        alias = schema_editor.connection.alias
        with transaction.atomic(using=alias), schema_editor.connection.cursor() as cursor:
            cursor.execute(f'LOCK TABLE "{INBOX_TABLE}" IN ACCESS EXCLUSIVE MODE')
            next_id = partitions.sequence_value(cursor, f'"{INBOX_TABLE}_id_seq"')
            cursor.execute(
                f'CREATE TABLE "{plain}" (id bigint GENERATED BY DEFAULT AS IDENTITY '
                "PRIMARY KEY, consumer varchar(255) NOT NULL, "
                "message_id varchar(255) NOT NULL, processed_at timestamptz NOT NULL)"
            )
            cursor.execute(
                f'INSERT INTO "{plain}" (id, consumer, message_id, processed_at) '  # noqa: S608
                f'SELECT id, consumer, message_id, processed_at FROM "{INBOX_TABLE}"'
            )
            cursor.execute(f'DROP TABLE "{INBOX_TABLE}" CASCADE')
            cursor.execute(f'ALTER TABLE "{plain}" RENAME TO "{INBOX_TABLE}"')
            cursor.execute(f'ALTER SEQUENCE "{plain}_id_seq" RENAME TO "{INBOX_TABLE}_id_seq"')
            if next_id > 0:
                cursor.execute(f"SELECT setval('\"{INBOX_TABLE}_id_seq\"', %s)", [next_id])
            cursor.execute(
                f'ALTER TABLE "{INBOX_TABLE}" ADD CONSTRAINT rm_inbox_message_consumer_uniq '
                "UNIQUE (message_id, consumer)"
            )
            cursor.execute(f'CREATE INDEX rm_inbox_consumer_idx ON "{INBOX_TABLE}" (consumer)')
            cursor.execute(
                f'CREATE INDEX rm_inbox_processed_at_idx ON "{INBOX_TABLE}" (processed_at)'
            )

    def describe(self) -> str:
        return "Partition the inbox by day (PostgreSQL)"


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0008_inbox_indexes"),
    ]

    operations = [PartitionInbox()]
