"""Carrying out the bulk replays and discards recorded in the admin, a batch per transaction, in
the relay's child process (``docs/design.md#dead-letters-replay-and-bulk-operations``)."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, router, transaction
from django.utils import timezone

from ..choices import OperationKind
from ..models import DeadLetter, DeadLetterGroup, DeadLetterOperation
from .replay import discard, judge_batch, replay_batch
from .selection import matching, targets, unreplayable, wanted

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 1000
# Counts of a confirmation page stop here (a count past it is "more than", and bounds nothing).
COUNT_CAP = 100_000
# A batch that raises this many times in a row stops its operation (state "failed").
FAILURES_BEFORE_GIVING_UP = 5
# How often the runner folds the failure groups' deltas (seconds), and at most how many fold
# transactions it runs then: a fold only has to keep the deltas few.
FOLD_INTERVAL = 5.0
FOLD_BATCHES = 20
# A dry run looks at this many of the matching dead letters at most, DRY_RUN_BATCH at a time.
DRY_RUN_LIMIT = 10_000
DRY_RUN_BATCH = 1000
# Dead letter ids a dry run keeps per refusal, as examples.
DRY_RUN_EXAMPLES = 5


@dataclass
class DryRun:
    """What an operation would do with the first ``examined`` dead letters matching
    (``limited``: more match): ``done`` (``forced`` of them), ``refused`` by refusal code with
    a few ``examples``, ``skipped`` for their status or a reason that would fail again."""

    kind: str
    examined: int = 0
    limited: bool = False
    done: int = 0
    forced: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)
    skipped: int = 0

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())


def dry_run(
    kind: str,
    selection: Mapping[str, Any],
    *,
    force: bool = False,
    max_pk: int | None = None,
    limit: int = DRY_RUN_LIMIT,
    now: dt.datetime | None = None,
) -> DryRun:
    """What an operation of ``kind`` over ``selection`` (up to ``max_pk``) would do now with
    the first ``limit`` of them, judged as ``replay_batch`` judges; reads only."""
    now = now or timezone.now()
    result = DryRun(kind=kind)
    rows = matching(selection)
    if max_pk is not None:
        rows = rows.filter(pk__lte=max_pk)
    window = list(rows.order_by("pk").values_list("pk", flat=True)[: limit + 1])
    result.limited = len(window) > limit
    window = window[:limit]
    result.examined = len(window)
    if not window:
        return result
    # The first ``limit`` matching ones by id are exactly those up to the last one's id.
    # Taken as the operation takes them (``targets``): a reason a replay would fail again is
    # left out from the start, like a status, not refused.
    taken = list(
        rows.filter(wanted(kind, selection, now), pk__lte=window[-1])
        .exclude(reason__in=unreplayable(kind))
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    result.skipped = len(window) - len(taken)
    if kind != OperationKind.REPLAY:
        result.done = len(taken)
        return result
    for start in range(0, len(taken), DRY_RUN_BATCH):
        judgement = judge_batch(taken[start : start + DRY_RUN_BATCH], force=force, now=now)
        result.done += len(judgement.chosen)
        result.forced += sum(1 for _letter, forced in judgement.chosen if forced)
        result.skipped += len(judgement.skipped)
        for pk, why in judgement.refused.items():
            if pk in judgement.skipped:
                continue
            result.refused[why.code] = result.refused.get(why.code, 0) + 1
            examples = result.examples.setdefault(why.code, [])
            if len(examples) < DRY_RUN_EXAMPLES:
                examples.append(pk)
    return result


def run_batch(batch_size: int = DEFAULT_BATCH_SIZE) -> DeadLetterOperation | None:
    """Run the next batch of the oldest operation nobody else is running, in one transaction;
    returns that operation, or None when there was none."""
    using = router.db_for_write(DeadLetterOperation)
    operations = DeadLetterOperation.objects.using(using)
    with transaction.atomic(using=using):
        operation = operations.claim_next()
        if operation is None:
            return None
        now = timezone.now()
        left = (
            targets(operation.kind, operation.selection, now)
            .using(using)
            .filter(pk__gt=operation.cursor, pk__lte=operation.max_pk)
            .order_by("pk")
        )
        announced_left = (
            operation.matched - operation.done if operation.matched <= COUNT_CAP else batch_size
        )
        ids = list(left.values_list("pk", flat=True)[: max(0, min(batch_size, announced_left))])
        if not ids:
            if announced_left <= 0 and left.exists():
                error = (
                    f"Stopped after the {operation.matched} dead letter(s) its confirmation "
                    f"announced: more match its selection now (they failed again or changed "
                    f"status since). They were left as they are; start another operation to "
                    f"take them."
                )
                operations.fail(operation.pk, error=error, at=now)
                logger.warning("dead letter operation %s: %s", operation.pk, error)
                return operation
            operations.finish(operation, at=now)
            logger.info("dead letter operation %s done: %s", operation.pk, _counts(operation))
            return operation
        by, pk = operation.requested_by, operation.pk
        if operation.kind == OperationKind.REPLAY:
            result = replay_batch(ids, replayed_by=by, force=operation.force, operation=pk)
            skipped = len(result.skipped)
            counts = {"replayed": len(result.replayed), "refused": len(result.refused) - skipped}
        else:
            rows = DeadLetter.objects.using(using).filter(pk__in=ids)
            counts = {"discarded": len(discard(rows, discarded_by=by, operation=pk))}
            skipped = len(ids) - counts["discarded"]
        operations.advance(operation, cursor=ids[-1], at=now, skipped=skipped, **counts)
    return operation


def _counts(operation: DeadLetterOperation) -> str:
    return (
        f"{operation.replayed} replayed, {operation.discarded} discarded, "
        f"{operation.refused} refused, {operation.skipped} skipped"
    )


def run_pending_operations(batch_size: int = DEFAULT_BATCH_SIZE) -> int:
    """Run batches until no operation is left; returns how many ran."""
    batches = 0
    while run_batch(batch_size) is not None:
        batches += 1
    return batches


class OperationRunner(threading.Thread):
    """A thread that runs the recorded operations batch after batch, else looks every ``interval``
    seconds; a batch failing :data:`FAILURES_BEFORE_GIVING_UP` times in a row stops its operation.
    Every ``fold_interval`` seconds (None: never) it folds the failure groups' deltas."""

    def __init__(
        self,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        interval: float = 1.0,
        on_batch: Callable[[], None] | None = None,
        fold_interval: float | None = FOLD_INTERVAL,
    ) -> None:
        super().__init__(name="dead-letter-operations", daemon=True)
        self.batch_size = batch_size
        self.interval = interval
        self.on_batch = on_batch
        self.fold_interval = fold_interval
        self._stopping = threading.Event()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch under way (its transaction commits or rolls back whole)."""
        self._stopping.set()
        self.join(timeout=timeout)

    def run(self) -> None:
        failures: dict[int, int] = {}
        next_fold = time.monotonic()
        try:
            while not self._stopping.is_set():
                if self.fold_interval is not None and time.monotonic() >= next_fold:
                    next_fold = time.monotonic() + self.fold_interval
                    self._fold()
                try:
                    operation = run_batch(self.batch_size)
                except Exception as exc:  # noqa: BLE001 - the database may be down: retried
                    self._failed(failures, exc)
                    connections.close_all()
                    self._stopping.wait(self.interval)
                    continue
                if operation is None:
                    # Kept for the next look, unless broken (then the next look reconnects).
                    for connection in connections.all(initialized_only=True):
                        connection.close_if_unusable_or_obsolete()
                    self._stopping.wait(self.interval)
                    continue
                failures.pop(operation.pk, None)
                if self.on_batch is not None:
                    self.on_batch()
        finally:
            connections.close_all()

    def _fold(self) -> None:
        try:
            groups = DeadLetterGroup.objects.using(router.db_for_write(DeadLetterGroup))
            folded = groups.fold(batches=FOLD_BATCHES)
        except Exception as exc:  # noqa: BLE001 - the database may be down: folded next time
            logger.warning(
                "folding the failure groups' deltas failed: %s: %s", type(exc).__name__, exc
            )
            return
        if folded:
            logger.debug("folded %d failure group delta(s)", folded)

    def _failed(self, failures: dict[int, int], exc: Exception) -> None:
        using = router.db_for_write(DeadLetterOperation)
        error = f"{type(exc).__name__}: {exc}"
        try:
            unfinished = DeadLetterOperation.objects.using(using).unfinished()
            pk = unfinished.order_by("pk").values_list("pk", flat=True).first()
        except Exception:  # noqa: BLE001 - the database is down: nothing to count against
            pk = None
        logger.warning("a dead letter operation batch failed, trying again: %s", error)
        if pk is None:
            return
        failures[pk] = failures.get(pk, 0) + 1
        if failures[pk] >= FAILURES_BEFORE_GIVING_UP:
            DeadLetterOperation.objects.using(using).fail(pk, error=error, at=timezone.now())
            logger.error("dead letter operation %s stopped: %s", pk, error)
