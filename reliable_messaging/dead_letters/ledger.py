"""The replay ledger: each replay of a dead letter, and what became of its copy, settled in the
transaction that decided it (``docs/operations.md``, the replay ledger). Only a copy we sent to
its queue is taken at its word: a header a producer wrote settles nothing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

from django.db.models import QuerySet
from django.utils import timezone

from .. import tracing
from ..choices import ReplayKind, ReplayOutcome
from ..core.envelope import REPLAY_HEADER, REPLAY_ID_HEADER, Delivery, sent_to_its_queue
from ..managers import TALLIED_OUTCOMES
from ..models import DeadLetter, DeadLetterOperation, Replay, ReplayOutcomeTally


def _own_row(delivery: Delivery, consumer: str, message_id: str, using: str) -> QuerySet[Replay]:
    """The ledger row a replayed copy names, when the copy came the way ours come (else none)."""
    if not sent_to_its_queue(delivery):
        return Replay.objects.none()
    raw = delivery.headers.get(REPLAY_ID_HEADER)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        return Replay.objects.none()
    return Replay.objects.using(using).filter(pk=raw, consumer=consumer, message_id=message_id)


def replayed_dead_letter(
    delivery: Delivery, consumer: str, message_id: str, using: str
) -> int | None:
    """The id of the dead letter this copy replays (an edited copy's message_id is not its
    dead letter's), or None when the copy names no ledger row of its own."""
    row = _own_row(delivery, consumer, message_id, using)
    return row.values_list("dead_letter_id", flat=True).first()


def settle_processed(
    delivery: Delivery,
    consumer: str,
    message_id: str,
    *,
    using: str,
    duplicate: bool = False,
    resolve_open: bool = True,
) -> None:
    """A copy of ``message_id`` was processed by ``consumer`` (``duplicate``: by another copy):
    a replayed copy resolves its dead letter and settles its ledger row; any other copy resolves
    its message's open dead letters when ``resolve_open`` (the inbox claim said one may be)."""
    if REPLAY_HEADER not in delivery.headers:
        if resolve_open and not duplicate:
            _resolve_processed_copy(consumer, message_id, using)
        return
    traced = tracing.ids_of(delivery)
    trace_id = traced[0] if traced else None
    if duplicate:
        # Another copy (published twice, sent again by a relay) was processed after the
        # replay was queued: the dead letter is done with. Left "replayed", an ordered
        # consumer's would park its key for good.
        _resolve_processed_copy(
            consumer,
            message_id,
            using,
            by="its replay found it processed by another copy",
            trace_id=trace_id,
        )
        outcome = ReplayOutcome.DUPLICATE
    else:
        DeadLetter.objects.using(using).of(consumer, message_id).resolve(
            at=timezone.now(), trace_id=trace_id
        )
        outcome = ReplayOutcome.PROCESSED
    settle(delivery, consumer, message_id, outcome, using=using, trace_id=trace_id)


def _resolve_processed_copy(
    consumer: str,
    message_id: str,
    using: str,
    *,
    by: str = "a later copy was processed",
    trace_id: str | None = None,
) -> None:
    """Resolve the open dead letter of ``consumer`` whose message another copy just processed
    (published twice, or sent again after a lost confirm); ``by`` goes into its history. One
    indexed query; the row is locked only when there is something to resolve."""
    open_letters = DeadLetter.objects.using(using).open().of(consumer, message_id)
    if open_letters.exists():
        open_letters.resolve(at=timezone.now(), by=by, trace_id=trace_id)


def settle(
    delivery: Delivery,
    consumer: str,
    message_id: str,
    outcome: ReplayOutcome,
    *,
    using: str,
    failed_as: DeadLetter | None = None,
    trace_id: str | None = None,
) -> Replay | None:
    """Record what became of a replayed copy, inside the transaction that decided it; None
    when ``delivery`` is no replayed copy of ours still in flight. An edited copy stands for
    the dead letter it was edited from (resolved, or superseded by the new one)."""
    own = _own_row(delivery, consumer, message_id, using)
    row = own.select_for_update().filter(outcome=ReplayOutcome.IN_FLIGHT).first()
    if row is None:
        return None
    now = timezone.now()
    settle_row(row, outcome, using=using, failed_as=failed_as, at=now)
    if row.kind != ReplayKind.EDITED:
        return row
    letters = DeadLetter.objects.using(using)
    original = letters.open().filter(pk=row.dead_letter_id)
    if outcome == ReplayOutcome.FAILED_AGAIN and failed_as is not None:
        if failed_as.pk != row.dead_letter_id:
            letters.filter(pk=failed_as.pk).update(replay_of=row.dead_letter_id)
            original.resolve(
                at=now,
                by=f"its edited copy {message_id} failed again as dead letter #{failed_as.pk}",
                trace_id=trace_id,
            )
    elif outcome in (ReplayOutcome.PROCESSED, ReplayOutcome.DUPLICATE):
        original.resolve(
            at=now, by=f"its edited copy {message_id} was processed", trace_id=trace_id
        )
    return row


def settle_row(
    row: Replay,
    outcome: ReplayOutcome,
    *,
    using: str,
    failed_as: DeadLetter | None = None,
    at: dt.datetime | None = None,
) -> None:
    """Record ``outcome`` on the ledger row of a replay in flight, locked by the caller, and
    count it in its operation's tally, in the caller's transaction."""
    row.outcome = outcome
    row.outcome_at = at or timezone.now()
    row.failed_as = failed_as
    row.save(using=using, update_fields=["outcome", "outcome_at", "failed_as"])
    if row.operation_id is not None:
        ReplayOutcomeTally.objects.using(using).add(row.operation_id, outcome)


def outcome_counts(operation: DeadLetterOperation) -> Mapping[str, int]:
    """How many of an operation's replays reached each outcome so far (every outcome named):
    its tally plus those in flight, never a count of its ledger rows."""
    try:
        tally: ReplayOutcomeTally | None = operation.replay_outcomes
    except ReplayOutcomeTally.DoesNotExist:
        tally = None
    settled = {str(outcome): getattr(tally, str(outcome), 0) for outcome in TALLIED_OUTCOMES}
    in_flight = max(0, operation.replayed - sum(settled.values()))
    return {ReplayOutcome.IN_FLIGHT.value: in_flight, **settled}


def failed_again(operation_id: int, limit: int) -> list[Replay]:
    """The first ``limit`` replays of an operation that failed again, by id, with the dead
    letter each became (``failed_as``; the index on operation and outcome finds them)."""
    return list(
        Replay.objects.filter(operation_id=operation_id, outcome=ReplayOutcome.FAILED_AGAIN)
        .select_related("failed_as")
        .only(
            "pk",
            "dead_letter_id",
            "consumer",
            "message_id",
            "outcome_at",
            "failed_as__id",
            "failed_as__exception_type",
            "failed_as__exception_message",
            "failed_as__status",
        )
        .order_by("pk")[:limit]
    )
