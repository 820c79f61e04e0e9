"""The dead letters' failure groups get a table of their own, and the admin's list its indexes.

- ``DeadLetterGroup``: one row per (consumer, fingerprint, reason) with counts per status. On
  PostgreSQL three statement-level triggers on the dead letters keep it (see the model's
  docstring); the table is filled from the existing dead letters in the same transaction that
  creates the triggers. ``CREATE TRIGGER`` takes a lock that lets reads go on but makes writes
  of dead letters wait until that transaction commits, so no dead letter is counted twice or
  missed; the wait is the time of one ``GROUP BY`` over the dead letters (seconds for a
  million). Elsewhere (SQLite) the table stays empty and the pages count the dead letters.
- B-tree indexes for the list's order (unfiltered, and by consumer) and for the purge of
  resolved and discarded dead letters, built CONCURRENTLY on PostgreSQL (the migration is not
  atomic).
- On PostgreSQL only: the ``pg_trgm`` extension and trigram GIN indexes on the exception
  message and the payload's text, as the admin's search matches them
  (``UPPER(...) LIKE UPPER('%words%')``), also built CONCURRENTLY.

Reversible: backwards drops the triggers, their function, the trigram indexes and the table
(the extension stays: other code may use it).
"""

from typing import Any

from django.db import migrations, models, transaction

from reliable_messaging.migration_ops import AddIndexOnline

TABLE = "reliable_messaging_deadletter"
GROUPS = "reliable_messaging_deadlettergroup"
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

# The deltas of a statement's rows per group, applied in key order. ``rows`` is a query of
# (consumer, fingerprint, reason, queue, exception_type, id, first_failed_at, last_failed_at,
# status, sign): +1 for a row as it is now, -1 for a row as it was.
UPSERT = f"""
    INSERT INTO {GROUPS} AS g (
        consumer, fingerprint, reason, queue, exception_type, example_id, first_seen,
        last_seen, dead, replayed, resolved, discarded, total
    )
    SELECT consumer, fingerprint, reason,
           coalesce(max(queue) FILTER (WHERE sign > 0), ''),
           coalesce(max(exception_type) FILTER (WHERE sign > 0), ''),
           max(id) FILTER (WHERE sign > 0),
           min(first_failed_at) FILTER (WHERE sign > 0),
           max(last_failed_at) FILTER (WHERE sign > 0),
           coalesce(sum(sign) FILTER (WHERE status = 'dead'), 0),
           coalesce(sum(sign) FILTER (WHERE status = 'replayed'), 0),
           coalesce(sum(sign) FILTER (WHERE status = 'resolved'), 0),
           coalesce(sum(sign) FILTER (WHERE status = 'discarded'), 0),
           sum(sign)
    FROM (%s) AS delta
    GROUP BY consumer, fingerprint, reason
    ORDER BY consumer, fingerprint, reason
    ON CONFLICT (consumer, fingerprint, reason) DO UPDATE SET
        queue = coalesce(nullif(excluded.queue, ''), g.queue),
        exception_type = coalesce(nullif(excluded.exception_type, ''), g.exception_type),
        example_id = greatest(g.example_id, excluded.example_id),
        first_seen = least(g.first_seen, excluded.first_seen),
        last_seen = greatest(g.last_seen, excluded.last_seen),
        dead = g.dead + excluded.dead,
        replayed = g.replayed + excluded.replayed,
        resolved = g.resolved + excluded.resolved,
        discarded = g.discarded + excluded.discarded,
        total = g.total + excluded.total
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
        {UPSERT % NEW};
    ELSIF TG_OP = 'DELETE' THEN
        {UPSERT % OLD};
    ELSE
        {UPSERT % (NEW + " UNION ALL " + OLD)};
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
BACKFILL = f"DELETE FROM {GROUPS}; " + UPSERT % f"SELECT {COLUMNS}, 1 AS sign FROM {TABLE}"

DROP_FUNCTION = f"""
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


def create_triggers(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    # One transaction: the triggers count every write from their creation on, the backfill
    # every row written before it, and the triggers' lock keeps the two from overlapping.
    with transaction.atomic(using=schema_editor.connection.alias):
        schema_editor.execute(FUNCTION)
        schema_editor.execute(BACKFILL)


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
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
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
            ],
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
            index=models.Index(
                condition=models.Q(("status__in", ["resolved", "discarded"])),
                fields=["updated_at"],
                name="rm_deadletter_closed_idx",
            ),
        ),
        migrations.RunPython(create_trigram_indexes, drop_trigram_indexes, elidable=False),
    ]
