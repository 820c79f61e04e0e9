"""The outbox stops indexing what nothing reads: a row without an idempotency key (almost
every row) costs two index entries fewer to publish, and one or two fewer to mark sent.

For the model, ``idempotency_key`` is no longer ``unique=True``: a partial unique constraint
``rm_outbox_idem_uniq`` (keys that are not NULL) takes its place. On SQLite that is what the
migration does, with Django's operations.

On PostgreSQL the outbox is partitioned (0010) and the model's unique key never existed as
such: each partition has its own unique index of keys, and ``publish()`` looks a key up in
every partition under an advisory lock. There the migration

1. drops the ``varchar_pattern_ops`` index Django made beside ``unique=True``
   (``..._idempotency_key_..._like``), with the index PostgreSQL made from it on every
   partition, in either layout (a new installation's, or the legacy table and ``_current`` of
   one that had rows before 0010; found in the catalog, not by name). Nothing matches keys
   with LIKE; the admin's search matches them with ``UPPER(...) =``, which no B-tree on the
   column serves either. A partitioned index cannot be dropped CONCURRENTLY: the drop locks
   the outbox for a moment, awaited ``DDL_LOCK_TIMEOUT`` at a time and tried again while
   other transactions hold it, so publishers never queue behind it for long;
2. replaces the full unique constraint on ``idempotency_key`` (which holds an entry for every
   NULL) with a partial unique index, keys that are not NULL only, of the same name, on the
   partitions that live as long as the outbox does: the unsent partition (every publish
   writes there; it is small) and, where there is one, the legacy table (no row is added to it any more, but it lives until
   its last failed row is dealt with). Each new index is built CONCURRENTLY before the
   constraint goes (one scan of the table, writes going on; a short lock for the swap), so a
   key is never unguarded.

The day partitions that exist (yesterday to the days made ahead, and older ones still kept) keep
their full constraint, which answers lookups as well: they are dropped whole once expired, and
swapping their index would lock writes to the day being filled. The days created from now on
(``partitions.outbox_leaf_sql``) get the partial index, ``<leaf>_idem`` as before; until the
new code is deployed, a day made by the old code has a full constraint, as before.

Reversible: backwards gives every partition whose key index is partial its full unique
constraint again (built CONCURRENTLY, swapped under a short lock) and rebuilds the
``varchar_pattern_ops`` index without blocking writes: on each partition CONCURRENTLY, then
attached to an index created on the partitioned tables alone. Either way each step can be run
again after an interruption.
"""

from __future__ import annotations

from typing import Any

from django.db import OperationalError, migrations, models

from reliable_messaging.migration_ops import (
    ElsewhereThanPostgreSQL,
    briefly,
    build_concurrently,
    one,
    outbox_tree,
)
from reliable_messaging.partitions import (
    OUTBOX_LEGACY,
    OUTBOX_TABLE,
    OUTBOX_UNSENT,
)

COLUMN = "idempotency_key"
# The name Django gave the varchar_pattern_ops index (0002), given back by the reverse.
LIKE_INDEX = "reliable_messaging_outboxmessage_idempotency_key_e3557cfe_like"
# The partitions whose full unique constraint is swapped (see the docstring).
SWAPPED = (OUTBOX_UNSENT, OUTBOX_LEGACY)


def _key_constraint(connection: Any, table: str) -> str | None:
    """The unique constraint of ``table`` on the idempotency key alone, if any."""
    return one(
        connection,
        "SELECT k.conname FROM pg_constraint k "
        "JOIN pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = k.conkey[1] "
        "WHERE k.conrelid = to_regclass(%s) AND k.contype = 'u' "
        "AND cardinality(k.conkey) = 1 AND a.attname = %s",
        [table, COLUMN],
    )


def _partial_key_index(connection: Any, table: str) -> str | None:
    """The partial unique index of ``table`` on the idempotency keys that are not NULL (no
    constraint can own one), if any."""
    return one(
        connection,
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
        "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indnatts = 1 "
        "AND a.attname = %s AND pg_get_expr(i.indpred, i.indrelid) = %s",
        [table, COLUMN, f"({COLUMN} IS NOT NULL)"],
    )


def _like_index(connection: Any, table: str) -> str | None:
    """The ``varchar_pattern_ops`` index of ``table`` on the idempotency key, if any."""
    return one(
        connection,
        "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
        "JOIN pg_opclass o ON o.oid = i.indclass[0] "
        "WHERE i.indrelid = to_regclass(%s) AND i.indnatts = 1 AND a.attname = %s "
        "AND o.opcname = 'varchar_pattern_ops'",
        [table, COLUMN],
    )


def _partial_instead_of_constraint(connection: Any, table: str) -> None:
    constraint = _key_constraint(connection, table)
    if constraint is None:
        return  # not there, or done already
    new = f"{table}_idem_partial"
    build_concurrently(
        connection,
        new,
        f'CREATE UNIQUE INDEX CONCURRENTLY "{new}" ON "{table}" ({COLUMN}) '
        f"WHERE {COLUMN} IS NOT NULL",
    )
    briefly(
        connection,
        [
            f'ALTER TABLE "{table}" DROP CONSTRAINT "{constraint}"',
            f'ALTER INDEX "{new}" RENAME TO "{constraint}"',
        ],
    )


def _constraint_instead_of_partial(connection: Any, table: str) -> None:
    partial = _partial_key_index(connection, table)
    if partial is None or _key_constraint(connection, table) is not None:
        return
    new = f"{table}_idem_full"
    build_concurrently(
        connection, new, f'CREATE UNIQUE INDEX CONCURRENTLY "{new}" ON "{table}" ({COLUMN})'
    )
    # The constraint takes the index, and renames it to its own name.
    briefly(
        connection,
        [
            f'DROP INDEX "{partial}"',
            f'ALTER TABLE "{table}" ADD CONSTRAINT "{partial}" UNIQUE USING INDEX "{new}"',
        ],
    )


def _rebuild_like_index(connection: Any) -> None:
    """Create the ``varchar_pattern_ops`` index as PostgreSQL's documentation says to on a
    partitioned table that is being written: on the partitioned tables alone (ON ONLY: no
    build), on each partition CONCURRENTLY, then attached, from the deepest up. A partition
    attached meanwhile gets its index from its parent's; one that did not (attached before its
    parent had the index) is found by the next round."""
    for _ in range(3):
        for table, _parent, leaf, level in outbox_tree(connection):
            if _like_index(connection, table) is not None:
                continue
            name = LIKE_INDEX if level == 0 else f"{table}_idem_like"
            if leaf:
                build_concurrently(
                    connection,
                    name,
                    f'CREATE INDEX CONCURRENTLY "{name}" ON "{table}" '
                    f"({COLUMN} varchar_pattern_ops)",
                )
            else:
                briefly(
                    connection,
                    [f'CREATE INDEX "{name}" ON ONLY "{table}" ({COLUMN} varchar_pattern_ops)'],
                )
        for table, parent, _leaf, _level in sorted(outbox_tree(connection), key=lambda t: -t[3]):
            if parent is None:
                continue
            child = _like_index(connection, table)
            if child is None:
                continue  # a partition attached since: the next round
            attached = one(
                connection,
                "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = %s::regclass)",
                [child],
            )
            if not attached:
                parent_index = _like_index(connection, parent)
                briefly(connection, [f'ALTER INDEX "{parent_index}" ATTACH PARTITION "{child}"'])
        valid = one(
            connection,
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
            [LIKE_INDEX],
        )
        if valid:
            return
    raise OperationalError(f"{LIKE_INDEX} is still not valid: run the migration again")


def lean_indexes(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    like = _like_index(connection, OUTBOX_TABLE)
    if like is not None:
        briefly(connection, [f'DROP INDEX "{like}"'])
    for table in SWAPPED:
        _partial_instead_of_constraint(connection, table)


def full_indexes(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    for table, _parent, leaf, _level in outbox_tree(connection):
        if leaf:
            _constraint_instead_of_partial(connection, table)
    _rebuild_like_index(connection)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0013_outbox_wake_after_commit"),
    ]

    operations = [
        ElsewhereThanPostgreSQL(
            migrations.AlterField(
                model_name="outboxmessage",
                name="idempotency_key",
                field=models.CharField(blank=True, max_length=255, null=True),
            )
        ),
        ElsewhereThanPostgreSQL(
            migrations.AddConstraint(
                model_name="outboxmessage",
                constraint=models.UniqueConstraint(
                    condition=models.Q(("idempotency_key__isnull", False)),
                    fields=("idempotency_key",),
                    name="rm_outbox_idem_uniq",
                ),
            )
        ),
        migrations.RunPython(
            lean_indexes, full_indexes, hints={"model_name": "outboxmessage"}, elidable=False
        ),
    ]
