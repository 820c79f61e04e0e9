"""The unsent partition of the outbox keeps only the indexes that a publish or the relay needs:
``rm_outbox_status_sent_idx`` (status, sent_at) and ``rm_outbox_message_id_idx`` (message_id)
move to the sent side, so a publish writes two index entries fewer in the caller's transaction.

Nothing reads the unsent rows through them: the relay claims through the due index, and
``pending().count()`` can count on it (its predicate is status = 'pending'); the admin's search
ORs ``= message_id`` with a substring of ``last_error``, which reads every row anyway. What
they serve is on the sent side: the purge's rows finished before a time, the unrouted count,
a sent row found by its message_id. The failed rows, which the metrics, the health check and
the admin's filter count or list, get a partial index ``<outbox>_unsent_failed`` on ``(id)
WHERE status = 'failed'`` instead, which a publish (a pending row) writes nothing into.

Only on PostgreSQL, where the outbox is partitioned (0010). The model keeps both indexes in
``Meta.indexes``: their names now name the sent side's partitioned indexes, so Django's
migration state is unchanged and elsewhere (SQLite) the migration does nothing.

An index of a partitioned table cannot be detached from its partitions', nor dropped from one
of them: the whole outbox's index goes at once, with its copy on every partition. So, for each
of the two, on a live system:

1. a new index is built CONCURRENTLY on every partition of the sent side (each day) and, where there is one, on the legacy table (0010: it still holds sent rows,
   deleted in batches once expired, and may be searched; it keeps an index of its own), while
   publishes and the relay go on writing;
2. in one short transaction, an index is created on the sent side alone (ON ONLY: no build) and
   each day's is attached to it, which makes it valid; under the advisory lock of partition
   upkeep, so no day is attached meanwhile without one (a day attached afterwards gets its copy
   from the sent side's index, as it is attached). A day attached between the builds and this
   transaction is built in another round;
3. in another, the outbox's own index is dropped (a moment's lock of the outbox and its
   partitions) and the sent side's takes its name.

Each transaction awaits its locks ``DDL_LOCK_TIMEOUT`` at a time and is tried again while
another transaction holds them, so publishers never queue behind it for long. Every step looks
at the catalog first, and can be run again after an interruption.

Backwards restores what 0014 left: the unsent partition's copy is built CONCURRENTLY, then in
one short transaction the outbox's index is created ON ONLY (and, on a legacy layout, that of
``<outbox>_current``) and the sent side's, the unsent partition's and the legacy table's are
attached under it, none rebuilt; then ``<outbox>_unsent_failed`` is dropped CONCURRENTLY.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import OperationalError, ProgrammingError, migrations

from reliable_messaging.migration_ops import (
    briefly,
    build_concurrently,
    in_brief_transaction,
    one,
    outbox_tree,
)
from reliable_messaging.partitions import (
    OUTBOX_LEGACY,
    OUTBOX_SENT,
    OUTBOX_TABLE,
    OUTBOX_UNSENT,
)

FAILED_INDEX = f"{OUTBOX_UNSENT}_failed"
# A partition attached while the indexes are built is built in the next round; after this
# many, the migration gives up (and can be run again).
ROUNDS = 3
UNDEFINED_TABLE = "42P01"


@dataclass(frozen=True)
class MovedIndex:
    """One of the model's indexes that the migration moves to the sent side."""

    name: str
    columns: tuple[str, ...]

    @property
    def column_list(self) -> str:
        return ", ".join(self.columns)

    def built_name(self, table: str) -> str:
        """The name of the copy this migration builds on ``table``."""
        return f"{table}_{'_'.join(self.columns)}"

    def postgres_name(self, table: str) -> str:
        """The name PostgreSQL gives the copy of a partitioned index on the partition ``table``
        (those 0014 left)."""
        return f"{table}_{'_'.join(self.columns)}_idx"


MOVED = (
    MovedIndex("rm_outbox_status_sent_idx", ("status", "sent_at")),
    MovedIndex("rm_outbox_message_id_idx", ("message_id",)),
)


@dataclass(frozen=True)
class FoundIndex:
    name: str
    # Valid, or partitioned (an index created ON ONLY is valid once every partition's copy is
    # attached to it).
    usable: bool
    # A partition of another index.
    attached: bool
    # Part of the outbox's own index (what 0014 left, and 0015 drops).
    whole_outbox: bool


def _indexes(connection: Any, table: str, index: MovedIndex) -> list[FoundIndex]:
    """The plain B-tree indexes of ``table`` on ``index``'s columns, those attached to another
    first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, i.indisvalid OR c.relkind = 'I', "
            "EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.indexrelid) AS attached, "
            "top.indrelid = to_regclass(%s) "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_am am ON am.oid = c.relam AND am.amname = 'btree' "
            # The index at the top of its partition tree (itself, when it is in none).
            "JOIN pg_index top "
            "ON top.indexrelid = coalesce(pg_partition_root(i.indexrelid), i.indexrelid) "
            "WHERE i.indrelid = to_regclass(%s) AND NOT i.indisunique "
            "AND i.indpred IS NULL AND i.indexprs IS NULL "
            "AND ARRAY(SELECT a.attname::text "
            "FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n) "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
            "ORDER BY k.n) = %s::text[] "
            "AND NOT EXISTS (SELECT 1 FROM unnest(i.indclass::oid[]) AS k(opclass) "
            "JOIN pg_opclass o ON o.oid = k.opclass WHERE NOT o.opcdefault) "
            "ORDER BY attached DESC, c.relname",
            [OUTBOX_TABLE, table, list(index.columns)],
        )
        return [FoundIndex(*row) for row in cursor.fetchall()]


def _own(connection: Any, table: str, index: MovedIndex) -> FoundIndex | None:
    """The usable index of ``table`` on ``index``'s columns that is not part of the outbox's
    own (it stays when that is dropped), if any."""
    found = _indexes(connection, table, index)
    return next((f for f in found if f.usable and not f.whole_outbox), None)


def _any(connection: Any, table: str, index: MovedIndex) -> FoundIndex | None:
    """The usable index of ``table`` on ``index``'s columns, if any."""
    return next((f for f in _indexes(connection, table, index) if f.usable), None)


def _free_name(connection: Any, name: str) -> str:
    """``name``, or with a number after it while an earlier round's index has it (back and
    forth, the indexes attached backwards keep the names they were built with)."""
    for number in range(100):
        candidate = name if number == 0 else f"{name}{number}"
        if one(connection, "SELECT to_regclass(%s) IS NULL", [f'"{candidate}"']):
            return candidate
    raise OperationalError(f"no free index name like {name}")


def _build(connection: Any, table: str, index: MovedIndex, name: str) -> None:
    """A copy of ``index`` on the partition ``table``, built CONCURRENTLY, named ``name`` or,
    while that is taken, with a number after it."""
    for leftover in _indexes(connection, table, index):
        if not leftover.usable and not leftover.attached:
            # A build that was interrupted leaves an INVALID index, which every write keeps
            # up to date all the same.
            with connection.cursor() as cursor:
                cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{leftover.name}"')
    name = _free_name(connection, name)
    try:
        build_concurrently(
            connection,
            name,
            f'CREATE INDEX CONCURRENTLY "{name}" ON "{table}" ({index.column_list})',
        )
    except ProgrammingError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != UNDEFINED_TABLE:
            raise
        # Dropped by the purge meanwhile (an expired day, an empty legacy table): it needs no
        # index any more.


Finder = Callable[[Any, str, MovedIndex], FoundIndex | None]


def _gather(
    connection: Any,
    top: str,
    index: MovedIndex,
    find: Finder,
    name_for: Callable[[str], str],
    prepare: Callable[[], None] | None = None,
) -> None:
    """Give ``top``, a partitioned table, an index on ``index``'s columns made of one on each
    of its partitions (``find`` tells which): each partition's built CONCURRENTLY where it has
    none, then in one short transaction under the upkeep's lock (after ``prepare``) the
    partitioned tables' created ON ONLY and every one attached to its parent's, deepest first,
    which leaves them valid. A partition attached between the builds and that transaction has
    no copy yet: it is built, and the transaction tried again."""

    def attach(cursor: Any) -> bool:
        tree = outbox_tree(connection, top)
        if any(leaf and find(connection, table, index) is None for table, _, leaf, _ in tree):
            return False
        if prepare is not None:
            prepare()
        # Read once, before the statements below take locks that the transaction then holds:
        # creating or attaching its parent's index does not change a partition's own.
        found = {table: find(connection, table, index) for table, _, _, _ in tree}
        names = {table: f.name for table, f in found.items() if f is not None}
        for table, _parent, _leaf, _level in tree:
            if table not in names:  # a partitioned table: the leaves all have one
                names[table] = name_for(table)
                cursor.execute(
                    f'CREATE INDEX "{names[table]}" ON ONLY "{table}" ({index.column_list})'
                )
        for table, parent, _leaf, level in sorted(tree, key=lambda t: -t[3]):
            mine = found[table]
            if level == 0 or parent is None or (mine is not None and mine.attached):
                continue
            cursor.execute(f'ALTER INDEX "{names[parent]}" ATTACH PARTITION "{names[table]}"')
        valid = one(
            connection,
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
            [f'"{names[top]}"'],
        )
        if not valid:
            raise OperationalError(f"{names[top]} on {top} is still not valid")
        return True

    for _ in range(ROUNDS):
        for table, _parent, leaf, _level in outbox_tree(connection, top):
            if leaf and find(connection, table, index) is None:
                _build(connection, table, index, name_for(table))
        if in_brief_transaction(connection, attach):
            return
    raise OperationalError(
        f"partitions of {top} keep being attached without an index on {index.column_list}: "
        "run the migration again"
    )


def _exists(connection: Any, table: str) -> bool:
    return bool(one(connection, "SELECT to_regclass(%s) IS NOT NULL", [table]))


def _to_the_sent_side(connection: Any, index: MovedIndex) -> None:
    if _exists(connection, OUTBOX_LEGACY) and _own(connection, OUTBOX_LEGACY, index) is None:
        _build(connection, OUTBOX_LEGACY, index, index.built_name(OUTBOX_LEGACY))
    _gather(
        connection,
        OUTBOX_SENT,
        index,
        _own,
        lambda table: _free_name(connection, index.built_name(table)),
    )
    whole = _any(connection, OUTBOX_TABLE, index)
    sent = _own(connection, OUTBOX_SENT, index)
    assert sent is not None  # gathered above
    statements = []
    if whole is not None:
        # With its copy on every partition: the unsent one's, and the old ones beside the
        # indexes built above.
        statements.append(f'DROP INDEX "{whole.name}"')
    if sent.name != index.name:
        statements.append(f'ALTER INDEX "{sent.name}" RENAME TO "{index.name}"')
    if statements:
        briefly(connection, statements)


def _back_to_the_whole_outbox(connection: Any, index: MovedIndex) -> None:
    def name_for(table: str) -> str:
        if table == OUTBOX_TABLE:
            return index.name
        return _free_name(connection, index.postgres_name(table))

    def free_the_name() -> None:
        """The sent side's index gives the outbox's the model's name back."""
        sent = _any(connection, OUTBOX_SENT, index)
        if sent is not None and sent.name == index.name:
            with connection.cursor() as cursor:
                cursor.execute(f'ALTER INDEX "{sent.name}" RENAME TO "{name_for(OUTBOX_SENT)}"')

    _gather(connection, OUTBOX_TABLE, index, _any, name_for, prepare=free_the_name)


def unsent_lean(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    failed = one(
        connection,
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)",
        [FAILED_INDEX],
    )
    if not failed:
        # First, so that the failed rows are never without an index.
        build_concurrently(
            connection,
            FAILED_INDEX,
            f'CREATE INDEX CONCURRENTLY "{FAILED_INDEX}" ON "{OUTBOX_UNSENT}" (id) '
            "WHERE status = 'failed'",
        )
    for index in MOVED:
        _to_the_sent_side(connection, index)


def unsent_indexed(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql":
        return
    for index in MOVED:
        _back_to_the_whole_outbox(connection, index)
    with connection.cursor() as cursor:
        cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{FAILED_INDEX}"')


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0014_outbox_lean_indexes"),
    ]

    operations = [
        migrations.RunPython(
            unsent_lean, unsent_indexed, hints={"model_name": "outboxmessage"}, elidable=False
        ),
    ]
