"""The app's tables as they are today (docs/operations.md, "How the tables are laid out").

Everywhere, Django makes the dead letters, their failure groups, the bulk operations and the
crash guard's suspects from the models. The inbox and the outbox it knows from the models too
(their state below), but makes them apart:

- on PostgreSQL, in SQL, as partitioned tables: the inbox by UTC day of ``processed_at``; the
  outbox by status, its unsent rows in one partition and its sent and unrouted ones partitioned
  by UTC day of ``sent_at``. The days from yesterday to ``partitions.AHEAD_DAYS`` ahead are made
  by ``partitions.ensure_partitions``, as the consumer, the relay and the purge make them later.
  The dead letters get the triggers that keep their failure groups, the view that reads them,
  and the trigram indexes of the admin's search;
- elsewhere (SQLite), as Django's plain tables.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import (
    INBOX_CLAIM_FUNCTION,
    INBOX_TABLE,
    OUTBOX_SCHEDULED,
    OUTBOX_SENT,
    OUTBOX_TABLE,
    OUTBOX_UNSENT,
    SENT_SQL,
    UNSENT_SQL,
)

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
    ("expired", "expired before it was handled"),
    ("invalid_payload", "the payload does not match its declared type"),
]

# -- the inbox and the outbox on PostgreSQL ----------------------------------------------------

# No index on the partitioned inbox itself: each day has its own (partitions._inbox_leaf_sql),
# the unique one included, which a partitioned table could only have with processed_at in it.
INBOX = [
    f'CREATE TABLE "{INBOX_TABLE}" ('
    "id bigserial NOT NULL, "
    "consumer varchar(255) NOT NULL, "
    "message_id varchar(255) NOT NULL, "
    "processed_at timestamp with time zone NOT NULL"
    ") PARTITION BY RANGE (processed_at)",
]

# The primary key and the (partial) unique index of idempotency keys are each partition's own
# (partitions.outbox_leaf_sql); the other indexes are partitioned ones, which every partition
# gets a copy of as it is attached: the relay's two on the whole outbox, and on the sent side
# the two that only what reads sent rows uses (the purge, the unrouted count, a sent row by its
# message_id), so that a publish writes into neither. The unsent partition has instead a partial
# index of its failed rows, into which a publish (a pending row) writes nothing.
OUTBOX = [
    f'CREATE TABLE "{OUTBOX_TABLE}" ('
    "id bigserial NOT NULL, "
    "message_id varchar(255) NOT NULL, "
    "exchange varchar(255) NOT NULL, "
    "routing_key varchar(255) NOT NULL, "
    "body text NOT NULL, "
    "headers jsonb NOT NULL, "
    "raw_body bytea NULL, "
    "raw_properties bytea NULL, "
    "ordering_key varchar(255) NULL, "
    "idempotency_key varchar(255) NULL, "
    "status varchar(10) NOT NULL, "
    "attempts integer NOT NULL, "
    "last_error text NOT NULL, "
    "next_attempt_at timestamp with time zone NULL, "
    "created_at timestamp with time zone NOT NULL, "
    "sent_at timestamp with time zone NULL, "
    "deliver_at timestamp with time zone NULL, "
    f'CONSTRAINT "{OUTBOX_TABLE}_attempts_check" CHECK (attempts >= 0)'
    ") PARTITION BY LIST (status)",
    *partitions.outbox_leaf_sql(OUTBOX_UNSENT),
    f'ALTER TABLE "{OUTBOX_TABLE}" ATTACH PARTITION "{OUTBOX_UNSENT}" FOR VALUES IN ({UNSENT_SQL})',
    *partitions.outbox_leaf_sql(OUTBOX_SCHEDULED),
    f'ALTER TABLE "{OUTBOX_TABLE}" ATTACH PARTITION "{OUTBOX_SCHEDULED}" '
    "FOR VALUES IN ('scheduled')",
    f'CREATE TABLE "{OUTBOX_SENT}" PARTITION OF "{OUTBOX_TABLE}" FOR VALUES IN ({SENT_SQL}) '
    "PARTITION BY RANGE (sent_at)",
    f'CREATE INDEX "rm_outbox_due_idx" ON "{OUTBOX_TABLE}" (next_attempt_at, id) '
    "WHERE status = 'pending'",
    f'CREATE INDEX "rm_outbox_key_order_idx" ON "{OUTBOX_TABLE}" (ordering_key, id) '
    "WHERE status IN ('pending', 'failed') AND ordering_key IS NOT NULL",
    f'CREATE INDEX "rm_outbox_status_sent_idx" ON "{OUTBOX_SENT}" (status, sent_at)',
    f'CREATE INDEX "rm_outbox_message_id_idx" ON "{OUTBOX_SENT}" (message_id)',
    f'CREATE INDEX "{OUTBOX_UNSENT}_failed" ON "{OUTBOX_UNSENT}" (id) WHERE status = \'failed\'',
    f'CREATE INDEX "rm_outbox_scheduled_idx" ON "{OUTBOX_SCHEDULED}" (next_attempt_at, id)',
    f'CREATE INDEX "{OUTBOX_SCHEDULED}_message_id" ON "{OUTBOX_SCHEDULED}" (message_id)',
]


def create_inbox(apps: Any, schema_editor: Any) -> None:
    _create(apps, schema_editor, "ProcessedMessage", INBOX, partitions.INBOX)


def create_outbox(apps: Any, schema_editor: Any) -> None:
    _create(apps, schema_editor, "OutboxMessage", OUTBOX, partitions.OUTBOX)


def _create(
    apps: Any,
    schema_editor: Any,
    model_name: str,
    statements: list[str],
    spec: partitions.DayPartitioned,
) -> None:
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.create_model(apps.get_model("reliable_messaging", model_name))
        return
    for statement in statements:
        schema_editor.execute(statement)
    partitions.ensure_partitions(schema_editor.connection.alias, spec=spec)


def drop_inbox(apps: Any, schema_editor: Any) -> None:
    _drop(apps, schema_editor, "ProcessedMessage")


def drop_outbox(apps: Any, schema_editor: Any) -> None:
    _drop(apps, schema_editor, "OutboxMessage")


def _drop(apps: Any, schema_editor: Any, model_name: str) -> None:
    model = apps.get_model("reliable_messaging", model_name)
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.delete_model(model)
        return
    # With its partitions and its sequence.
    schema_editor.execute(f'DROP TABLE "{model._meta.db_table}"')
    partitions.forget_coverage()


def no_task_id_like_index(apps: Any, schema_editor: Any) -> None:
    """Leave out the ``varchar_pattern_ops`` index Django gives a character primary key on
    PostgreSQL, for ``LIKE``: a task's id is only looked up whole, and every enqueue and every
    status change of a task would write an entry in it. Django makes a new table's indexes at
    the end of the migration (its deferred statements): the statement is taken out there."""
    schema_editor.deferred_sql = [
        statement
        for statement in schema_editor.deferred_sql
        if not (
            "varchar_pattern_ops" in str(statement)
            and '"reliable_messaging_taskrun"' in str(statement)
        )
    ]


# -- the dead letters' failure groups and search on PostgreSQL ----------------------------------

DEAD_LETTERS = "reliable_messaging_deadletter"
GROUPS = "reliable_messaging_deadlettergroup"
DELTAS = "reliable_messaging_deadlettergroupdelta"
LIVE = "reliable_messaging_livedeadlettergroup"

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

TRIGGERS = f"""
CREATE FUNCTION rm_deadletter_groups_count() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Kept by reliable_messaging: see DeadLetterGroup.
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
CREATE TRIGGER rm_deadletter_groups_insert AFTER INSERT ON {DEAD_LETTERS}
    REFERENCING NEW TABLE AS rm_new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
CREATE TRIGGER rm_deadletter_groups_update AFTER UPDATE ON {DEAD_LETTERS}
    REFERENCING NEW TABLE AS rm_new_rows OLD TABLE AS rm_old_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
CREATE TRIGGER rm_deadletter_groups_delete AFTER DELETE ON {DEAD_LETTERS}
    REFERENCING OLD TABLE AS rm_old_rows FOR EACH STATEMENT
    EXECUTE FUNCTION rm_deadletter_groups_count();
"""

# What readers read (``LiveDeadLetterGroup``): each group's row plus the deltas not folded in
# yet. The queue and the exception type are the latest non-empty ones (the row's, then the
# deltas' in the order they were written), as a fold would leave them. A filter on the key
# (a fingerprint) reaches both tables' rows below the ``GROUP BY``.
VIEW = f"""
CREATE VIEW {LIVE} AS
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

# The admin's search matches the exception message and the payload's text with
# ``UPPER(...) LIKE UPPER('%words%')``: trigram indexes of exactly the expressions Django writes
# for ``icontains`` (PostgreSQL matches an expression index only on the same expression).
SEARCH = f"""
CREATE EXTENSION IF NOT EXISTS pg_trgm;
CREATE INDEX rm_deadletter_message_trgm ON {DEAD_LETTERS}
    USING gin (UPPER(("exception_message")::text) gin_trgm_ops);
CREATE INDEX rm_deadletter_payload_trgm ON {DEAD_LETTERS}
    USING gin (UPPER(("payload")::text) gin_trgm_ops);
"""

# The extension stays: other code may use it.
DROP_DEAD_LETTER_SQL = f"""
DROP INDEX rm_deadletter_message_trgm;
DROP INDEX rm_deadletter_payload_trgm;
DROP VIEW {LIVE};
DROP TRIGGER rm_deadletter_groups_insert ON {DEAD_LETTERS};
DROP TRIGGER rm_deadletter_groups_update ON {DEAD_LETTERS};
DROP TRIGGER rm_deadletter_groups_delete ON {DEAD_LETTERS};
DROP FUNCTION rm_deadletter_groups_count();
"""


def create_dead_letter_sql(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(TRIGGERS)
        schema_editor.execute(VIEW)
        schema_editor.execute(SEARCH)


def drop_dead_letter_sql(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_DEAD_LETTER_SQL)


# -- the inbox claim on PostgreSQL ------------------------------------------------------------

# The inbox claim (reliable_messaging.storage.inbox): a function, so that PostgreSQL plans its
# statement once per connection instead of once per batch. Its text would otherwise change with
# each batch's keys and be planned anew across every day partition, which cost more than running
# it. A function's plans live in its backend, so a transaction-pooling PgBouncer is no obstacle
# (server-side prepared statements are, before PgBouncer 1.21).
#
# The plan is made once and kept until the tables change (a partition made, dropped or analyzed),
# so it must not depend on how full a partition looked then: hash and merge joins, sequential
# scans, materializing and index-only scans are off, and the consumer is compared with IS NOT
# DISTINCT FROM (equal for these NOT NULL columns), which no index answers. Each key is then
# looked up by message_id in the unique index of each partition, and in the dead letters' index
# of message_id, whatever the statistics said. (With the last two on, a plan made while the partitions
# were empty scanned each partition's unique index whole, materialized it and compared it with
# every key: each claim read the whole inbox, more as it filled, until an ANALYZE or a new
# connection planned it again. Without index-only scans PostgreSQL builds no index path that has
# no condition, so the look-up by message_id is the only one left.)
INBOX_CLAIM = f"""
CREATE FUNCTION {INBOX_CLAIM_FUNCTION}(
    claim_consumers text[], claim_message_ids text[], claim_at timestamptz, open_statuses text[]
) RETURNS TABLE (consumer text, message_id text, open_letter boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET enable_indexonlyscan = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH claimed AS (
        INSERT INTO "{INBOX_TABLE}" (consumer, message_id, processed_at)
        SELECT v.consumer, v.message_id, claim_at
        FROM unnest(claim_consumers, claim_message_ids) AS v (consumer, message_id)
        WHERE NOT EXISTS (
            SELECT 1 FROM "{INBOX_TABLE}" AS p
            WHERE p.message_id = v.message_id AND p.consumer IS NOT DISTINCT FROM v.consumer)
        ON CONFLICT DO NOTHING
        RETURNING consumer, message_id)
    SELECT c.consumer::text, c.message_id::text, coalesce((
        SELECT bool_or(d.status = ANY (open_statuses)) FROM "{DEAD_LETTERS}" AS d
        WHERE d.message_id = c.message_id AND d.consumer IS NOT DISTINCT FROM c.consumer), false)
    FROM claimed AS c;
END
$$
"""


def create_inbox_claim(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(INBOX_CLAIM)


def drop_inbox_claim(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION {INBOX_CLAIM_FUNCTION}")


def id_field() -> tuple[str, models.Field[Any, Any]]:
    return (
        "id",
        models.BigAutoField(
            auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
        ),
    )


def group_fields() -> list[tuple[str, models.Field[Any, Any]]]:
    """The fields of a failure group's row, of its deltas and of the view that adds them up."""
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


class Migration(migrations.Migration):
    initial = True

    dependencies = []  # type: ignore[var-annotated]

    operations = [
        migrations.CreateModel(
            name="DeadLetter",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("message_id", models.CharField(blank=True, max_length=255)),
                ("consumer", models.CharField(max_length=255)),
                ("queue", models.CharField(max_length=255)),
                ("exchange", models.CharField(blank=True, max_length=255)),
                ("routing_key", models.CharField(blank=True, max_length=255)),
                ("ordering_key", models.CharField(blank=True, max_length=255, null=True)),
                ("headers", models.JSONField(blank=True, default=dict)),
                ("payload", models.JSONField(blank=True, null=True)),
                ("body", models.BinaryField()),
                ("content_type", models.CharField(blank=True, max_length=255)),
                ("reason", models.CharField(choices=REASONS, max_length=40)),
                ("exception_type", models.CharField(blank=True, max_length=255)),
                ("exception_message", models.TextField(blank=True)),
                ("traceback", models.TextField(blank=True)),
                ("attempts", models.PositiveIntegerField(default=1)),
                ("first_failed_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("last_failed_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("dead", "dead"),
                            ("replayed", "replayed, awaiting outcome"),
                            ("resolved", "resolved"),
                            ("discarded", "discarded"),
                        ],
                        default="dead",
                        max_length=20,
                    ),
                ),
                ("replay_count", models.PositiveIntegerField(default=0)),
                ("fingerprint", models.CharField(blank=True, max_length=64)),
                ("history", models.JSONField(blank=True, default=list)),
                (
                    "trace_id",
                    models.CharField(blank=True, db_default="", default="", max_length=32),
                ),
                (
                    "span_id",
                    models.CharField(blank=True, db_default="", default="", max_length=16),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={
                "verbose_name": "dead letter",
                "ordering": ["-last_failed_at", "-id"],
                "permissions": [
                    ("replay_deadletter", "Can replay and discard dead letters"),
                    ("triage_deadletter", "Can acknowledge, resolve and reopen failure groups"),
                    (
                        "edit_replay_deadletter",
                        "Can edit and replay the dead letters of every consumer",
                    ),
                ],
                "indexes": [
                    models.Index(
                        fields=["status", "-last_failed_at"], name="rm_deadletter_status_idx"
                    ),
                    models.Index(fields=["consumer", "status"], name="rm_deadletter_consumer_idx"),
                    models.Index(fields=["message_id"], name="rm_deadletter_message_id_idx"),
                    models.Index(fields=["fingerprint", "status"], name="rm_deadletter_fprint_idx"),
                    models.Index(fields=["fingerprint", "id"], name="rm_deadletter_fprint_pk_idx"),
                    models.Index(
                        fields=["-last_failed_at", "-id"], name="rm_deadletter_latest_idx"
                    ),
                    models.Index(
                        fields=["consumer", "-last_failed_at", "-id"],
                        name="rm_deadletter_cons_latest_idx",
                    ),
                    models.Index(
                        condition=models.Q(("status__in", ["resolved", "discarded"])),
                        fields=["updated_at"],
                        name="rm_deadletter_closed_idx",
                    ),
                    models.Index(
                        condition=models.Q(
                            ("status__in", ["dead", "replayed"]), ("ordering_key__isnull", False)
                        ),
                        fields=["consumer", "ordering_key", "id"],
                        name="rm_deadletter_key_idx",
                    ),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("message_id", ""), _negated=True),
                        fields=("consumer", "message_id"),
                        name="rm_deadletter_consumer_msg_uniq",
                    )
                ],
            },
        ),
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
        # A view (created below, on PostgreSQL), not a table.
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
        migrations.CreateModel(
            name="DeadLetterOperation",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[("replay", "replay"), ("discard", "discard")], max_length=10
                    ),
                ),
                ("force", models.BooleanField(default=False)),
                ("selection", models.JSONField(default=dict)),
                ("matched", models.PositiveIntegerField(default=0)),
                ("max_pk", models.BigIntegerField(default=0)),
                ("cursor", models.BigIntegerField(default=0)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "pending"),
                            ("running", "running"),
                            ("done", "done"),
                            ("cancelled", "cancelled"),
                            ("failed", "failed"),
                        ],
                        default="pending",
                        max_length=10,
                    ),
                ),
                ("done", models.PositiveIntegerField(default=0)),
                ("replayed", models.PositiveIntegerField(default=0)),
                ("discarded", models.PositiveIntegerField(default=0)),
                ("refused", models.PositiveIntegerField(default=0)),
                ("skipped", models.PositiveIntegerField(default=0)),
                ("requested_by", models.CharField(max_length=255)),
                ("cancelled_by", models.CharField(blank=True, max_length=255)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("heartbeat_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("error", models.TextField(blank=True)),
            ],
            options={
                "verbose_name": "dead letter operation",
                "ordering": ["-id"],
                "indexes": [
                    models.Index(
                        condition=models.Q(("state__in", ["pending", "running"])),
                        fields=["id"],
                        name="rm_dlop_unfinished_idx",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="SuspectDelivery",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("consumer", models.CharField(max_length=255)),
                ("message_id", models.CharField(max_length=255)),
                ("deaths", models.PositiveIntegerField(default=0)),
                ("running", models.BooleanField(default=False)),
                ("last_cause", models.CharField(blank=True, max_length=20)),
                ("last_process", models.CharField(blank=True, max_length=255)),
                ("first_seen_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                "verbose_name": "suspect delivery",
                "indexes": [models.Index(fields=["updated_at"], name="rm_suspect_updated_at_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("consumer", "message_id"), name="rm_suspect_consumer_message_uniq"
                    )
                ],
            },
        ),
        # The inbox and the outbox: Django knows them from these, and the operations below make
        # their tables (on PostgreSQL, partitioned ones).
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ProcessedMessage",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("consumer", models.CharField(max_length=255)),
                        ("message_id", models.CharField(max_length=255)),
                        ("processed_at", models.DateTimeField(default=django.utils.timezone.now)),
                    ],
                    options={
                        "verbose_name": "processed message",
                        "indexes": [
                            models.Index(fields=["processed_at"], name="rm_inbox_processed_at_idx"),
                            models.Index(fields=["consumer"], name="rm_inbox_consumer_idx"),
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("message_id", "consumer"),
                                name="rm_inbox_message_consumer_uniq",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="OutboxMessage",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("message_id", models.CharField(max_length=255)),
                        ("exchange", models.CharField(blank=True, max_length=255)),
                        ("routing_key", models.CharField(max_length=255)),
                        ("body", models.TextField()),
                        ("headers", models.JSONField(blank=True, default=dict)),
                        ("raw_body", models.BinaryField(blank=True, null=True)),
                        ("raw_properties", models.BinaryField(blank=True, null=True)),
                        ("ordering_key", models.CharField(blank=True, max_length=255, null=True)),
                        (
                            "idempotency_key",
                            models.CharField(blank=True, max_length=255, null=True),
                        ),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("scheduled", "scheduled"),
                                    ("pending", "pending"),
                                    ("sent", "sent"),
                                    ("failed", "failed"),
                                    ("unrouted", "unrouted"),
                                ],
                                default="pending",
                                max_length=10,
                            ),
                        ),
                        ("attempts", models.PositiveIntegerField(default=0)),
                        ("last_error", models.TextField(blank=True)),
                        (
                            "next_attempt_at",
                            models.DateTimeField(
                                blank=True, default=django.utils.timezone.now, null=True
                            ),
                        ),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("sent_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "deliver_at",
                            models.DateTimeField(blank=True, null=True, verbose_name="due at"),
                        ),
                    ],
                    options={
                        "verbose_name": "outbox message",
                        "indexes": [
                            models.Index(
                                condition=models.Q(("status", "pending")),
                                fields=["next_attempt_at", "id"],
                                name="rm_outbox_due_idx",
                            ),
                            models.Index(
                                condition=models.Q(
                                    ("status__in", ["pending", "failed"]),
                                    ("ordering_key__isnull", False),
                                ),
                                fields=["ordering_key", "id"],
                                name="rm_outbox_key_order_idx",
                            ),
                            models.Index(
                                fields=["status", "sent_at"], name="rm_outbox_status_sent_idx"
                            ),
                            models.Index(fields=["message_id"], name="rm_outbox_message_id_idx"),
                            models.Index(
                                condition=models.Q(("status", "scheduled")),
                                fields=["next_attempt_at", "id"],
                                name="rm_outbox_scheduled_idx",
                            ),
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                condition=models.Q(("idempotency_key__isnull", False)),
                                fields=("idempotency_key",),
                                name="rm_outbox_idem_uniq",
                            )
                        ],
                    },
                ),
            ]
        ),
        migrations.RunPython(
            create_inbox, drop_inbox, hints={"model_name": "processedmessage"}, elidable=False
        ),
        migrations.RunPython(
            create_outbox, drop_outbox, hints={"model_name": "outboxmessage"}, elidable=False
        ),
        migrations.RunPython(
            create_dead_letter_sql,
            drop_dead_letter_sql,
            hints={"model_name": "deadletter"},
            elidable=False,
        ),
        migrations.RunPython(
            create_inbox_claim,
            drop_inbox_claim,
            hints={"model_name": "processedmessage"},
            elidable=False,
        ),
        migrations.CreateModel(
            name="FailureGroupState",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("consumer", models.CharField(max_length=255)),
                ("fingerprint", models.CharField(blank=True, max_length=64)),
                (
                    "reason",
                    models.CharField(
                        choices=REASONS,
                        max_length=40,
                    ),
                ),
                (
                    "state",
                    models.CharField(
                        choices=[("acknowledged", "acknowledged"), ("resolved", "resolved")],
                        max_length=15,
                    ),
                ),
                ("changed_by", models.CharField(max_length=255)),
                ("changed_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("note", models.TextField(blank=True)),
            ],
            options={
                "verbose_name": "failure group state",
            },
        ),
        migrations.CreateModel(
            name="Replay",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("consumer", models.CharField(max_length=255)),
                ("message_id", models.CharField(max_length=255)),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("replay", "replay"),
                            ("forced", "forced replay"),
                            ("edited", "edited replay"),
                        ],
                        default="replay",
                        max_length=10,
                    ),
                ),
                ("replayed_by", models.CharField(max_length=255)),
                ("replayed_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("in_flight", "in flight"),
                            ("processed", "processed"),
                            ("duplicate", "duplicate (skipped)"),
                            ("failed_again", "failed again"),
                        ],
                        default="in_flight",
                        max_length=15,
                    ),
                ),
                ("outcome_at", models.DateTimeField(blank=True, null=True)),
                ("reason", models.TextField(blank=True)),
                ("edit", models.JSONField(blank=True, default=dict)),
            ],
            options={
                "verbose_name": "replay",
                "ordering": ["-id"],
            },
        ),
        migrations.AddField(
            model_name="deadletter",
            name="replay_of",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="edited_copies",
                to="reliable_messaging.deadletter",
            ),
        ),
        migrations.AddIndex(
            model_name="deadletter",
            index=models.Index(
                condition=models.Q(("replay_of__isnull", False)),
                fields=["replay_of"],
                name="rm_deadletter_replay_of_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="failuregroupstate",
            constraint=models.UniqueConstraint(
                fields=("consumer", "fingerprint", "reason"), name="rm_groupstate_key_uniq"
            ),
        ),
        migrations.AddField(
            model_name="replay",
            name="dead_letter",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="replays",
                to="reliable_messaging.deadletter",
            ),
        ),
        migrations.AddField(
            model_name="replay",
            name="failed_as",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="reliable_messaging.deadletter",
            ),
        ),
        migrations.AddField(
            model_name="replay",
            name="operation",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="replays",
                to="reliable_messaging.deadletteroperation",
            ),
        ),
        migrations.AddIndex(
            model_name="replay",
            index=models.Index(
                fields=["operation", "outcome", "id"], name="rm_replay_op_outcome_idx"
            ),
        ),
        migrations.CreateModel(
            name="ReplayOutcomeTally",
            fields=[
                (
                    "operation",
                    models.OneToOneField(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="replay_outcomes",
                        serialize=False,
                        to="reliable_messaging.deadletteroperation",
                    ),
                ),
                ("processed", models.PositiveIntegerField(default=0)),
                ("duplicate", models.PositiveIntegerField(default=0)),
                ("failed_again", models.PositiveIntegerField(default=0)),
            ],
            options={
                "verbose_name": "replay outcome tally",
            },
        ),
        migrations.CreateModel(
            name="TaskRun",
            fields=[
                ("id", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("backend", models.CharField(max_length=100)),
                ("task_path", models.CharField(max_length=255)),
                ("queue_name", models.CharField(max_length=255)),
                ("priority", models.IntegerField(default=0)),
                ("args", models.JSONField(blank=True, default=list)),
                ("kwargs", models.JSONField(blank=True, default=dict)),
                ("run_after", models.DateTimeField(blank=True, null=True)),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("READY", "ready"),
                            ("RUNNING", "running"),
                            ("FAILED", "failed"),
                            ("SUCCESSFUL", "successful"),
                        ],
                        default="READY",
                        max_length=10,
                    ),
                ),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("return_value", models.JSONField(blank=True, null=True)),
                ("errors", models.JSONField(blank=True, default=list)),
                ("worker_ids", models.JSONField(blank=True, default=list)),
                ("enqueued_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("last_attempted_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "verbose_name": "task run",
                "indexes": [
                    models.Index(fields=["status", "-enqueued_at"], name="rm_taskrun_status_idx"),
                    models.Index(fields=["-enqueued_at"], name="rm_taskrun_enqueued_idx"),
                ],
            },
        ),
        migrations.RunPython(
            no_task_id_like_index,
            migrations.RunPython.noop,
            hints={"model_name": "taskrun"},
            elidable=False,
        ),
    ]
