"""The inbox (``ProcessedMessage``), the dead letters (``DeadLetter``) and their failure groups
(``DeadLetterGroup``, its ``DeadLetterGroupDelta`` rows and the ``LiveDeadLetterGroup`` view),
the crash guard's ``SuspectDelivery`` and the outbox (``OutboxMessage``).

Fields, constraints and indexes only: the queries and state changes live on the managers
(``managers.py``), the status and reason vocabularies in ``choices.py``."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from .choices import (
    STORED_GROUP_STATES,
    DeadLetterReason,
    DeadLetterStatus,
    OperationKind,
    OperationState,
    OutboxStatus,
    ReplayKind,
    ReplayOutcome,
)
from .managers import (
    DeadLetterGroupManager,
    DeadLetterManager,
    DeadLetterOperationManager,
    FailureGroupStateManager,
    OutboxMessageManager,
    ProcessedMessageManager,
    ReplayOutcomeTallyManager,
    SuspectDeliveryManager,
)


class ProcessedMessage(models.Model):
    """One row per (consumer, message_id) whose handler committed: the inbox.

    The row is what makes effects happen at most once: it is inserted in the handler's own
    transaction, so two deliveries of one message can never both commit. On SQLite the unique
    constraint alone decides; on PostgreSQL the table is partitioned by day
    (``storage/partitions.py``), each partition has the constraint's index, and the inbox claim
    (``storage/inbox.py``) looks across all of them under a per-key advisory lock. The ORM sees one
    table either way.

    Every index costs each insert, and an inbox grows to billions of rows: the unique index
    leads with message_id, so it also answers lookups by message_id alone (replays, the admin's
    search); the one on consumer (a few distinct values, deduplicated by PostgreSQL, filled in
    heap order) answers lookups by consumer at a fraction of a second index on message_id's
    size and insert cost; processed_at is for the admin's order (and the purge on SQLite).
    """

    consumer = models.CharField(max_length=255)
    message_id = models.CharField(max_length=255)
    processed_at = models.DateTimeField(default=timezone.now)

    objects = ProcessedMessageManager()

    class Meta:
        verbose_name = _("processed message")
        constraints = [
            models.UniqueConstraint(
                fields=["message_id", "consumer"], name="rm_inbox_message_consumer_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["processed_at"], name="rm_inbox_processed_at_idx"),
            models.Index(fields=["consumer"], name="rm_inbox_consumer_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.message_id} by {self.consumer}"


class DeadLetter(models.Model):
    """A message a consumer gave up on, with everything needed to understand and replay it.

    One row per (consumer, message_id): a replayed message that fails again updates its row.
    ``body`` always holds the delivery's bytes exactly, also when they are not JSON or UTF-8.
    """

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
    # Groups the dead letters that fail the same way (see core/fingerprints.py).
    fingerprint = models.CharField(max_length=64, blank=True)
    # Append-only record of what happened to this message: failures, replays, resolution.
    history = models.JSONField(default=list, blank=True)
    # The trace of its last failure (W3C ids, hex): its delivery's span when tracing is on,
    # else the traceparent it came with. A replay links to it.
    # A database default too, so rows written with SQL (bulk loads, COPY) need not name them.
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

    objects = DeadLetterManager()

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
            ),
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
            # What purge_messages looks for: resolved and discarded, untouched for a while.
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
    """The key and the figures of a failure group, shared by its row, its deltas and the view
    that adds them up."""

    consumer = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, blank=True)
    reason = models.CharField(max_length=40, choices=DeadLetterReason.choices)
    # Of the latest dead letter counted in: the same for the whole group but for a renamed queue.
    queue = models.CharField(max_length=255, blank=True)
    exception_type = models.CharField(max_length=255, blank=True)
    # The newest dead letter counted in (it may since have been deleted).
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


class DeadLetterGroup(_GroupCounts):
    """The dead letters of one consumer that fail the same way (fingerprint and reason), with
    their counts per status: what the failure groups page, the filters' choices, the metrics
    and ``messaging_status`` read instead of a ``GROUP BY`` over every dead letter.

    On PostgreSQL three statement-level triggers on the dead letters
    (``migrations/0001_initial.py``) read the statement's transition tables, add up
    their rows per group and *insert* the sums, one row per group, into
    :class:`DeadLetterGroupDelta`. Triggers rather than code in the managers because dead
    letters change through many paths (``record_failure``, the status moves, the bulk replay's
    ``UPDATE``, the admin's delete action, ``purge_messages``, a ``DELETE`` typed in psql): each
    one would have to remember the group, and one that forgot would skew the counts for good.
    Statement-level rather than per row so that a bulk ``UPDATE`` of 25,000 dead letters costs
    one delta per group, not 25,000. Inserting into a table without a unique index takes no
    lock that another writer waits for: transactions that write dead letters of one group (a
    consumer dead-lettering or resolving replayed messages in many short transactions, inside
    its handlers' own) never take turns, and two that touch two groups in opposite orders never
    deadlock. A statement that changes nothing a group shows (an ``UPDATE`` of the history
    alone) appends nothing; a repeated failure of a dead letter appends a delta without counts,
    as it moves the group's ``last_seen``, by which the failure groups page sorts.

    ``DeadLetterGroup.objects.fold()`` moves the oldest deltas into this table in one short
    transaction: it deletes them, adds them up per group and upserts the sums in key order.
    One fold runs at a time: a second one finds the first's advisory lock taken and returns
    at once, so folds wait neither for each other nor for writers of dead letters, and no delta
    is lost or counted twice (it leaves the deltas in the transaction that adds it here). A
    fold of 5,000 deltas takes about 20 ms; the relay's operations process folds every five
    seconds and ``purge_messages`` before it forgets the empty groups; readers never fold (a
    page that shows figures writes nothing).

    Readers read :class:`LiveDeadLetterGroup`, this table plus the deltas not folded yet, so
    they are exact whether anyone folded or not. With nobody folding, the deltas grow by one
    row per statement that writes dead letters, and each read adds them up until a fold
    (about 70 ms for 50,000 deltas).

    Elsewhere (SQLite, for development) both tables stay empty and the manager answers the same
    questions with a ``GROUP BY`` over the dead letters, which is cheap on a small table.
    """

    objects = DeadLetterGroupManager()

    class Meta:
        verbose_name = _("dead-letter group")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "fingerprint", "reason"], name="rm_dlgroup_key_uniq"
            ),
        ]
        indexes = [
            models.Index(fields=["fingerprint"], name="rm_dlgroup_fprint_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.dead} dead"


class DeadLetterGroupDelta(_GroupCounts):
    """What one statement on the dead letters changed in one failure group (PostgreSQL's
    triggers insert it; see :class:`DeadLetterGroup`): counts to add (negative for dead
    letters that left a status or the group), and the queue, exception type, newest id and
    failure times of the dead letters it wrote. Append-only until a fold deletes it."""

    class Meta:
        verbose_name = _("dead-letter group delta")

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.total:+d} dead letters"


class LiveDeadLetterGroup(_GroupCounts):
    """Read-only: each failure group as of now, its :class:`DeadLetterGroup` row plus the
    :class:`DeadLetterGroupDelta` rows not folded in yet, added up by a PostgreSQL view
    (created by the initial migration; there is none elsewhere). Read it through
    ``DeadLetterGroup.objects`` (``listing()``, ``counts()``, ...)."""

    pk = models.CompositePrimaryKey("consumer", "fingerprint", "reason")

    class Meta:
        managed = False
        db_table = "reliable_messaging_livedeadlettergroup"
        verbose_name = _("dead-letter group as of now")

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.dead} dead"


class SuspectDelivery(models.Model):
    """A delivery that came back redelivered and is being handled with care (the crash guard).

    Written and committed *before* the handler runs, outside its transaction, so it survives a
    ``SIGKILL`` of the process mid-handler; deleted once the delivery reached an outcome. A row
    still ``running`` when the message comes back means the process died on it.
    """

    consumer = models.CharField(max_length=255)
    message_id = models.CharField(max_length=255)
    deaths = models.PositiveIntegerField(default=0)
    running = models.BooleanField(default=False)
    # "crashed" or "timeout": how the last death happened.
    last_cause = models.CharField(max_length=20, blank=True)
    # host:pid of the process that handled it last (the one that died, when it did).
    last_process = models.CharField(max_length=255, blank=True)
    first_seen_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = SuspectDeliveryManager()

    class Meta:
        verbose_name = _("suspect delivery")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "message_id"], name="rm_suspect_consumer_message_uniq"
            ),
        ]
        indexes = [models.Index(fields=["updated_at"], name="rm_suspect_updated_at_idx")]

    def __str__(self) -> str:
        return f"{self.message_id} by {self.consumer}: {self.deaths} death(s)"


class OutboxMessage(models.Model):
    """A message written by ``publish()`` in the caller's transaction, sent later by the relay.

    ``body`` is the exact JSON text the relay sends: encoding happens at ``publish()`` time, so
    a payload JSON cannot hold fails there and then, never in the relay.
    """

    message_id = models.CharField(max_length=255)
    exchange = models.CharField(max_length=255, blank=True)
    routing_key = models.CharField(max_length=255)
    body = models.TextField()
    headers = models.JSONField(default=dict, blank=True)
    # NULL, not "", means "no key": "" is a legitimate key, and the order index skips NULLs.
    ordering_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    # NULL means "no key"; unique where given (see Meta.constraints).
    idempotency_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    status = models.CharField(
        max_length=10, choices=OutboxStatus.choices, default=OutboxStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    # When the relay may take the row next (the database's clock). While the relay has it in
    # flight it holds a lease: the time past which another relay may send it again. NULL parks a
    # pending row behind an earlier unsent message of its key; the relay clears that when the
    # earlier one is sent.
    next_attempt_at = models.DateTimeField(default=timezone.now, null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    sent_at = models.DateTimeField(null=True, blank=True)
    # When a scheduled message is due (``publish(deliver_at=...)``); NULL for the others. A
    # scheduled row waits as ``scheduled`` with next_attempt_at this time; the relay then makes
    # it pending under a new id, so it takes its place in its ordering key's order when due.
    deliver_at = models.DateTimeField(_("due at"), null=True, blank=True)

    objects = OutboxMessageManager()

    class Meta:
        verbose_name = _("outbox message")
        indexes = [
            # The relay's claim reads the due pending rows and nothing else: rows sent, backing
            # off, in flight or parked (NULL) are outside the range it walks.
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
            # On PostgreSQL these two are indexes of the sent side only (the initial migration,
            # docs/operations.md): every publish inserts into the unsent partition, where they would
            # cost it two entries and serve nothing (the relay claims through the due index,
            # which counts the pending rows too); what they serve reads the sent side (the
            # purge, the unrouted count, a sent row by message_id). The unsent partition has a
            # partial index of its failed rows instead, which a publish writes nothing into.
            models.Index(fields=["status", "sent_at"], name="rm_outbox_status_sent_idx"),
            models.Index(fields=["message_id"], name="rm_outbox_message_id_idx"),
            # Scheduled rows by due time: the relay's "anything due?" reads its first entry. On
            # PostgreSQL, an index of the scheduled partition only (with one of message_id, for
            # cancel_scheduled), so that neither a publish nor the claim touches it.
            models.Index(
                fields=["next_attempt_at", "id"],
                condition=Q(status="scheduled"),
                name="rm_outbox_scheduled_idx",
            ),
        ]
        constraints = [
            # Partial: most rows have no key, and a unique index would hold an entry for each
            # NULL, written by every publish and every row marked sent. On PostgreSQL each
            # partition has its own (``<leaf>_idem``, partitions.py), and
            # publish() looks a key up in all of them under an advisory lock.
            models.UniqueConstraint(
                fields=["idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="rm_outbox_idem_uniq",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.message_id} → {self.routing_key} ({self.status})"


class DeadLetterOperation(models.Model):
    """A bulk replay or discard an operator started: what it takes, who, and how far it got.

    The admin records it and returns at once; the relay process carries it out a batch per
    transaction (``dead_letters/operations.py``). The dead letters it takes are those its
    ``selection`` matches (``dead_letters/selection.py``) with a pk up to ``max_pk``, fixed
    when it was recorded, walked in ascending pk order: ``cursor`` is the last pk done, moved
    in the same transaction as the batch's replays, so a process killed mid-batch leaves the
    batch undone and the cursor before it. State changes live on the manager.
    """

    kind = models.CharField(max_length=10, choices=OperationKind.choices)
    force = models.BooleanField(default=False)
    # {"lookups": {field lookup: value}, "search": "...", "search_mode": "message_id" or
    #  "words" (decided when confirmed), "status_chosen": bool, "description": "in words"}
    selection = models.JSONField(default=dict)
    # How many its confirmation announced (counted up to COUNT_CAP, then an estimate for the
    # progress display): the most it does when counted exactly.
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

    objects = DeadLetterOperationManager()

    class Meta:
        verbose_name = _("dead letter operation")
        ordering = ["-id"]
        indexes = [
            models.Index(
                fields=["id"],
                condition=Q(state__in=["pending", "running"]),
                name="rm_dlop_unfinished_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.state})"


class Replay(models.Model):
    """One replay of a dead letter and what became of its copy: the replay ledger.

    Written with the copy's outbox row (``dead_letters/replay.py``); the copy carries its id in
    ``x-rm-replay-id``, and the consumer that decides the copy records the outcome in the same
    transaction (``dead_letters/ledger.py``): processed, duplicate, or failed again (with the
    dead letter it became). Until then it is in flight.
    """

    # No database constraints on its links: dead letters are also deleted with SQL (a purge in
    # psql), which a constraint would refuse; the ORM's deletes cascade as declared.
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
            models.Index(fields=["operation", "outcome", "id"], name="rm_replay_op_outcome_idx"),
        ]

    def __str__(self) -> str:
        return f"replay of {self.message_id} to {self.consumer}: {self.outcome}"


class ReplayOutcomeTally(models.Model):
    """How many of an operation's replays reached each outcome: what its page shows, read as one
    row rather than counted over its ledger rows (hundreds of thousands), every 2 s.

    Added to by :func:`~reliable_messaging.dead_letters.ledger.settle`, in the transaction that
    settles the replay, so it is exact; in flight is the rest of the operation's ``replayed``.
    A row of its own, not counters on the operation: the relay holds the operation's row locked
    for each batch and claims it with SKIP LOCKED, and consumers settling replays must neither
    wait for a batch nor make the relay skip the operation.
    """

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

    objects = ReplayOutcomeTallyManager()

    class Meta:
        verbose_name = _("replay outcome tally")

    def __str__(self) -> str:
        return f"outcomes of operation #{self.operation_id}"


class FailureGroupState(models.Model):
    """What an operator said about a failure group: acknowledged (muted from alerts) or
    resolved. A group without a row is new; a resolved group whose dead letters failed after
    ``changed_at`` is regressed (computed when read, see ``GroupState``)."""

    consumer = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64, blank=True)
    reason = models.CharField(max_length=40, choices=DeadLetterReason.choices)
    state = models.CharField(
        max_length=15, choices=[(s.value, s.label) for s in STORED_GROUP_STATES]
    )
    changed_by = models.CharField(max_length=255)
    changed_at = models.DateTimeField(default=timezone.now)
    note = models.TextField(blank=True)

    objects = FailureGroupStateManager()

    class Meta:
        verbose_name = _("failure group state")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "fingerprint", "reason"], name="rm_groupstate_key_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.consumer} · {self.fingerprint[:8] or '-'}: {self.state}"
