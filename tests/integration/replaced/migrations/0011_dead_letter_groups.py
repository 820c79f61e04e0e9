"""The dead letters' failure groups get a table of their own, and the admin's list its indexes.

- ``DeadLetterGroup``: one row per (consumer, fingerprint, reason) with counts per status. On
  PostgreSQL three statement-level triggers on the dead letters append each statement's
  changes per group to ``DeadLetterGroupDelta``, a fold moves them into the groups, and the
  view ``LiveDeadLetterGroup`` adds up both for the readers (see the model's docstring); the
  table is filled from the existing dead letters in the same transaction that creates the
  triggers. ``CREATE TRIGGER`` takes a lock that lets reads go on but makes writes
  of dead letters wait until that transaction commits, so no dead letter is counted twice or
  missed; the wait is the time of one ``GROUP BY`` over the dead letters (seconds for a
  million). Elsewhere (SQLite) the tables stay empty, there is no view, and the pages count
  the dead letters.
- B-tree indexes for the list's order (unfiltered, and by consumer), for a bulk operation's walk
  through a failure group by id (``dead_letters/operations.py``) and for the purge of
  resolved and discarded dead letters, built CONCURRENTLY on PostgreSQL (the migration is not
  atomic).
- On PostgreSQL only: the ``pg_trgm`` extension and trigram GIN indexes on the exception
  message and the payload's text, as the admin's search matches them
  (``UPPER(...) LIKE UPPER('%words%')``), also built CONCURRENTLY.

Reversible: backwards drops the view, the triggers, their function, the trigram indexes and
the tables (the extension stays: other code may use it).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models, transaction

from reliable_messaging.migration_ops import AddIndexOnline

TABLE = "reliable_messaging_deadletter"
GROUPS = "reliable_messaging_deadlettergroup"
DELTAS = "reliable_messaging_deadlettergroupdelta"
LIVE = "reliable_messaging_livedeadlettergroup"
REASONS = [
    ("permanent", "permanent error"),
    ("retries_exhausted", "retries exhausted"),
    ("invalid_json", "invalid JSON"),
    ("invalid_utf8", "invalid UTF-8"),
    ("empty_body", "empty body"),
    ("missing_message_id", "missing message_id"),
    ("body_too_large", "body too large"),
    ("unsupported_content_type", "unsupported content type"),
    ("invalid_headers", "invalid headers"),
    ("no_handler", "no handler for the queue"),
    ("unexpected_routing_key", "routing key matches no binding"),
    ("parked", "parked behind an earlier dead letter of its key"),
    ("worker_crashed", "the worker process died while handling it"),
    ("timeout", "the handler ran past its time limit"),
    ("consumer_error", "the consumer failed on it"),
    ("delivery_limit", "the broker's delivery limit was reached"),
]

# A statement's rows added up per group. ``rows`` is a query of (consumer, fingerprint,
# reason, queue, exception_type, id, first_failed_at, last_failed_at, status, sign): +1 for a
# row as it is now, -1 for a row as it was. ``news``: the rows as they are now carry a queue,
# exception type, id or failure time that the rows as they were did not (a repeated failure
# moves ``last_seen`` without changing a count).
SUMS = """
    SELECT consumer, fingerprint, reason,
           coalesce(max(queue) FILTER (WHERE sign > 0), '') AS queue,
           coalesce(max(exception_type) FILTER (WHERE sign > 0), '') AS exception_type,
           max(id) FILTER (WHERE sign > 0) AS example_id,
           min(first_failed_at) FILTER (WHERE sign > 0) AS first_seen,
           max(last_failed_at) FILTER (WHERE sign > 0) AS last_seen,
           coalesce(sum(sign) FILTER (WHERE status = 'dead'), 0) AS dead,
           coalesce(sum(sign) FILTER (WHERE status = 'replayed'), 0) AS replayed,
           coalesce(sum(sign) FILTER (WHERE status = 'resolved'), 0) AS resolved,
           coalesce(sum(sign) FILTER (WHERE status = 'discarded'), 0) AS discarded,
           sum(sign) AS total,
           ROW(max(queue) FILTER (WHERE sign > 0),
               max(exception_type) FILTER (WHERE sign > 0),
               max(id) FILTER (WHERE sign > 0),
               min(first_failed_at) FILTER (WHERE sign > 0),
               max(last_failed_at) FILTER (WHERE sign > 0))
           IS DISTINCT FROM
           ROW(max(queue) FILTER (WHERE sign < 0),
               max(exception_type) FILTER (WHERE sign < 0),
               max(id) FILTER (WHERE sign < 0),
               min(first_failed_at) FILTER (WHERE sign < 0),
               max(last_failed_at) FILTER (WHERE sign < 0)) AS news
    FROM (%s) AS delta
    GROUP BY consumer, fingerprint, reason
"""
GROUP_COLUMNS = (
    "consumer, fingerprint, reason, queue, exception_type, example_id, first_seen, last_seen, "
    "dead, replayed, resolved, discarded, total"
)
# What a trigger does with its statement's sums: one delta row per group it changed, appended
# (no unique index, no upsert: nothing another writer of dead letters could wait for). A
# statement that changed nothing a group shows (an UPDATE of the history alone) adds none.
APPEND = f"""
    INSERT INTO {DELTAS} ({GROUP_COLUMNS})
    SELECT {GROUP_COLUMNS} FROM ({SUMS}) AS sums
    WHERE total <> 0 OR dead <> 0 OR replayed <> 0 OR resolved <> 0 OR discarded <> 0 OR news
"""
COLUMNS = "consumer, fingerprint, reason, queue, exception_type, id, first_failed_at, "
COLUMNS += "last_failed_at, status"
NEW = f"SELECT {COLUMNS}, 1 AS sign FROM rm_new_rows"
OLD = f"SELECT {COLUMNS}, -1 AS sign FROM rm_old_rows"

FUNCTION = f"""
CREATE OR REPLACE FUNCTION rm_deadletter_groups_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Kept by reliable_messaging (migration 0011): see DeadLetterGroup.
    IF TG_OP = 'INSERT' THEN
        {APPEND % NEW};
    ELSIF TG_OP = 'DELETE' THEN
        {APPEND % OLD};
    ELSE
        {APPEND % (NEW + " UNION ALL " + OLD)};
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER rm_deadletter_groups_insert AFTER INSERT ON {TABLE}
    REFERENCING NEW TABLE AS rm_new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
CREATE TRIGGER rm_deadletter_groups_update AFTER UPDATE ON {TABLE}
    REFERENCING NEW TABLE AS rm_new_rows OLD TABLE AS rm_old_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
CREATE TRIGGER rm_deadletter_groups_delete AFTER DELETE ON {TABLE}
    REFERENCING OLD TABLE AS rm_old_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
"""
# Every dead letter written so far, straight into the groups (the deltas start empty).
BACKFILL = f"""
DELETE FROM {DELTAS};
DELETE FROM {GROUPS};
INSERT INTO {GROUPS} ({GROUP_COLUMNS})
SELECT {GROUP_COLUMNS} FROM ({SUMS % f"SELECT {COLUMNS}, 1 AS sign FROM {TABLE}"}) AS sums
ORDER BY consumer, fingerprint, reason;
"""

# What readers read (``LiveDeadLetterGroup``): each group's row plus the deltas not folded in
# yet. The queue and the exception type are the latest non-empty ones (the row's, then the
# deltas' in the order they were written), as a fold would leave them. A filter on the key
# (a fingerprint) reaches both tables' rows below the ``GROUP BY``.
VIEW = f"""
CREATE OR REPLACE VIEW {LIVE} AS
SELECT consumer, fingerprint, reason,
       coalesce((array_agg(queue ORDER BY written DESC) FILTER (WHERE queue <> ''))[1], '')
           AS queue,
       coalesce((array_agg(exception_type ORDER BY written DESC)
                 FILTER (WHERE exception_type <> ''))[1], '') AS exception_type,
       max(example_id) AS example_id,
       min(first_seen) AS first_seen,
       max(last_seen) AS last_seen,
       sum(dead)::integer AS dead,
       sum(replayed)::integer AS replayed,
       sum(resolved)::integer AS resolved,
       sum(discarded)::integer AS discarded,
       sum(total)::integer AS total
FROM (
    SELECT 0::bigint AS written, {GROUP_COLUMNS} FROM {GROUPS}
    UNION ALL
    SELECT id, {GROUP_COLUMNS} FROM {DELTAS}
) AS counted
GROUP BY consumer, fingerprint, reason;
"""

DROP_FUNCTION = f"""
DROP VIEW IF EXISTS {LIVE};
DROP TRIGGER IF EXISTS rm_deadletter_groups_insert ON {TABLE};
DROP TRIGGER IF EXISTS rm_deadletter_groups_update ON {TABLE};
DROP TRIGGER IF EXISTS rm_deadletter_groups_delete ON {TABLE};
DROP FUNCTION IF EXISTS rm_deadletter_groups_count();
"""

# The search's expressions exactly as Django writes them for ``icontains`` (PostgreSQL
# matches an expression index only on the same expression).
TRIGRAM_INDEXES = {
    "rm_deadletter_message_trgm": 'UPPER(("exception_message")::text)',
    "rm_deadletter_payload_trgm": 'UPPER(("payload")::text)',
}


def id_field() -> tuple[str, models.Field[Any, Any]]:
    return (
        "id",
        models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID"),
    )


def group_fields() -> list[tuple[str, models.Field[Any, Any]]]:
    """The fields of a group's row, of its deltas and of the view that adds them up."""
    return [
        ("consumer", models.CharField(max_length=255)),
        ("fingerprint", models.CharField(blank=True, max_length=64)),
        ("reason", models.CharField(choices=REASONS, max_length=40)),
        ("queue", models.CharField(blank=True, max_length=255)),
        ("exception_type", models.CharField(blank=True, max_length=255)),
        ("example_id", models.BigIntegerField(blank=True, null=True)),
        ("first_seen", models.DateTimeField(blank=True, null=True)),
        ("last_seen", models.DateTimeField(blank=True, null=True)),
        ("dead", models.IntegerField(default=0)),
        ("replayed", models.IntegerField(default=0)),
        ("resolved", models.IntegerField(default=0)),
        ("discarded", models.IntegerField(default=0)),
        ("total", models.IntegerField(default=0)),
    ]


def create_triggers(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    # One transaction: the triggers count every write from their creation on, the backfill
    # every row written before it, and the triggers' lock keeps the two from overlapping.
    with transaction.atomic(using=schema_editor.connection.alias):
        schema_editor.execute(FUNCTION)
        schema_editor.execute(BACKFILL)
        schema_editor.execute(VIEW)


def drop_triggers(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_FUNCTION)


def create_trigram_indexes(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    for name, expression in TRIGRAM_INDEXES.items():
        # An earlier build that was interrupted leaves an INVALID index of this name.
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        schema_editor.execute(
            f"CREATE INDEX CONCURRENTLY {name} ON {TABLE} USING gin ({expression} gin_trgm_ops)"
        )


def drop_trigram_indexes(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for name in TRIGRAM_INDEXES:
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("reliable_messaging", "0010_outbox_partitions"),
    ]

    operations = [
        migrations.CreateModel(
            name="DeadLetterGroup",
            fields=[id_field(), *group_fields()],
            options={
                "verbose_name": "dead-letter group",
                "indexes": [models.Index(fields=["fingerprint"], name="rm_dlgroup_fprint_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("consumer", "fingerprint", "reason"), name="rm_dlgroup_key_uniq"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="DeadLetterGroupDelta",
            fields=[id_field(), *group_fields()],
            options={"verbose_name": "dead-letter group delta"},
        ),
        # A view (created with the triggers below), not a table.
        migrations.CreateModel(
            name="LiveDeadLetterGroup",
            fields=[
                *group_fields(),
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "consumer",
                        "fingerprint",
                        "reason",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
            ],
            options={
                "verbose_name": "dead-letter group as of now",
                "db_table": LIVE,
                "managed": False,
            },
        ),
        migrations.RunPython(create_triggers, drop_triggers, elidable=False),
        AddIndexOnline(
            model_name="deadletter",
            index=models.Index(fields=["-last_failed_at", "-id"], name="rm_deadletter_latest_idx"),
        ),
        AddIndexOnline(
            model_name="deadletter",
            index=models.Index(
                fields=["consumer", "-last_failed_at", "-id"], name="rm_deadletter_cons_latest_idx"
            ),
        ),
        AddIndexOnline(
            model_name="deadletter",
            index=models.Index(fields=["fingerprint", "id"], name="rm_deadletter_fprint_pk_idx"),
        ),
        AddIndexOnline(
            model_name="deadletter",
            index=models.Index(
                condition=models.Q(("status__in", ["resolved", "discarded"])),
                fields=["updated_at"],
                name="rm_deadletter_closed_idx",
            ),
        ),
        migrations.RunPython(create_trigram_indexes, drop_trigram_indexes, elidable=False),
    ]
