"""The app's tables: fields, constraints and indexes only (queries live in ``managers.py``)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from . import managers
from .choices import (
    STORED_GROUP_STATES,
    DeadLetterReason,
    DeadLetterStatus,
    OperationKind,
    OperationState,
    OutboxStatus,
    ReplayKind,
    ReplayOutcome,
    TaskRunStatus,
)


class ProcessedMessage(models.Model):
    """The inbox: one row per (consumer, message_id) whose handler committed, in its transaction."""

    consumer = models.CharField(max_length=255)
    message_id = models.CharField(max_length=255)
    processed_at = models.DateTimeField(default=timezone.now)

    objects = managers.ProcessedMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("processed message")
        constraints = [
            models.UniqueConstraint(
                fields=["message_id", "consumer"], name="rm_inbox_message_consumer_uniq"
            )
        ]
        indexes = [
            models.Index(fields=["processed_at"], name="rm_inbox_processed_at_idx"),
            models.Index(fields=["consumer"], name="rm_inbox_consumer_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.message_id} by {self.consumer}"


class DeadLetter(models.Model):
    """A message a consumer gave up on, ``body`` the delivery's exact bytes."""

    message_id = models.CharField(max_length=255, blank=True)
    consumer = models.CharField(max_length=255)
    queue = models.CharField(max_length=255)
    exchange = models.CharField(max_length=255, blank=True)
    routing_key = models.CharField(max_length=255, blank=True)
    # Ordered consumers hold back later messages of a key while it has an unresolved dead letter.
    ordering_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    headers = models.JSONField(default=dict, blank=True)
    payload = models.JSONField(null=True, blank=True)
    body = models.BinaryField()
    content_type = models.CharField(max_length=255, blank=True)
    reason = models.CharField(max_length=40, choices=DeadLetterReason.choices)
    exception_type = models.CharField(max_length=255, blank=True)
    exception_message = models.TextField(blank=True)
    traceback = models.TextField(blank=True)
    attempts = models.PositiveIntegerField(default=1)
    first_failed_at = models.DateTimeField(default=timezone.now)
    last_failed_at = models.DateTimeField(default=timezone.now)
    status = models.CharField(
        max_length=20, choices=DeadLetterStatus.choices, default=DeadLetterStatus.DEAD
    )
    replay_count = models.PositiveIntegerField(default=0)
    fingerprint = models.CharField(max_length=64, blank=True)  # see core/fingerprints.py
    history = models.JSONField(default=list, blank=True)  # append-only: failures, replays, ...
    # The trace of its last failure (W3C ids, hex); db_default for rows written with SQL.
    trace_id = models.CharField(max_length=32, blank=True, default="", db_default="")
    span_id = models.CharField(max_length=16, blank=True, default="", db_default="")
    # An edited replay's copy that failed in turn: the dead letter it was edited from.
    replay_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="edited_copies",
        db_index=False,  # rm_deadletter_replay_of_idx, partial
        db_constraint=False,  # see Replay
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = managers.DeadLetterQuerySet.as_manager()

    class Meta:
        verbose_name = _("dead letter")
        ordering = ["-last_failed_at", "-id"]
        permissions = [
            ("replay_deadletter", "Can replay and discard dead letters"),
            ("triage_deadletter", "Can acknowledge, resolve and reopen failure groups"),
            ("edit_replay_deadletter", "Can edit and replay the dead letters of every consumer"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"],
                condition=~Q(message_id=""),
                name="rm_deadletter_consumer_msg_uniq",
            )
        ]
        indexes = [
            models.Index(fields=["status", "-last_failed_at"], name="rm_deadletter_status_idx"),
            models.Index(fields=["consumer", "status"], name="rm_deadletter_consumer_idx"),
            models.Index(fields=["message_id"], name="rm_deadletter_message_id_idx"),
            models.Index(fields=["fingerprint", "status"], name="rm_deadletter_fprint_idx"),
            # A bulk operation over a failure group walks it by id from its cursor.
            models.Index(fields=["fingerprint", "id"], name="rm_deadletter_fprint_pk_idx"),
            # The list's order, unfiltered and filtered by consumer (no sort of the table).
            models.Index(fields=["-last_failed_at", "-id"], name="rm_deadletter_latest_idx"),
            models.Index(
                fields=["consumer", "-last_failed_at", "-id"], name="rm_deadletter_cons_latest_idx"
            ),
            models.Index(
                fields=["updated_at"],
                condition=Q(status__in=["resolved", "discarded"]),
                name="rm_deadletter_closed_idx",
            ),
            models.Index(
                fields=["consumer", "ordering_key", "id"],
                condition=Q(status__in=["dead", "replayed"]) & Q(ordering_key__isnull=False),
                name="rm_deadletter_key_idx",
            ),
            models.Index(
                fields=["replay_of"],
                condition=Q(replay_of__isnull=False),
                name="rm_deadletter_replay_of_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.message_id or '(no id)'} in {self.consumer}: {self.reason}"


class _GroupCounts(models.Model):
    """The key and the figures of a failure group: of its row, its deltas and the live view."""

    consumer = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, blank=True)
    reason = models.CharField(max_length=40, choices=DeadLetterReason.choices)
    # The queue and exception type of the latest dead letter counted in, and its id.
    queue = models.CharField(max_length=255, blank=True)
    exception_type = models.CharField(max_length=255, blank=True)
    example_id = models.BigIntegerField(null=True, blank=True)
    first_seen = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    dead = models.IntegerField(default=0)
    replayed = models.IntegerField(default=0)
    resolved = models.IntegerField(default=0)
    discarded = models.IntegerField(default=0)
    total = models.IntegerField(default=0)

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.dead} dead"


class DeadLetterGroup(_GroupCounts):
    """The dead letters of one consumer that fail the same way, counted per status: kept by
    triggers on PostgreSQL (``docs/concepts.md#failure-groups``), else empty."""

    objects = managers.DeadLetterGroupQuerySet.as_manager()

    class Meta:
        verbose_name = _("dead-letter group")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "fingerprint", "reason"], name="rm_dlgroup_key_uniq"
            )
        ]
        indexes = [models.Index(fields=["fingerprint"], name="rm_dlgroup_fprint_idx")]


class DeadLetterGroupDelta(_GroupCounts):
    """What one statement on the dead letters changed in one failure group, until folded."""

    class Meta:
        verbose_name = _("dead-letter group delta")

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.total:+d} dead letters"


class LiveDeadLetterGroup(_GroupCounts):
    """Each failure group as of now (its row plus its deltas): a PostgreSQL view."""

    pk = models.CompositePrimaryKey("consumer", "fingerprint", "reason")

    class Meta:
        managed = False
        db_table = "reliable_messaging_livedeadlettergroup"
        verbose_name = _("dead-letter group as of now")


class SuspectDelivery(models.Model):
    """A redelivered delivery the crash guard watches: committed before the handler runs, so a
    row still ``running`` when the message comes back means the process died on it."""

    consumer = models.CharField(max_length=255)
    message_id = models.CharField(max_length=255)
    deaths = models.PositiveIntegerField(default=0)
    running = models.BooleanField(default=False)
    last_cause = models.CharField(max_length=20, blank=True)  # "crashed" or "timeout"
    last_process = models.CharField(max_length=255, blank=True)  # host:pid that handled it last
    first_seen_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = managers.SuspectDeliveryQuerySet.as_manager()

    class Meta:
        verbose_name = _("suspect delivery")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"], name="rm_suspect_consumer_message_uniq"
            )
        ]
        indexes = [models.Index(fields=["updated_at"], name="rm_suspect_updated_at_idx")]

    def __str__(self) -> str:
        return f"{self.message_id} by {self.consumer}: {self.deaths} death(s)"


class OutboxMessage(models.Model):
    """A message ``publish()`` wrote, ``body`` its exact JSON text; a retry copy carries the
    original's exact bytes and pika-encoded properties instead (``raw_*``)."""

    message_id = models.CharField(max_length=255)
    exchange = models.CharField(max_length=255, blank=True)
    routing_key = models.CharField(max_length=255)
    body = models.TextField()
    headers = models.JSONField(default=dict, blank=True)
    # A retry copy's (docs/design.md#where-a-retry-waits); NULL for what publish() wrote.
    raw_body = models.BinaryField(null=True, blank=True)
    raw_properties = models.BinaryField(null=True, blank=True)
    # NULL, not "", means "no key": "" is a legitimate key, and the order index skips NULLs.
    ordering_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    status = models.CharField(
        max_length=10, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    # When the relay may take the row next (database clock), or its lease; NULL: parked.
    next_attempt_at = models.DateTimeField(default=timezone.now, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    deliver_at = models.DateTimeField(_("due at"), null=True, blank=True)

    objects = managers.OutboxMessageQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox message")
        indexes = [
            # The relay's claim: the due pending rows and nothing else.
            models.Index(
                fields=["next_attempt_at", "id"],
                condition=Q(status="pending"),
                name="rm_outbox_due_idx",
            ),
            # "Is an earlier message of this key still unsent?" for per-key order.
            models.Index(
                fields=["ordering_key", "id"],
                condition=Q(status__in=["pending", "failed"]) & Q(ordering_key__isnull=False),
                name="rm_outbox_key_order_idx",
            ),
            # On PostgreSQL, of the sent side only (docs/operations.md, "The outbox's indexes").
            models.Index(fields=["status", "sent_at"], name="rm_outbox_status_sent_idx"),
            models.Index(fields=["message_id"], name="rm_outbox_message_id_idx"),
            # Scheduled rows by due time; on PostgreSQL, of the scheduled partition only.
            models.Index(
                fields=["next_attempt_at", "id"],
                condition=Q(status="scheduled"),
                name="rm_outbox_scheduled_idx",
            ),
        ]
        constraints = [
            # Partial: most rows have no key (on PostgreSQL, one per partition).
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="rm_outbox_idem_uniq",
            )
        ]

    def __str__(self) -> str:
        return f"{self.message_id} → {self.routing_key} ({self.status})"


class DeadLetterOperation(models.Model):
    """A bulk replay or discard over the ``selection`` up to ``max_pk``, carried out a batch per
    transaction (``dead_letters/operations.py``); ``cursor`` the last one done."""

    kind = models.CharField(max_length=10, choices=OperationKind.choices)
    force = models.BooleanField(default=False)
    selection = models.JSONField(default=dict)  # see dead_letters.selection
    # How many its confirmation announced (up to COUNT_CAP): the most it does.
    matched = models.PositiveIntegerField(default=0)
    max_pk = models.BigIntegerField(default=0)
    cursor = models.BigIntegerField(default=0)
    state = models.CharField(
        max_length=10, choices=OperationState.choices, default=OperationState.PENDING
    )
    done = models.PositiveIntegerField(default=0)
    replayed = models.PositiveIntegerField(default=0)
    discarded = models.PositiveIntegerField(default=0)
    refused = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    requested_by = models.CharField(max_length=255)
    cancelled_by = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)

    objects = managers.DeadLetterOperationQuerySet.as_manager()

    class Meta:
        verbose_name = _("dead letter operation")
        ordering = ["-id"]
        indexes = [
            models.Index(
                fields=["id"],
                condition=Q(state__in=["pending", "running"]),
                name="rm_dlop_unfinished_idx",
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.state})"


class Replay(models.Model):
    """One replay of a dead letter and what became of its copy (``dead_letters/ledger.py``)."""

    # No database constraints: dead letters are also deleted with SQL, which one would refuse.
    dead_letter = models.ForeignKey(
        DeadLetter, on_delete=models.CASCADE, related_name="replays", db_constraint=False
    )
    operation = models.ForeignKey(
        DeadLetterOperation,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="replays",
        db_index=False,  # rm_replay_op_outcome_idx
        db_constraint=False,
    )
    consumer = models.CharField(max_length=255)
    # The copy's: the dead letter's own, or a new one for an edited copy.
    message_id = models.CharField(max_length=255)
    kind = models.CharField(max_length=10, choices=ReplayKind.choices, default=ReplayKind.REPLAY)
    replayed_by = models.CharField(max_length=255)
    replayed_at = models.DateTimeField(default=timezone.now)
    outcome = models.CharField(
        max_length=15, choices=ReplayOutcome.choices, default=ReplayOutcome.IN_FLIGHT
    )
    outcome_at = models.DateTimeField(null=True, blank=True)
    # The dead letter the copy became when it failed again (the same row, unless edited).
    failed_as = models.ForeignKey(
        DeadLetter,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_constraint=False,
    )
    # Why the operator replayed it (required for an edited copy).
    reason = models.TextField(blank=True)
    # An edited copy: {"payload": ..., "headers": {...}, "diff": "unified diff of the JSON"}.
    edit = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = _("replay")
        ordering = ["-id"]
        indexes = [
            # With the id: an operation's first replays that failed again, read in order.
            models.Index(fields=["operation", "outcome", "id"], name="rm_replay_op_outcome_idx")
        ]

    def __str__(self) -> str:
        return f"replay of {self.message_id} to {self.consumer}: {self.outcome}"


class ReplayOutcomeTally(models.Model):
    """How many of an operation's replays reached each outcome
    (``docs/design.md#dead-letters-replay-and-bulk-operations``)."""

    operation = models.OneToOneField(
        DeadLetterOperation,
        primary_key=True,
        on_delete=models.CASCADE,
        related_name="replay_outcomes",
        db_constraint=False,
    )
    processed = models.PositiveIntegerField(default=0)
    duplicate = models.PositiveIntegerField(default=0)
    failed_again = models.PositiveIntegerField(default=0)

    objects = managers.ReplayOutcomeTallyQuerySet.as_manager()

    class Meta:
        verbose_name = _("replay outcome tally")

    def __str__(self) -> str:
        return f"outcomes of operation #{self.operation_id}"


class FailureGroupState(models.Model):
    """What an operator said about a failure group: acknowledged or resolved (no row: new)."""

    consumer = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, blank=True)
    reason = models.CharField(max_length=40, choices=DeadLetterReason.choices)
    state = models.CharField(
        max_length=15, choices=[(s.value, s.label) for s in STORED_GROUP_STATES]
    )
    changed_by = models.CharField(max_length=255)
    changed_at = models.DateTimeField(default=timezone.now)
    note = models.TextField(blank=True)

    objects = managers.FailureGroupStateQuerySet.as_manager()

    class Meta:
        verbose_name = _("failure group state")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "fingerprint", "reason"], name="rm_groupstate_key_uniq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.state}"


class TaskRun(models.Model):
    """A ``django.tasks`` task and its result; ``id`` is its message's message_id
    (``docs/tasks.md``)."""

    id = models.CharField(primary_key=True, max_length=64)
    backend = models.CharField(max_length=100)  # the alias in TASKS
    task_path = models.CharField(max_length=255)
    queue_name = models.CharField(max_length=255)
    priority = models.IntegerField(default=0)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    run_after = models.DateTimeField(null=True, blank=True)
    status = models.CharField(
        max_length=10, choices=TaskRunStatus.choices, default=TaskRunStatus.READY
    )
    attempts = models.PositiveIntegerField(default=0)
    return_value = models.JSONField(null=True, blank=True)
    # [{"exception_class_path": ..., "traceback": ...}], one per failed attempt.
    errors = models.JSONField(default=list, blank=True)
    worker_ids = models.JSONField(default=list, blank=True)  # one per attempt
    enqueued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = managers.TaskRunQuerySet.as_manager()

    class Meta:
        verbose_name = _("task run")
        indexes = [
            # The admin's list: by status, latest first; and all of them, latest first.
            models.Index(fields=["status", "-enqueued_at"], name="rm_taskrun_status_idx"),
            models.Index(fields=["-enqueued_at"], name="rm_taskrun_enqueued_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id} ({self.status})"
