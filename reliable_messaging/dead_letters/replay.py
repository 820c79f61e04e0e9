"""Replaying dead letters: back through the outbox, to the consumer that failed, only
(``docs/design.md#dead-letters-replay-and-bulk-operations``)."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from django.db import connections, router, transaction
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from .. import tracing
from ..choices import DeadLetterReason, DeadLetterStatus, OutboxStatus, ReplayKind
from ..core.envelope import (
    ATTEMPT_HEADER,
    BROKER_HEADERS,
    CELERY_TASK_HEADER,
    DEAD_LETTER_ID_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORDERING_KEY_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    OUTBOX_ID_HEADER,
    PUBLISHED_AT_HEADER,
    REPLAY_HEADER,
    REPLAY_ID_HEADER,
    REPLAYED_BY_HEADER,
    wire_headers,
)
from ..core.trace_context import TRACE_HEADERS
from ..models import DeadLetter, OutboxMessage, ProcessedMessage, Replay, TaskRun
from ..task_runs.naming import is_task_consumer, is_task_id

logger = logging.getLogger(__name__)

# Reasons a replay would certainly fail for again: the body or the id itself is the problem.
UNREPLAYABLE_REASONS = {
    DeadLetterReason.MISSING_MESSAGE_ID: "it has no message_id, so it would be refused again",
    DeadLetterReason.INVALID_JSON: "its body is not JSON, so it would be refused again",
    DeadLetterReason.INVALID_UTF8: "its body is not UTF-8, so it would be refused again",
    DeadLetterReason.EMPTY_BODY: "its body is empty, so it would be refused again",
}
REPLAYABLE_STATUSES = (DeadLetterStatus.DEAD, DeadLetterStatus.DISCARDED)
# How long a replay may await its outcome before it is presumed lost: then it may be replayed
# again (the inbox takes a late first copy once) or discarded (a late copy still resolves it).
STALE_REPLAY_AFTER = dt.timedelta(hours=1)
# Headers describing the previous life of the message, which a replay starts afresh.
_RESET_HEADERS = {
    ATTEMPT_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    PUBLISHED_AT_HEADER,
    REPLAY_ID_HEADER,
    OUTBOX_ID_HEADER,
} | BROKER_HEADERS


@dataclass
class ReplayResult:
    """What a replay did; ``refused`` maps dead letter ids to why they were not replayed."""

    replayed: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    # Those of ``refused`` left alone for their status: already replayed (awaiting that
    # outcome), resolved. What a second operation over the same selection meets.
    skipped: set[int] = field(default_factory=set)

    def merge(self, other: ReplayResult) -> None:
        self.replayed.extend(other.replayed)
        self.refused.update(other.refused)
        self.skipped.update(other.skipped)


def stale_replays(now: dt.datetime | None = None) -> Q:
    """The dead letters replayed more than :data:`STALE_REPLAY_AFTER` ago and still awaiting
    the outcome (``updated_at`` is when the replay was queued)."""
    since = (now or timezone.now()) - STALE_REPLAY_AFTER
    return Q(status=DeadLetterStatus.REPLAYED, updated_at__lte=since)


def replayable(now: dt.datetime | None = None) -> Q:
    """The dead letters a replay takes (by status; :data:`UNREPLAYABLE_REASONS` aside)."""
    return Q(status__in=REPLAYABLE_STATUSES) | stale_replays(now)


def discardable(now: dt.datetime | None = None) -> Q:
    """The dead letters a discard takes: the dead ones, and replays presumed lost."""
    return Q(status=DeadLetterStatus.DEAD) | stale_replays(now)


# Why a replay refuses a dead letter, as a code (what a dry run groups by) and its label.
AWAITING_OUTCOME = "awaiting_outcome"
NOT_REPLAYABLE_STATUS = "status"
UNREPLAYABLE_REASON = "unreplayable_reason"
UNSENDABLE_BODY = "unsendable_body"
CELERY_TASK = "celery_task"
TASK_ROW_GONE = "task_row_gone"
ALREADY_PROCESSED = "already_processed"
REFUSAL_LABELS = {
    AWAITING_OUTCOME: "replayed recently, awaiting that outcome",
    NOT_REPLAYABLE_STATUS: "status not dead or discarded",
    UNREPLAYABLE_REASON: "would be refused again (no message_id, body not JSON, UTF-8 or empty)",
    UNSENDABLE_BODY: "body cannot travel through the outbox (not UTF-8 text, or a NUL)",
    CELERY_TASK: "a Celery task, not a message",
    TASK_ROW_GONE: "a django.tasks task with no row in the database",
    ALREADY_PROCESSED: "already processed by its consumer (force to run it again)",
}


class Refusal(NamedTuple):
    """Why a dead letter is not replayed: ``code`` (a key of :data:`REFUSAL_LABELS`) and the
    sentence an operator reads."""

    code: str
    text: str


def refusal(
    dead_letter: DeadLetter,
    *,
    already_processed: bool,
    force: bool,
    now: dt.datetime,
    body_replaced: bool = False,
    task_row_gone: bool = False,
) -> Refusal | None:
    """Why a replay now would refuse ``dead_letter`` (None: it would replay it), the rule of
    replays, dry runs and edited replays (``body_replaced``: the original's body is no ground;
    ``task_row_gone``: a task's letter whose row :func:`missing_task_rows` found gone)."""
    if dead_letter.status == DeadLetterStatus.REPLAYED:
        if dead_letter.updated_at > now - STALE_REPLAY_AFTER:
            return Refusal(
                AWAITING_OUTCOME,
                f"it was replayed at {dead_letter.updated_at:%Y-%m-%d %H:%M:%S} UTC and is "
                f"awaiting that outcome; if none comes, it can be replayed again or discarded "
                f"{_duration(STALE_REPLAY_AFTER)} after the replay",
            )
    elif dead_letter.status not in REPLAYABLE_STATUSES:
        return Refusal(
            NOT_REPLAYABLE_STATUS, f"its status is {dead_letter.status}, not dead or discarded"
        )
    if not body_replaced:
        unreplayable = UNREPLAYABLE_REASONS.get(DeadLetterReason(dead_letter.reason))
        if unreplayable:
            return Refusal(UNREPLAYABLE_REASON, unreplayable)
        unsendable = _unsendable_body(bytes(dead_letter.body))
        if unsendable:
            return Refusal(UNSENDABLE_BODY, unsendable)
    if CELERY_TASK_HEADER in (dead_letter.headers or {}):
        return Refusal(
            CELERY_TASK,
            "it is a Celery task whose worker died on it, not a message a replay could "
            "publish; discard it and call the task again",
        )
    if task_row_gone:
        return Refusal(
            TASK_ROW_GONE,
            f"no row of task {dead_letter.message_id} is in the database (deleted, never "
            "enqueued there, or in another one), and a task's message only names its row: a "
            "replay would run nothing; discard it and enqueue the task again",
        )
    if already_processed and not force:
        return Refusal(
            ALREADY_PROCESSED,
            f"consumer {dead_letter.consumer} already processed message "
            f"{dead_letter.message_id}; replaying it would not run the handler (force it to "
            f"forget that and run it again)",
        )
    return None


@dataclass
class Judgement:
    """What a replay does with a batch of dead letters (:func:`judge`): ``chosen`` are
    replayed, as ``(dead letter, forced)`` (forced: its inbox row is forgotten first)."""

    chosen: list[tuple[DeadLetter, bool]] = field(default_factory=list)
    refused: dict[int, Refusal] = field(default_factory=dict)
    # Those of ``refused`` left alone for their status (see ReplayResult.skipped).
    skipped: set[int] = field(default_factory=set)


def judge(
    letters: Iterable[DeadLetter],
    processed: Container[tuple[str, str]],
    *,
    force: bool,
    now: dt.datetime,
    rows_gone: Container[int] = (),
) -> Judgement:
    """Judge each dead letter by :func:`refusal`, given the ``(consumer, message_id)`` pairs
    of the inbox among them and the letters whose task's row is gone; pure (it reads and
    writes nothing)."""
    judgement = Judgement()
    for dead_letter in letters:
        already = (dead_letter.consumer, dead_letter.message_id) in processed
        refused = refusal(
            dead_letter,
            already_processed=already,
            force=force,
            now=now,
            task_row_gone=dead_letter.pk in rows_gone,
        )
        if refused is not None:
            judgement.refused[dead_letter.pk] = refused
            if dead_letter.status not in REPLAYABLE_STATUSES:
                judgement.skipped.add(dead_letter.pk)
            continue
        judgement.chosen.append((dead_letter, already))
    return judgement


def judge_batch(
    ids: Iterable[int],
    *,
    force: bool = False,
    now: dt.datetime | None = None,
    using: str | None = None,
    lock: bool = False,
) -> Judgement:
    """What :func:`replay_batch` does with the dead letters ``ids`` now, by :func:`judge`, read
    with their inbox rows (``lock``: locked for the replay; without, a dry run that writes and
    locks nothing; call it with bounded batches)."""
    rows = DeadLetter.objects.using(using or router.db_for_read(DeadLetter))
    if lock:
        rows = rows.select_for_update()
    letters = list(rows.filter(pk__in=list(ids)).only(*_REPLAY_FIELDS).order_by("pk"))
    keys = ProcessedMessage.objects.using(rows.db).processed_keys(
        d.message_id for d in letters if d.message_id
    )
    gone = missing_task_rows(letters, rows.db)
    return judge(letters, keys, force=force, now=now or timezone.now(), rows_gone=gone)


def missing_task_rows(letters: Iterable[DeadLetter], using: str) -> set[int]:
    """The ids of those of ``letters`` that are a task's (of a task queue's consumer) whose
    ``TaskRun`` row is not in ``using``, their own database (where a task's dead letter and
    its row are written together, and where a replay resets the row)."""
    tasks = {
        letter.pk: letter.message_id for letter in letters if is_task_consumer(letter.consumer)
    }
    if not tasks:
        return set()
    found = set(
        TaskRun.objects.using(using)
        .filter(pk__in=[task_id for task_id in tasks.values() if is_task_id(task_id)])
        .values_list("pk", flat=True)
    )
    return {pk for pk, task_id in tasks.items() if task_id not in found}


def _unsendable_body(body: bytes) -> str | None:
    """Why ``body`` cannot travel through the outbox's text column (not UTF-8, or a NUL)."""
    try:
        if "\x00" not in body.decode("utf-8"):
            return None
        what = "contains a NUL character"
    except UnicodeDecodeError:
        what = "is not UTF-8 text"
    return (
        f"its body {what}, so it cannot be sent again through the outbox (which stores text); "
        "publish a corrected copy yourself, or discard it"
    )


def _duration(delta: dt.timedelta) -> str:
    minutes = round(delta.total_seconds() / 60)
    return f"{minutes // 60} h" if minutes and minutes % 60 == 0 else f"{minutes} min"


def replay_headers(dead_letter: DeadLetter, replayed_by: str) -> dict[str, Any]:
    """The headers of ``dead_letter``'s replayed copy: its own, less those a replay resets,
    with where it came from and who replayed it."""
    headers = {k: v for k, v in (dead_letter.headers or {}).items() if k not in _RESET_HEADERS}
    headers[ORIGINAL_EXCHANGE_HEADER] = dead_letter.exchange
    headers[ORIGINAL_ROUTING_KEY_HEADER] = dead_letter.routing_key
    headers[REPLAY_HEADER] = dead_letter.replay_count + 1
    headers[REPLAYED_BY_HEADER] = replayed_by
    headers[DEAD_LETTER_ID_HEADER] = dead_letter.pk
    # Stored names may be longer than AMQP's short string (an escaped name that was not UTF-8).
    return wire_headers(headers)


def traced(
    headers: dict[str, Any],
    dead_letter: DeadLetter,
    replayed_by: str,
    message_id: str | None = None,
) -> dict[str, Any]:
    """With tracing on, the copy (of ``message_id``, the dead letter's own unless edited)
    starts a trace of its own, whose ``replay`` span links to the failure it replays; off, it
    keeps the context the message came with."""
    span, carrier = tracing.start_replay(
        dead_letter=dead_letter.pk,
        consumer=dead_letter.consumer,
        queue=dead_letter.queue,
        message_id=dead_letter.message_id if message_id is None else message_id,
        trace_id=dead_letter.trace_id,
        span_id=dead_letter.span_id,
        replayed_by=replayed_by,
    )
    if span is not None:
        for name in TRACE_HEADERS:
            headers.pop(name, None)
        headers.update(carrier)
        tracing.end(span)
    return headers


def replay_batch(
    ids: Iterable[int], *, replayed_by: str, force: bool = False, operation: int | None = None
) -> ReplayResult:
    """Replay the given dead letters in one transaction (call it with bounded batches), each
    judged by :func:`judge`, set-based: one locking SELECT, one inbox lookup, one COPY of the
    outbox rows, one UPDATE of the dead letters. ``operation``: the bulk operation doing it."""
    using = router.db_for_write(DeadLetter)
    now = timezone.now()
    details = {} if operation is None else {"operation": operation}
    with transaction.atomic(using=using):
        # Locked in pk order, so two replays of overlapping selections never deadlock; the
        # second one waits, then finds these "replayed" and refuses them.
        judgement = judge_batch(ids, force=force, now=now, using=using, lock=True)
        chosen = judgement.chosen
        result = ReplayResult(
            replayed=[dead_letter.pk for dead_letter, _forced in chosen],
            refused={pk: why.text for pk, why in judgement.refused.items()},
            skipped=judgement.skipped,
        )
        # Forced: forget the inbox row, or the consumer would ack the copy as a duplicate.
        forced = [dead_letter for dead_letter, already in chosen if already]
        # The ledger's rows first: each copy names its own.
        entries = _record_replays(using, chosen, replayed_by, operation, now)
        copies = [
            outbox_row(
                dead_letter,
                dead_letter.message_id,
                bytes(dead_letter.body).decode("utf-8"),
                traced(
                    {**replay_headers(dead_letter, replayed_by), REPLAY_ID_HEADER: entry.pk},
                    dead_letter,
                    replayed_by,
                ),
            )
            for (dead_letter, _forced), entry in zip(chosen, entries, strict=True)
        ]
        if forced:
            ProcessedMessage.objects.using(using).forget_many(
                (dead_letter.consumer, dead_letter.message_id) for dead_letter in forced
            )
            # A task's result too (its message's id is its task's), or the copy would run it
            # without starting it: no RUNNING, no attempt counted, no signals.
            TaskRun.objects.using(using).run_again(
                {
                    letter.message_id: _named_task(letter.message_id, bytes(letter.body))
                    for letter in forced
                    if is_task_consumer(letter.consumer)
                }
            )
        # In pk order: the outbox ids keep the dead letters' order, and so each ordering key's.
        insert_copies(using, copies)
        rows = DeadLetter.objects.using(using)
        for was_forced in (False, True):
            if pks := [letter.pk for letter, already in chosen if already == was_forced]:
                rows.mark_replayed_in_bulk(
                    pks, by=replayed_by, forced=was_forced, at=now, **details
                )
    if result.replayed:
        # One line a batch (a bulk replay writes thousands a second); each message's at DEBUG.
        logger.info(
            "replay of %d dead letter(s) queued by %s (message_id=%s ... %s)",
            len(result.replayed),
            replayed_by,
            copies[0][0],
            copies[-1][0],
        )
        if logger.isEnabledFor(logging.DEBUG):
            for copy in copies:
                logger.debug(
                    "replay of message_id=%s to queue %s queued by %s",
                    copy[0],
                    copy[2],
                    replayed_by,
                )
    return result


def _named_task(message_id: str, body: bytes) -> object:
    """The task a task's message (``{"task_id", "task"}``) names, if it is that task's own (its
    ``task_id`` its message_id; run_task runs no other)."""
    try:
        message = json.loads(body)
    except ValueError:
        return None
    if not isinstance(message, dict) or message.get("task_id") != message_id:
        return None
    return message.get("task")


def _record_replays(
    using: str,
    chosen: list[tuple[DeadLetter, bool]],
    replayed_by: str,
    operation: int | None,
    now: dt.datetime,
) -> list[Replay]:
    """The replay ledger's rows of a batch (``(dead letter, forced)`` pairs), with their ids."""
    entries = [
        Replay(
            dead_letter_id=dead_letter.pk,
            operation_id=operation,
            consumer=dead_letter.consumer,
            message_id=dead_letter.message_id,
            kind=ReplayKind.FORCED if forced else ReplayKind.REPLAY,
            replayed_by=replayed_by,
            replayed_at=now,
        )
        for dead_letter, forced in chosen
    ]
    if not entries:
        return []
    created = Replay.objects.using(using).bulk_create(entries)
    if any(entry.pk is None for entry in created):  # a database that returns no ids
        for entry in created:
            entry.save(using=using, force_insert=True)
    return created


# What a replay reads of a dead letter: not its payload, traceback or history, which can be large.
_REPLAY_FIELDS = (
    *("message_id", "consumer", "queue", "exchange", "routing_key", "headers", "body", "reason"),
    *("status", "replay_count", "updated_at", "trace_id", "span_id"),
)
_OUTBOX_COLUMNS = (
    *("message_id", "exchange", "routing_key", "body", "headers", "ordering_key", "status"),
    *("attempts", "last_error"),
)
_NEW_ROW = (OutboxStatus.PENDING, 0, "")  # status, attempts, last_error
# Set by insert_copies from the database's clock, which the relay compares them with (``Now()``): a
# web server whose clock runs ahead would otherwise hold every replay back by the difference.
_OUTBOX_TIME_COLUMNS = ("next_attempt_at", "created_at")


def outbox_row(
    dead_letter: DeadLetter, message_id: str, body: str, headers: dict[str, Any]
) -> tuple[Any, ...]:
    """The outbox row (values of :data:`_OUTBOX_COLUMNS`) of a copy of ``dead_letter``: through
    the default exchange (""), straight to the failed consumer's queue."""
    ordering_key = (dead_letter.headers or {}).get(ORDERING_KEY_HEADER)
    return (message_id, "", dead_letter.queue, body, headers, ordering_key, *_NEW_ROW)


def insert_copies(using: str, copies: list[tuple[Any, ...]]) -> None:
    """Write the outbox rows of a batch (values of :data:`_OUTBOX_COLUMNS`), due now by the
    database's clock: with COPY on PostgreSQL, ``bulk_create`` elsewhere."""
    if not copies:
        return
    connection = connections[using]
    if connection.vendor != "postgresql":
        times = dict.fromkeys(_OUTBOX_TIME_COLUMNS, Now())
        OutboxMessage.objects.using(using).bulk_create(
            OutboxMessage(**dict(zip(_OUTBOX_COLUMNS, row, strict=True)), **times) for row in copies
        )
        return
    from psycopg.types.json import Jsonb

    table = connection.ops.quote_name(OutboxMessage._meta.db_table)
    columns = ", ".join(
        connection.ops.quote_name(c) for c in (*_OUTBOX_COLUMNS, *_OUTBOX_TIME_COLUMNS)
    )
    headers = _OUTBOX_COLUMNS.index("headers")
    copy_sql = f"COPY {table} ({columns}) FROM STDIN"
    with connection.cursor() as cursor:
        # What Now() gives in this transaction (its start), as publish() writes it.
        cursor.execute("SELECT CURRENT_TIMESTAMP")
        (now,) = cursor.fetchone()
        due = (now,) * len(_OUTBOX_TIME_COLUMNS)
        with cursor.cursor.copy(copy_sql) as copy:
            for row in copies:
                copy.write_row((*row[:headers], Jsonb(row[headers]), *row[headers + 1 :], *due))


def replay(
    queryset: QuerySet[DeadLetter], *, replayed_by: str, force: bool = False, batch_size: int = 500
) -> ReplayResult:
    """Replay every dead letter of ``queryset``, ``batch_size`` per transaction."""
    result = ReplayResult()
    ids = list(queryset.order_by("pk").values_list("pk", flat=True))
    for start in range(0, len(ids), batch_size):
        result.merge(
            replay_batch(ids[start : start + batch_size], replayed_by=replayed_by, force=force)
        )
    return result


def discard(
    queryset: QuerySet[DeadLetter], *, discarded_by: str, operation: int | None = None
) -> list[int]:
    """Mark the :func:`discardable` ones of these dead letters "discarded" (kept for the record,
    not replayed); returns their ids. Locked first, so a replay under way keeps its own."""
    using = router.db_for_write(DeadLetter)
    now = timezone.now()
    details = {} if operation is None else {"operation": operation}
    with transaction.atomic(using=using):
        rows = DeadLetter.objects.using(using).filter(
            discardable(now), pk__in=queryset.values("pk")
        )
        ids = list(rows.select_for_update().order_by("pk").values_list("pk", flat=True))
        DeadLetter.objects.using(using).filter(pk__in=ids).discard(
            by=discarded_by, at=now, **details
        )
    return ids
