"""Every query and state change of the app's tables, in the caller's transaction
(``docs/design.md#managers-every-state-change-in-one-place``). Models are ``Any`` here
(``self.model``, :func:`_sibling`): models.py imports this module."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Self

from django.db import IntegrityError, connections, models, router, transaction
from django.db.models import (
    Case,
    Count,
    DurationField,
    Exists,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Now

from .choices import (
    OPEN_DEAD_LETTER_STATUSES,
    UNFINISHED_OPERATION_STATES,
    DeadLetterStatus,
    GroupState,
    OperationState,
    OutboxStatus,
    ReplayOutcome,
    TaskRunStatus,
)
from .core.advisory_locks import ADVISORY_CLASS, GROUP_FOLD_LOCK, IDEMPOTENCY_LOCK_CLASS


class BatchDeletingQuerySet(models.QuerySet):
    """A queryset whose rows can be deleted a batch per short transaction."""

    def delete_in_batches(
        self, batch_size: int, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Delete these rows ``batch_size`` per transaction; ``progress(deleted, total)``."""
        using = _write_db(self)
        rows = self.using(using)
        total = rows.count() if progress else 0
        deleted = 0
        while True:
            with transaction.atomic(using=using):
                ids = list(rows.order_by("pk").values_list("pk", flat=True)[:batch_size])
                if not ids:
                    return deleted
                batch = self.model._default_manager.using(using).filter(pk__in=ids)
                # Rows of this model only, not those deleted with them (a dead letter's replays).
                deleted += batch.delete()[1].get(self.model._meta.label, 0)
            if progress:
                progress(deleted, total)


def _write_db(rows: models.QuerySet[Any]) -> str:
    return getattr(rows, "_db", None) or router.db_for_write(rows.model)


def _sibling(rows: models.QuerySet[Any], name: str) -> Any:
    """Another model's rows on the same database, by name."""
    model = rows.model._meta.apps.get_model(rows.model._meta.app_label, name)
    return model._default_manager.using(rows.db).all()


class _PerMessageQuerySet(BatchDeletingQuerySet):
    """Rows keyed by (consumer, message_id)."""

    def of(self, consumer: str, message_id: str) -> Self:
        """The row of one (consumer, message_id): at most one."""
        return self.filter(consumer=consumer, message_id=message_id)

    def locked_or_created(
        self, consumer: str, message_id: str, **defaults: Any
    ) -> tuple[Any, bool]:
        """The row of (consumer, message_id), locked, or made with ``defaults``; whether it was
        made. A concurrent first insert of the same key turns into a lock of its row."""
        rows = self.using(self.db)
        row = rows.select_for_update().of(consumer, message_id).first()
        if row is not None:
            return row, False
        try:
            with transaction.atomic(using=self.db):
                return rows.create(consumer=consumer, message_id=message_id, **defaults), True
        except IntegrityError:
            row = rows.select_for_update().of(consumer, message_id).first()
            if row is None:
                raise
            return row, False

    def forget(self, consumer: str, message_id: str) -> int:
        """Remove the row of one message (a copy of it then runs again)."""
        return self.of(consumer, message_id).delete()[0]


class ProcessedMessageQuerySet(_PerMessageQuerySet):
    def has(self, consumer: str, message_id: str) -> bool:
        """Whether ``consumer`` processed ``message_id`` (its effects committed)."""
        return self.of(consumer, message_id).exists()

    def forget_many(self, keys: Iterable[tuple[str, str]]) -> int:
        """Remove the inbox rows of several (consumer, message_id) pairs, a delete per consumer."""
        by_consumer: dict[str, list[str]] = {}
        for consumer, message_id in keys:
            by_consumer.setdefault(consumer, []).append(message_id)
        return sum(
            self.filter(consumer=consumer, message_id__in=ids).delete()[0]
            for consumer, ids in by_consumer.items()
        )

    def processed_keys(self, message_ids: Iterable[str]) -> set[tuple[str, str]]:
        """The (consumer, message_id) pairs in the inbox among ``message_ids``, any consumer."""
        return set(
            self.filter(message_id__in=list(message_ids)).values_list("consumer", "message_id")
        )

    def expired(self, before: dt.datetime) -> ProcessedMessageQuerySet:
        """The rows processed before ``before``: past the deduplication horizon."""
        return self.filter(processed_at__lt=before)


class SuspectDeliveryQuerySet(_PerMessageQuerySet):
    """The crash guard's rows (``consuming/crash_guard.py`` decides what a death is)."""

    def mark_interrupted(self, consumer: str, message_id: str, *, at: dt.datetime) -> None:
        """The delivery was given back without an outcome by a process that lives on."""
        self.of(consumer, message_id).update(running=False, updated_at=at)

    def expired(self, before: dt.datetime) -> SuspectDeliveryQuerySet:
        """Crash-guard rows untouched since ``before``: deliveries that never came back."""
        return self.filter(updated_at__lt=before)


# -- dead letters ------------------------------------------------------------------------------

# The per-status counters of a group, named as the statuses.
STATUS_COUNTERS = tuple(status.value for status in DeadLetterStatus)
# A failure group's key, named as the columns of ``FailureGroupState``.
GROUP_KEY = ("consumer", "fingerprint", "reason")
# The keys of a failure group's dict (``DeadLetterGroup.objects.listing()``, ``_by_key()``).
GROUP_FIELDS = (
    *("consumer", "fingerprint", "reason", "queue", "exception_type", "example_id"),
    *("first_seen", "last_seen", *STATUS_COUNTERS, "total"),
)


def _counted(letters: models.QuerySet[Any], *key: str) -> models.QuerySet[Any, dict[str, Any]]:
    """The failure groups' figures, by ``key``, counted with a ``GROUP BY`` over ``letters``."""
    return letters.values(*key).annotate(
        total=Count("pk"),
        **{status: Count("pk", filter=Q(status=status)) for status in STATUS_COUNTERS},
        first_seen=Min("first_failed_at"),
        last_seen=Max("last_failed_at"),
        example_id=Max("pk"),
        exception_type=Max("exception_type"),
        queue=Max("queue"),
    )


def _latest_first(
    groups: models.QuerySet[Any, dict[str, Any]], with_open: bool, *tie: str
) -> models.QuerySet[Any, dict[str, Any]]:
    """Those with dead letters first, then the latest; ``with_open``: only those with some."""
    groups = groups.order_by("-dead", "-last_seen", *tie)
    return groups.filter(dead__gt=0) if with_open else groups


class DeadLetterQuerySet(_PerMessageQuerySet):
    """The dead letters, and the only code that moves one from a status to another: each move
    saves the status and one ``history`` entry (``at``, and ``by`` when someone did it)."""

    def open(self) -> DeadLetterQuerySet:
        """Those awaiting an outcome: dead, or replayed and not yet decided."""
        return self.filter(status__in=OPEN_DEAD_LETTER_STATUSES)

    def already_processed(self) -> DeadLetterQuerySet:
        """Those whose consumer has an inbox row for their message_id."""
        inbox = _sibling(self, "ProcessedMessage")
        key = {"consumer": OuterRef("consumer"), "message_id": OuterRef("message_id")}
        return self.filter(Exists(inbox.filter(**key)))

    def closed_before(self, before: dt.datetime) -> DeadLetterQuerySet:
        """Resolved and discarded dead letters untouched since ``before`` (purge_messages's)."""
        return self.filter(
            status__in=[DeadLetterStatus.RESOLVED, DeadLetterStatus.DISCARDED],
            updated_at__lt=before,
        )

    # -- moves ------------------------------------------------------------------------------

    def mark_replayed(self, dead_letter: Any, *, by: str, forced: bool, at: dt.datetime) -> None:
        """A copy is in the outbox; ``forced``: its inbox row was removed for it."""
        _move(dead_letter, DeadLetterStatus.REPLAYED, "replayed", at, by=by, forced=forced)

    def mark_edited_replay(self, dead_letter: Any, *, at: dt.datetime, **details: str) -> None:
        """An edited copy under a new message_id is in the outbox; ``details`` go to history."""
        _move(dead_letter, DeadLetterStatus.REPLAYED, "edited_replay", at, **details)

    def mark_replayed_in_bulk(
        self, pks: Iterable[int], *, by: str, forced: bool, at: dt.datetime, **details: Any
    ) -> int:
        """:meth:`mark_replayed` for many locked dead letters, in one UPDATE."""
        event = {"event": "replayed", "at": at.isoformat(), "by": by, "forced": forced, **details}
        return _update_appending(
            self.filter(pk__in=list(pks)),
            "history",
            event,
            status=DeadLetterStatus.REPLAYED,
            replay_count=F("replay_count") + 1,
            updated_at=at,
        )

    def discard(self, *, by: str, at: dt.datetime, **details: Any) -> int:
        """Mark these dead letters discarded in one UPDATE; returns how many."""
        event = {"event": "discarded", "at": at.isoformat(), "by": by, **details}
        return _update_appending(
            self, "history", event, status=DeadLetterStatus.DISCARDED, updated_at=at
        )

    def resolve(
        self, *, at: dt.datetime, by: str | None = None, trace_id: str | None = None
    ) -> int:
        """Lock these dead letters and mark each resolved; returns how many."""
        details: dict[str, Any] = {"by": by} if by is not None else {}
        if trace_id:
            details["trace_id"] = trace_id
        letters = list(self.select_for_update())
        for dead_letter in letters:
            _move(dead_letter, DeadLetterStatus.RESOLVED, "resolved", at, **details)
        return len(letters)

    def record_failure(
        self,
        consumer: str,
        message_id: str,
        *,
        fields: dict[str, Any],
        event: dict[str, Any],
        first_failed_at: dt.datetime,
    ) -> Any:
        """Store a failure: a new row, or the existing one updated, ``event`` in its history."""
        new = {"first_failed_at": first_failed_at, "history": [event], **fields}
        with transaction.atomic(using=self.db):
            if not message_id:  # not unique: a row of its own
                return self.using(self.db).create(consumer=consumer, message_id="", **new)
            row, created = self.locked_or_created(consumer, message_id, **new)
            if not created:
                for name, value in fields.items():
                    setattr(row, name, value)
                row.history = [*row.history, event]
                row.save(using=self.db)
            return row


class _JSONAppend(models.Func):
    """``field || '[item]'``: PostgreSQL appends to a jsonb array in the UPDATE itself."""

    template = "%(expressions)s"
    arg_joiner = " || "
    output_field = models.JSONField()


def _update_appending(rows: models.QuerySet[Any], field: str, item: Any, **fields: Any) -> int:
    """Set ``fields`` and append ``item`` to the JSON list ``field`` of ``rows``."""
    using = rows.db
    if connections[using].vendor == "postgresql":
        appended = Value([item], output_field=models.JSONField())
        return rows.update(**{field: _JSONAppend(F(field), appended)}, **fields)
    pks = list(rows.values_list("pk", flat=True))
    model = rows.model._default_manager.using(using)
    model.filter(pk__in=pks).update(**fields)
    for row in model.filter(pk__in=pks).only("pk", field):
        setattr(row, field, [*getattr(row, field), item])
        row.save(using=using, update_fields=[field])
    return len(pks)


def _move(dead_letter: Any, status: str, event: str, at: dt.datetime, **details: Any) -> None:
    # An UPDATE, not save(): save() would stamp updated_at with the clock (auto_now), not ``at``
    # as the bulk moves do.
    history = [*dead_letter.history, {"event": event, "at": at.isoformat(), **details}]
    fields = {"status": status, "history": history, "updated_at": at}
    if status == DeadLetterStatus.REPLAYED:
        fields["replay_count"] = dead_letter.replay_count + 1
    rows = type(dead_letter)._default_manager.using(dead_letter._state.db)
    rows.filter(pk=dead_letter.pk).update(**fields)
    for name, value in fields.items():
        setattr(dead_letter, name, value)


# -- the failure groups ------------------------------------------------------------------------


# A fold moves at most this many deltas per transaction: about 20 ms of work.
FOLD_BATCH_SIZE = 5000

# The oldest deltas added into the groups (as the view LiveDeadLetterGroup adds them) and
# deleted, in one statement; rows a concurrent fold holds are skipped.
FOLD = """
WITH moved AS (
    DELETE FROM {deltas}
    WHERE id IN (SELECT id FROM {deltas} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
    RETURNING *
), folded AS (
    INSERT INTO {groups} AS g (
        consumer, fingerprint, reason, queue, exception_type, example_id, first_seen,
        last_seen, dead, replayed, resolved, discarded, total
    )
    SELECT consumer, fingerprint, reason,
           coalesce((array_agg(queue ORDER BY id DESC) FILTER (WHERE queue <> ''))[1], ''),
           coalesce((array_agg(exception_type ORDER BY id DESC)
                     FILTER (WHERE exception_type <> ''))[1], ''),
           max(example_id), min(first_seen), max(last_seen),
           sum(dead), sum(replayed), sum(resolved), sum(discarded), sum(total)
    FROM moved
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
    RETURNING 1
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM folded)
"""


def _fold_lock(cursor: Any) -> bool:
    """Take the fold's advisory lock for this transaction, unless another fold holds it."""
    cursor.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", [ADVISORY_CLASS, GROUP_FOLD_LOCK])
    return bool(cursor.fetchone()[0])


class DeadLetterGroupQuerySet(models.QuerySet):
    """The failure groups (``docs/concepts.md#failure-groups``): the live view on PostgreSQL,
    else counted over the dead letters. Filters on this queryset do not narrow readers."""

    def kept(self) -> bool:
        """Whether the table is kept up to date on this database (PostgreSQL's triggers)."""
        return connections[self.db].vendor == "postgresql"

    def _dead_letters(self) -> DeadLetterQuerySet:
        return _sibling(self, "DeadLetter")  # type: ignore[no-any-return]

    def _live(self) -> models.QuerySet[Any]:
        """The groups with a dead letter, as of now. Reading never folds."""
        return _sibling(self, "LiveDeadLetterGroup").filter(total__gt=0)

    def fold(self, *, batch_size: int = FOLD_BATCH_SIZE, batches: int | None = 1) -> int:
        """Fold the oldest deltas, ``batch_size`` per transaction, ``batches`` times (None: all);
        returns how many. Returns at once while another fold holds the lock."""
        using = _write_db(self)
        if connections[using].vendor != "postgresql":
            return 0
        deltas = _sibling(self, "DeadLetterGroupDelta").model._meta.db_table
        sql = FOLD.format(deltas=deltas, groups=self.model._meta.db_table)
        folded = rounds = 0
        while batches is None or rounds < batches:
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                if not _fold_lock(cursor):
                    return folded
                cursor.execute(sql, [batch_size])
                moved = cursor.fetchone()[0]
            folded += moved
            rounds += 1
            if moved < batch_size:
                break
        return folded

    def listing(self, *, with_open: bool = True) -> models.QuerySet[Any, dict[str, Any]]:
        """One dict per (fingerprint, consumer) (:data:`GROUP_FIELDS`), reasons added up."""
        if not self.kept():
            letters = self._dead_letters()
            groups = _counted(letters, "fingerprint", "consumer").annotate(reason=Max("reason"))
        else:
            groups = (
                self._live()
                .values("fingerprint", "consumer")
                .annotate(
                    **{name: Sum(name) for name in ("total", *STATUS_COUNTERS)},
                    first_seen=Min("first_seen"),
                    **{name: Max(name) for name in ("last_seen", "example_id", "reason", "queue")},
                    exception_type=Max("exception_type"),
                )
            )
        return _latest_first(groups, with_open, "fingerprint", "consumer")

    def of_fingerprint(self, fingerprint: str) -> dict[str, Any]:
        """``total`` dead letters of ``fingerprint``, and its latest exception type and reason."""
        if not self.kept():
            letters = self._dead_letters().filter(fingerprint=fingerprint)
            total = letters.count()
            latest = letters.order_by("-pk").values("exception_type", "reason").first()
        else:
            rows = list(
                self._live()
                .filter(fingerprint=fingerprint)
                .order_by("-last_seen")
                .values("exception_type", "reason", "total")
            )
            total = sum(row.pop("total") for row in rows)
            latest = rows[0] if rows else None
        return {"total": total, **(latest or dict.fromkeys(("exception_type", "reason")))}

    def values_of(self, field: str) -> list[str]:
        """The distinct values of a dead letter's ``field``, sorted, read from the groups."""
        source: models.QuerySet[Any] = self._live() if self.kept() else self._dead_letters()
        return sorted(
            value for value in source.order_by().values_list(field, flat=True).distinct() if value
        )

    def counts(self) -> list[tuple[str, str, str, int]]:
        """(status, consumer, reason, dead letters) for every status that has some, sorted."""
        if not self.kept():
            letters = self._dead_letters().order_by().values_list("status", "consumer", "reason")
            return sorted(letters.annotate(rows=Count("pk")))
        totals: dict[tuple[str, str, str], int] = {}
        for row in self._live().values("consumer", "reason", *STATUS_COUNTERS):
            for status in STATUS_COUNTERS:
                if row[status]:
                    key = (status, row["consumer"], row["reason"])
                    totals[key] = totals.get(key, 0) + row[status]
        return sorted((*key, count) for key, count in totals.items())

    def forget_empty(self) -> int:
        """Fold the deltas, then delete the empty groups under the fold's lock; how many."""
        using = _write_db(self)
        if connections[using].vendor != "postgresql":
            return 0
        self.using(using).fold(batches=None)
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            if not _fold_lock(cursor):
                return 0
            # Every count, not only the total: a group is empty only when all are zero.
            empty = self.using(using).filter(total=0, **dict.fromkeys(STATUS_COUNTERS, 0))
            return empty.delete()[0]

    def dead_counts(self) -> list[tuple[str, str, int]]:
        """(consumer, reason, dead letters still dead) where there are some, sorted."""
        return [
            (consumer, reason, count)
            for status, consumer, reason, count in self.counts()
            if status == DeadLetterStatus.DEAD
        ]

    # -- the lifecycle (``FailureGroupState``) -------------------------------------------------

    def _by_key(self) -> models.QuerySet[Any, dict[str, Any]]:
        """One dict per (consumer, fingerprint, reason) with a dead letter."""
        if self.kept():
            return self._live().values(*GROUP_FIELDS)
        return _counted(self._dead_letters(), *GROUP_KEY)

    def with_states(
        self, *, states: Iterable[str] | None = None, with_open: bool = True
    ) -> models.QuerySet[Any, dict[str, Any]]:
        """:meth:`_by_key`'s groups with ``state`` (:class:`GroupState`), ``state_by``,
        ``state_at`` and ``state_note``; ``states``: only those."""
        row = _sibling(self, "FailureGroupState").filter(
            **{name: OuterRef(name) for name in GROUP_KEY}
        )
        stored = {"stored_state": "state", "state_at": "changed_at", "state_by": "changed_by"}
        groups = _latest_first(
            self._by_key()
            .annotate(
                **{name: Subquery(row.values(column)[:1]) for name, column in stored.items()},
                state_note=Subquery(row.values("note")[:1]),
            )
            .annotate(
                state=Case(
                    When(stored_state__isnull=True, then=Value(GroupState.NEW.value)),
                    When(
                        stored_state=GroupState.RESOLVED.value,
                        last_seen__gt=F("state_at"),
                        then=Value(GroupState.REGRESSED.value),
                    ),
                    default=F("stored_state"),
                    output_field=models.CharField(),
                )
            ),
            with_open,
            *GROUP_KEY,
        )
        if states is not None:
            groups = groups.filter(state__in=list(states))
        return groups

    def state_of(self, consumer: str, fingerprint: str, reason: str) -> str:
        """The :class:`GroupState` of one group (``new`` for a group without dead letters)."""
        group = (
            self.with_states(with_open=False)
            .filter(consumer=consumer, fingerprint=fingerprint, reason=reason)
            .values_list("state", flat=True)
            .first()
        )
        return group or GroupState.NEW.value


# A failure group's key: (consumer, fingerprint, reason).
GroupKey = tuple[str, str, str]


class FailureGroupStateQuerySet(models.QuerySet):
    """What operators said about failure groups; each move writes an admin log entry when
    ``user_id`` is given (``reopen`` deletes the row)."""

    def of(self, consumer: str, fingerprint: str, reason: str) -> FailureGroupStateQuerySet:
        return self.filter(consumer=consumer, fingerprint=fingerprint, reason=reason)

    def _store(
        self, state: str, key: GroupKey, *, by: str, at: dt.datetime, note: str, user_id: int | None
    ) -> Any:
        lookup: dict[str, Any] = dict(zip(GROUP_KEY, key, strict=True))
        row, created = self.update_or_create(
            **lookup, defaults={"state": state, "changed_by": by, "changed_at": at, "note": note}
        )
        _log_group_move(row, state, note, at=at, user_id=user_id, added=created)
        return row

    def acknowledge(
        self, key: GroupKey, *, by: str, at: dt.datetime, note: str = "", user_id: int | None = None
    ) -> Any:
        """Someone looks into the group: muted from alerts until resolved or reopened."""
        return self._store(GroupState.ACKNOWLEDGED, key, by=by, at=at, note=note, user_id=user_id)

    def resolve(
        self, key: GroupKey, *, by: str, at: dt.datetime, note: str = "", user_id: int | None = None
    ) -> Any:
        """The cause is fixed: a failure of the group after ``at`` makes it regressed."""
        return self._store(GroupState.RESOLVED, key, by=by, at=at, note=note, user_id=user_id)

    def reopen(
        self, key: GroupKey, *, at: dt.datetime, note: str = "", user_id: int | None = None
    ) -> bool:
        """Forget what was said of the group: it is new again. False when it was already."""
        row = self.select_for_update().of(*key).first()
        if row is None:
            return False
        _log_group_move(row, GroupState.NEW, note, at=at, user_id=user_id, added=False)
        row.delete()
        return True


def _log_group_move(
    row: Any, state: str, note: str, *, at: dt.datetime, user_id: int | None, added: bool
) -> None:
    if user_id is None or not row._meta.apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
    from django.contrib.contenttypes.models import ContentType

    verb = {
        GroupState.ACKNOWLEDGED: "Acknowledged",
        GroupState.RESOLVED: "Resolved",
        GroupState.NEW: "Reopened",
    }[GroupState(state)]
    message = f"{verb} failure group {row.consumer} · {row.fingerprint or '-'} ({row.reason})"
    if note:
        message += f": {note}"
    flag = DELETION if state == GroupState.NEW else ADDITION if added else CHANGE
    using = row._state.db or router.db_for_write(LogEntry)
    LogEntry.objects.db_manager(using).create(
        action_time=at,
        user_id=user_id,
        content_type_id=ContentType.objects.db_manager(using).get_for_model(row).pk,
        object_id=str(row.pk),
        object_repr=str(row)[:200],
        action_flag=flag,
        change_message=message,
    )


def waiting_since() -> Coalesce:
    """Since when an outbox row waits: its due time if scheduled, else when it was written."""
    return Coalesce("deliver_at", "created_at")


class OutboxMessageQuerySet(BatchDeletingQuerySet):
    def pending(self) -> OutboxMessageQuerySet:
        return self.filter(status=OutboxStatus.PENDING)

    def failed(self) -> OutboxMessageQuerySet:
        return self.filter(status=OutboxStatus.FAILED)

    def finished_before(self, before: dt.datetime) -> OutboxMessageQuerySet:
        """Rows done with (sent, or unrouted: events nobody subscribed to) before ``before``."""
        return self.filter(
            status__in=[OutboxStatus.SENT, OutboxStatus.UNROUTED], sent_at__lt=before
        )

    def message_id_of(self, idempotency_key: str) -> str | None:
        """The message_id published earlier with ``idempotency_key``, if any."""
        published = self.filter(idempotency_key=idempotency_key)
        return published.values_list("message_id", flat=True).first()

    def retry_failed(self) -> int:
        """Make the failed rows among these pending again, due now, attempts afresh."""
        return self.failed().update(status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now())

    def schedule_copy(
        self,
        *,
        message_id: str,
        queue: str,
        body: bytes,
        properties: bytes,
        delay: float,
        idempotency_key: str,
    ) -> None:
        """A retry copy to ``queue`` alone, due in ``delay`` s, unless an unsent row of
        ``idempotency_key`` exists (``docs/design.md#where-a-retry-waits``)."""
        using = self.db
        with transaction.atomic(using=using):
            if connections[using].vendor == "postgresql":
                with connections[using].cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                        [IDEMPOTENCY_LOCK_CLASS, idempotency_key],
                    )
            # Unsent rows only: a sent copy's key may come again (a replay, a new publish).
            unsent = [OutboxStatus.SCHEDULED, OutboxStatus.PENDING, OutboxStatus.FAILED]
            if self.filter(idempotency_key=idempotency_key, status__in=unsent).exists():
                return
            due = Now() + Value(dt.timedelta(seconds=delay), output_field=DurationField())
            row = self.model(
                message_id=message_id,
                exchange="",
                routing_key=queue,
                body="",
                headers={},
                raw_body=body,
                raw_properties=properties,
                idempotency_key=idempotency_key,
                status=OutboxStatus.SCHEDULED,
                next_attempt_at=due,
                deliver_at=due,
                created_at=Now(),
            )
            self.bulk_create([row], ignore_conflicts=True)


class DeadLetterOperationQuerySet(models.QuerySet):
    """The bulk replays and discards, and every change of their state."""

    def unfinished(self) -> DeadLetterOperationQuerySet:
        return self.filter(state__in=UNFINISHED_OPERATION_STATES)

    def record(
        self,
        *,
        kind: str,
        selection: dict[str, Any],
        requested_by: str,
        force: bool = False,
        matched: int,
        max_pk: int,
    ) -> Any:
        """A new pending operation over ``selection`` up to dead letter ``max_pk``."""
        fields = {"kind": kind, "selection": selection, "requested_by": requested_by}
        return self.create(**fields, force=force, matched=matched, max_pk=max_pk)

    def same_as(self, kind: str, selection: dict[str, Any], force: bool) -> Any:
        """An unfinished operation of the same kind over the same selection, if any."""
        same = self.unfinished().filter(kind=kind, force=force, selection=selection)
        return same.order_by("pk").first()

    def claim_next(self) -> Any:
        """The oldest unfinished operation no one else is running, locked; or None."""
        return self.unfinished().select_for_update(skip_locked=True).order_by("pk").first()

    def advance(
        self,
        operation: Any,
        *,
        cursor: int,
        at: dt.datetime,
        replayed: int = 0,
        discarded: int = 0,
        refused: int = 0,
        skipped: int = 0,
    ) -> None:
        """A batch of ``operation`` (locked by :meth:`claim_next`) is done up to ``cursor``."""
        counts = {"replayed": replayed, "discarded": discarded, "refused": refused}
        counts["skipped"] = skipped
        for name, count in counts.items():
            setattr(operation, name, getattr(operation, name) + count)
        operation.done += sum(counts.values())
        operation.cursor, operation.state = cursor, OperationState.RUNNING
        operation.started_at = operation.started_at or at
        operation.heartbeat_at = at
        fields = ["cursor", "done", "state", "started_at", "heartbeat_at"]
        operation.save(update_fields=[*counts, *fields])

    def finish(self, operation: Any, *, at: dt.datetime) -> None:
        """Nothing is left of ``operation`` (locked by :meth:`claim_next`)."""
        operation.state = OperationState.DONE
        operation.started_at = operation.started_at or at
        operation.finished_at = operation.heartbeat_at = at
        operation.save(update_fields=["state", "started_at", "finished_at", "heartbeat_at"])

    def _stop(self, pk: int, state: str, **fields: Any) -> int:
        return self.unfinished().filter(pk=pk).update(state=state, **fields)

    def fail(self, pk: int, *, error: str, at: dt.datetime) -> int:
        """``pk`` failed for good (a batch that raises every time): stopped, with why."""
        return self._stop(pk, OperationState.FAILED, error=error, finished_at=at, heartbeat_at=at)

    def cancel(self, pk: int, *, by: str, at: dt.datetime) -> bool:
        """Stop ``pk`` after the batch under way; False when it had finished."""
        return bool(self._stop(pk, OperationState.CANCELLED, cancelled_by=by, finished_at=at))


# The outcomes a replay is settled with, each a column of ReplayOutcomeTally.
TALLIED_OUTCOMES = (ReplayOutcome.PROCESSED, ReplayOutcome.DUPLICATE, ReplayOutcome.FAILED_AGAIN)


class ReplayOutcomeTallyQuerySet(models.QuerySet):
    """The outcome counts of the bulk replays' copies (``ReplayOutcomeTally``)."""

    def add(self, operation_id: int, outcome: str) -> None:
        """One more replay of ``operation_id`` reached ``outcome`` (an upsert: none is lost)."""
        if outcome not in TALLIED_OUTCOMES:
            raise ValueError(f"not a settled replay outcome: {outcome!r}")
        using = self.db
        quote = connections[using].ops.quote_name
        table = quote(self.model._meta.db_table)
        column = quote(str(outcome))
        with connections[using].cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (operation_id, processed, duplicate, failed_again) "  # noqa: S608
                f"VALUES (%s, %s, %s, %s) ON CONFLICT (operation_id) "
                f"DO UPDATE SET {column} = {table}.{column} + 1",
                [operation_id, *(int(name == outcome) for name in TALLIED_OUTCOMES)],
            )


_STARTED_FIELDS = [
    "status",
    "started_at",
    "last_attempted_at",
    "finished_at",
    "attempts",
    "worker_ids",
]


def _started(run: Any, worker_id: str, at: dt.datetime) -> Any:
    """``run`` RUNNING for one more attempt by ``worker_id`` (not saved)."""
    run.status = TaskRunStatus.RUNNING
    run.started_at = run.started_at or at
    run.last_attempted_at = at
    run.finished_at = None
    run.attempts += 1
    run.worker_ids = [*run.worker_ids, worker_id]
    return run


def _startable(run: Any, named: dict[str, list[str]] | None) -> bool:
    """Not SUCCESSFUL, and of a task a message names (when ``named`` says which)."""
    if run.status == TaskRunStatus.SUCCESSFUL:
        return False
    return named is None or run.task_path in named.get(run.pk, ())


class TaskRunQuerySet(BatchDeletingQuerySet):
    """The lifecycle of ``django.tasks`` tasks: READY, RUNNING per attempt, SUCCESSFUL or FAILED."""

    def finished_before(self, before: dt.datetime) -> TaskRunQuerySet:
        """Tasks that finished (SUCCESSFUL or FAILED) before ``before`` and have no dead letter
        a replay could still take (dead, replayed or discarded: its replay runs the row; a
        forced one, a SUCCESSFUL row too). purge_messages's."""
        replayable = (
            _sibling(self, "DeadLetter")
            .filter(message_id=OuterRef("pk"))
            .exclude(status=DeadLetterStatus.RESOLVED)
        )
        return self.filter(
            ~Exists(replayable),
            # A task finishes after its enqueue: the status index's range, then the finish.
            status__in=(TaskRunStatus.SUCCESSFUL, TaskRunStatus.FAILED),
            enqueued_at__lt=before,
            finished_at__lt=before,
        )

    def run_again(self, named: Mapping[str, object]) -> int:
        """READY again, their result forgotten, the SUCCESSFUL tasks of ``named`` (task id ->
        the task its message names) whose task is the one named: a forced replay runs such a
        task once more, started and counted as a new attempt (a message naming another task
        runs nothing, so its row keeps its result)."""
        succeeded = self.filter(pk__in=list(named), status=TaskRunStatus.SUCCESSFUL)
        again = [pk for pk, path in succeeded.values_list("pk", "task_path") if named[pk] == path]
        if not again:
            return 0
        return succeeded.filter(pk__in=again).update(
            status=TaskRunStatus.READY, return_value=None, finished_at=None
        )

    def start_attempts(
        self,
        ids: Iterable[str],
        worker_id: str,
        at: dt.datetime,
        *,
        paths: Mapping[str, Collection[str]] | None = None,
    ) -> list[Any]:
        """Mark the tasks of ``ids`` (not SUCCESSFUL) RUNNING for one more attempt by
        ``worker_id`` and return their rows, committed before they run. With ``paths`` (the
        task paths the messages of each id name), only a row whose task a message names."""
        wanted = list(dict.fromkeys(ids))
        named = None if paths is None else {pk: sorted(paths.get(pk, ())) for pk in wanted}
        connection = connections[self.db]
        if connection.vendor == "postgresql":
            if connection.in_atomic_block:
                with transaction.atomic(using=self.db):
                    started = self._start_free(wanted, named, worker_id, at)
            else:
                # One round trip, a commit that does not wait for the disk (docs/tasks.md).
                started = self._start_free(wanted, named, worker_id, at, flush=False)
            # Not started (held elsewhere, SUCCESSFUL, or gone): each looked at alone below.
            taken = {run.pk for run in started}
        else:
            with transaction.atomic(using=self.db):
                free = list(
                    self.select_for_update(skip_locked=True).filter(pk__in=wanted).order_by("pk")
                )
                started = [run for run in free if _startable(run, named)]
                for run in started:
                    _started(run, worker_id, at).save(using=self.db, update_fields=_STARTED_FIELDS)
            taken = {run.pk for run in free}
        for task_id in wanted:
            if task_id in taken:
                continue
            with transaction.atomic(using=self.db):
                run = self.select_for_update().filter(pk=task_id).first()
                if run is None or not _startable(run, named):
                    continue
                _started(run, worker_id, at).save(using=self.db, update_fields=_STARTED_FIELDS)
            started.append(run)
        return started

    def _start_free(
        self,
        wanted: list[str],
        named: dict[str, list[str]] | None,
        worker_id: str,
        at: dt.datetime,
        *,
        flush: bool = True,
    ) -> list[Any]:
        """PostgreSQL: the free, not SUCCESSFUL rows of ``wanted`` started in one statement.
        ``flush=False`` (in autocommit only): its commit does not wait for the disk."""
        table = connections[self.db].ops.quote_name(self.model._meta.db_table)
        # In the statement itself (a CTE the WHERE reads), so it holds for its transaction.
        no_flush = (
            ""
            if flush
            else "WITH rm_no_flush AS (SELECT set_config('synchronous_commit', 'off', true)) "
        )
        flushed = "" if flush else "AND EXISTS (SELECT 1 FROM rm_no_flush) "
        # The times set to ``at`` come back NULL, set in Python below (loading them costs most).
        connection = connections[self.db]
        fields = self.model._meta.concrete_fields
        in_python = {
            "started_at": "NULLIF(started_at, %s)",
            "last_attempted_at": "NULL::timestamptz",
            "finished_at": "NULL::timestamptz",
        }
        # The JSON columns come back as one array, decoded by one json.loads (a decoding per
        # column cost a task more than its row's other columns together); NULL in their places.
        in_json = [i for i, f in enumerate(fields) if isinstance(f, models.JSONField)]
        returned = ", ".join(
            "NULL" if i in in_json else in_python.get(f.name, connection.ops.quote_name(f.column))
            for i, f in enumerate(fields)
        )
        quoted = ", ".join(connection.ops.quote_name(fields[i].column) for i in in_json)
        returned += f", json_build_array({quoted})::text"
        sql = (
            f"{no_flush}UPDATE {table} SET status = %s, "  # noqa: S608
            f"started_at = COALESCE(started_at, %s), "
            f"last_attempted_at = %s, finished_at = NULL, attempts = attempts + 1, "
            f"worker_ids = worker_ids || %s::jsonb WHERE id IN (SELECT id FROM {table} "
            f"WHERE id = ANY(%s) AND status <> %s "
            f"AND (%s::jsonb IS NULL OR (%s::jsonb -> id) ? task_path) "
            f"ORDER BY id FOR UPDATE SKIP LOCKED) "
            f"{flushed}RETURNING {returned}"
        )
        params: list[Any] = [
            TaskRunStatus.RUNNING,
            at,
            at,
            json.dumps([worker_id]),
            wanted,
            TaskRunStatus.SUCCESSFUL,
            *[None if named is None else json.dumps(named)] * 2,
            at,
        ]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        # The rows as the ORM builds them, the JSON columns decoded as their fields do
        # (json.loads, no custom decoder on these fields).
        names = [f.attname for f in fields]
        started = []
        for row in rows:
            values = list(row[:-1])
            for i, value in zip(in_json, json.loads(row[-1]), strict=True):
                values[i] = value
            run = self.model.from_db(self.db, names, values)
            run.started_at = run.started_at or at
            run.last_attempted_at = at
            started.append(run)
        return started

    def succeed_all(self, returned: dict[str, Any], at: dt.datetime) -> int:
        """Mark the tasks of ``returned`` SUCCESSFUL with their values, in one UPDATE."""
        if not returned:
            return 0
        using = self.db
        if connections[using].vendor == "postgresql":
            # One JSON object the server unpacks: a CASE per row costs the ORM more.
            table = connections[using].ops.quote_name(self.model._meta.db_table)
            with connections[using].cursor() as cursor:
                cursor.execute(
                    f"UPDATE {table} AS run SET status = %s, return_value = returned.value, "  # noqa: S608
                    f"finished_at = %s FROM jsonb_each(%s::jsonb) AS returned "
                    f"WHERE run.id = returned.key",
                    [TaskRunStatus.SUCCESSFUL, at, json.dumps(returned)],
                )
                return cursor.rowcount
        json_field = models.JSONField()
        values = [When(pk=pk, then=Value(v, output_field=json_field)) for pk, v in returned.items()]
        return self.filter(pk__in=list(returned)).update(
            status=TaskRunStatus.SUCCESSFUL,
            return_value=Case(*values, output_field=json_field),
            finished_at=at,
        )

    def fail_attempt(self, task_id: str, error: dict[str, str] | None) -> None:
        """An attempt failed with ``error``: READY for the next one."""
        run = self.select_for_update().filter(pk=task_id).first()
        if run is None or run.status == TaskRunStatus.SUCCESSFUL:
            return
        if error is not None:
            run.errors = [*run.errors, error]
        run.status = TaskRunStatus.READY
        run.save(using=self.db, update_fields=["errors", "status"])

    def take_back_attempt(self, task_id: str, worker_id: str) -> None:
        """Uncount the attempt ``worker_id`` started but put aside (another worker runs it)."""
        run = self.select_for_update().filter(pk=task_id).first()
        if run is None or worker_id not in run.worker_ids:
            return
        kept = list(run.worker_ids)
        del kept[len(kept) - 1 - kept[::-1].index(worker_id)]  # its own last entry
        run.worker_ids = kept
        run.attempts = max(0, run.attempts - 1)
        run.save(using=self.db, update_fields=["worker_ids", "attempts"])
