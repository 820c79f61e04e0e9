"""The idempotent consumer: each delivery's handler commits with its inbox row, or not at all.

:func:`process_batch` runs on a worker thread and decides a batch of deliveries in one
transaction along one path: the screens of :mod:`.pipeline`'s stages, the inbox claim, the
handler, the decision (:mod:`.retries` keeps the policy); it returns one :mod:`outcome
<reliable_messaging.core.outcomes>` per delivery, which the connection's thread carries out after
the commit. Every feature is a stage; none is called here by name. Which database errors are
not a handler's failure: :mod:`reliable_messaging.core.database_errors`.
``docs/design.md#batches-one-transaction-for-many-deliveries`` explains the optimistic and
guarded ways a batch runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)

from ..conf import MessagingSettings, messaging_settings
from ..core.database_errors import (
    CONFLICT_RETRIES,
    DatabaseTrouble,
    classify,
    conflict_delay,
    describe,
)
from ..core.envelope import DecodeError, Delivery, Message, decode_delivery
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel, RetryInPlace
from ..core.registry import ConsumerSpec
from ..exceptions import DatabaseConflict, DatabaseUnavailable
from ..models import ProcessedMessage
from ..storage.inbox import claim_inbox_rows, lock_wait_for, remember_busy
from .pipeline import BatchStages, Pipeline, default_pipeline
from .retries import DeliveryFailures
from .stage import DUPLICATE, Batch, DeliveryOutcome, Job, Processor

if TYPE_CHECKING:
    from .fastpath import DuplicateCache

logger = logging.getLogger(__name__)


class InboxClaimFailed(RuntimeError):
    """Our inbox claim failed for a reason that is neither a duplicate nor the database's
    known trouble: our own failure, never a handler's. The worker treats it as such (held,
    tried again, then a dead letter ``consumer_error``); it is not a database error, so no
    path that charges a handler for its database errors sees it."""


class DeliveryProcessor:
    """Runs ``spec``'s handler for deliveries, exactly once per (consumer, message_id)."""

    def __init__(
        self,
        spec: ConsumerSpec,
        settings: MessagingSettings = messaging_settings,
        cache: DuplicateCache | None = None,
        pipeline: Pipeline | None = None,
    ):
        self.spec = spec
        self.settings = settings
        self.cache = cache
        self.pipeline = pipeline or default_pipeline()
        self.using = router.db_for_write(ProcessedMessage)
        # Batches left to run guarded (a savepoint per handler) after a handler failed on the
        # optimistic path; see process_batch.
        self.guarded_batches = 0
        # What a delivery that did not take effect becomes (a dead letter, a retry, a deferral).
        self.failures = DeliveryFailures(spec, settings)

    @property
    def max_attempts(self) -> int:
        return self.failures.max_attempts

    def process(self, delivery: Delivery) -> Outcome:
        """Handle one delivery in its own transaction. Raises :class:`DatabaseUnavailable` when
        the database cannot be reached: the caller must hold the delivery and call again."""
        outcome = process_batch([Job(self, delivery)])[0]
        assert outcome is not None  # a lone delivery is never held behind another
        return outcome

    def decode(self, delivery: Delivery) -> Message | DecodeError:
        return decode_delivery(
            delivery,
            max_body_bytes=self.settings.max_body_bytes,
            derive_message_id=self.settings.derive_message_id,
        )

    def connection_usable(self) -> bool:
        """After a handler's savepoint rolled back on a database error: can the batch's
        transaction go on? (A lost connection cannot; a handler's bad query can.)"""
        try:
            with connections[self.using].cursor() as cursor:
                cursor.execute("SELECT 1")
        except Exception:  # noqa: BLE001 - any failure here means the transaction is gone
            return False
        return True

    def charge(self, job: Job, exc: Exception) -> DeliveryOutcome:
        """The delivery's own transaction could not commit (a deferred constraint its handler
        broke), or kept meeting conflicts past their bound: a failure of the handler like any
        other, decided outside that transaction."""
        if isinstance(job.message, DecodeError):  # cannot happen: those commit nothing of theirs
            raise DatabaseUnavailable(f"the commit failed: {exc}") from exc
        return self.failures.on_failure(job.delivery, job.message, exc, time.perf_counter())


def raise_database_trouble(
    exc: BaseException, message_id: str, lost: Callable[[], bool] | None = None
) -> None:
    """Raise :class:`DatabaseUnavailable` or :class:`DatabaseConflict` (from ``exc``) when
    ``exc`` is the database's doing, not the handler's (see
    :mod:`reliable_messaging.core.database_errors`); return otherwise. ``lost`` tells, for an
    ``OperationalError``/``InterfaceError`` the rules leave open (a statement timeout, say),
    whether the connection went with it."""
    if isinstance(exc, DatabaseUnavailable | DatabaseConflict):
        raise exc
    trouble = classify(exc)
    if trouble is DatabaseTrouble.CONFLICT:
        raise DatabaseConflict(f"{exc} (message_id={message_id})") from exc
    if trouble is DatabaseTrouble.UNAVAILABLE or (
        isinstance(exc, OperationalError | InterfaceError) and lost is not None and lost()
    ):
        raise DatabaseUnavailable(f"database error on message_id={message_id}: {exc}") from exc


def with_attempt(delivery: Delivery, retry: RetryInPlace) -> Delivery:
    """The same delivery, as its next in-place attempt will see it."""
    return dataclasses.replace(delivery, headers=dict(retry.headers))


# After a handler failed on the optimistic path, its consumer's next batches run guarded.
GUARDED_BATCHES_AFTER_FAILURE = 20


class _Fallback(Exception):
    """A handler failed on the optimistic path: roll the batch back, redo it guarded."""

    def __init__(self, processor: Processor, index: int, error: Exception) -> None:
        super().__init__(processor.spec.name)
        self.processor = processor
        self.index = index
        self.error = error


def process_batch(jobs: Sequence[Job]) -> list[Outcome | None]:
    """Decide ``jobs`` in one transaction; the outcomes are only valid once this returns.

    The result lists one outcome per job, in order. ``None`` marks a job that was not run
    because an earlier delivery of its queue must first be retried in place (ordered
    consumers): the caller runs it again after that one. The pipeline's stages open before the
    transaction and close after it (see :mod:`.pipeline`).

    A conflict the database reports runs the batch again, uncharged, up to a bound; past it a
    batch is decided one delivery per transaction (``docs/delivery-outcomes.md``).

    Raises :class:`DatabaseUnavailable` when the database cannot be reached or the commit
    fails for want of a connection: nothing of the batch took effect or was decided.
    """
    if not jobs:
        return []
    if len({job.processor.using for job in jobs}) > 1:
        # A router sending consumers to different databases: one transaction per database.
        return [outcome for job in jobs for outcome in process_batch([job])]
    batch = Batch(jobs, [None] * len(jobs))
    with jobs[0].processor.pipeline.around(batch) as stages:
        batch.decided[:] = _process_batch(jobs, list(batch.decided), stages)
    return [done.outcome if done is not None else None for done in batch.decided]


def _process_batch(
    jobs: Sequence[Job], settled: list[DeliveryOutcome | None], stages: BatchStages
) -> list[DeliveryOutcome | None]:
    """``jobs`` decided in one transaction, conflicts run again (see :func:`process_batch`);
    ``settled`` holds what the stages decided before it."""
    for retry in range(CONFLICT_RETRIES + 1):
        try:
            return _process_batch_once(jobs, settled, stages)
        except DatabaseConflict as exc:
            conflict = exc
            if retry < CONFLICT_RETRIES:
                delay = conflict_delay(retry)
                logger.info(
                    "database conflict (%s) on message_id=%s%s: running again in a new "
                    "transaction in %.2fs (%d of %d), not charged",
                    describe(exc),
                    jobs[0].delivery.message_id,
                    f" and {len(jobs) - 1} more" if len(jobs) > 1 else "",
                    delay,
                    retry + 1,
                    CONFLICT_RETRIES,
                )
                time.sleep(delay)
    if len(jobs) > 1:
        return _one_by_one(jobs, settled, stages)
    cause = conflict.__cause__
    logger.warning(
        "message_id=%s met database conflicts %d times in a row: charged as a failure of its "
        "handler",
        jobs[0].delivery.message_id,
        CONFLICT_RETRIES + 1,
    )
    error = cause if isinstance(cause, Exception) else conflict
    return [_charged(jobs[0], error, stages)]


def _process_batch_once(
    jobs: Sequence[Job], settled: list[DeliveryOutcome | None], stages: BatchStages
) -> list[DeliveryOutcome | None]:
    """One try at deciding ``jobs`` in one transaction: optimistic (no savepoints; a handler's
    failure redoes the batch guarded) or guarded (a savepoint per handler), with the same
    guarantees (``docs/design.md#batches-one-transaction-for-many-deliveries``)."""
    optimistic = all(job.processor.guarded_batches == 0 for job in jobs)
    for processor in {job.processor for job in jobs}:
        processor.guarded_batches = max(0, processor.guarded_batches - 1)
    try:
        try:
            return _decide(jobs, settled, stages, guarded=not optimistic)
        except _Fallback as fallback:
            fallback.processor.guarded_batches = GUARDED_BATCHES_AFTER_FAILURE
            # The handler that failed is not run again: its failure is decided as it was.
            failed = {fallback.index: fallback.error}
            return _decide(jobs, settled, stages, guarded=True, failed=failed)
    except _CommitRefused as refused:
        if len(jobs) == 1:
            return [_charged(jobs[0], refused.error, stages)]
        logger.warning(
            "a batch of %d deliveries failed to commit (%s: %s); deciding them one by one",
            len(jobs),
            type(refused.error).__name__,
            refused.error,
        )
        return _one_by_one(jobs, settled, stages)


class _CommitRefused(Exception):
    def __init__(self, error: DatabaseError) -> None:
        super().__init__(str(error))
        self.error = error


def _decide(
    jobs: Sequence[Job],
    settled: Sequence[DeliveryOutcome | None],
    stages: BatchStages,
    *,
    guarded: bool,
    failed: dict[int, Exception] | None = None,
) -> list[DeliveryOutcome | None]:
    """One transaction over the jobs not settled yet: the unordered ones screened, claimed in
    one statement and run; then each ordered one in arrival order, claimed and run in a
    savepoint of its own. ``failed`` holds the handler errors already seen (on the optimistic
    path) of jobs not to run again."""
    decided = list(settled)
    pending = [index for index, done in enumerate(decided) if done is None]
    if not pending:
        return decided
    failed = failed or {}
    using = jobs[0].processor.using
    try:
        with transaction.atomic(using=using):
            unordered = [i for i in pending if not jobs[i].processor.spec.ordered]
            _screen_claim_run(jobs, unordered, decided, stages, guarded, failed)
            held_queues: set[str] = set()
            for index in pending:
                job = jobs[index]
                if not job.processor.spec.ordered or job.delivery.queue in held_queues:
                    continue
                _screen_claim_run(jobs, [index], decided, stages, True, failed)
                if isinstance(getattr(decided[index], "outcome", None), RetryInPlace):
                    held_queues.add(job.delivery.queue)
    except (_Fallback, DatabaseUnavailable, DatabaseConflict):
        raise
    except DatabaseError as exc:
        # Raised by the commit or by our own statements (the inbox claim): never a handler's.
        trouble = classify(exc)
        if trouble is DatabaseTrouble.CONFLICT:
            raise DatabaseConflict(f"the batch's transaction: {exc}") from exc
        if trouble is DatabaseTrouble.UNAVAILABLE or isinstance(
            exc, OperationalError | InterfaceError
        ):
            raise DatabaseUnavailable(f"database error while committing a batch: {exc}") from exc
        # A deferred constraint (or the like) refused the commit: no savepoint can help.
        raise _CommitRefused(exc) from exc
    return decided


def _charged(job: Job, error: Exception, stages: BatchStages) -> DeliveryOutcome | None:
    """``job`` charged ``error`` (its transaction could not commit), decided and reported in a
    transaction of its own, as a batch's are (the stages lock rows, a task's among them)."""
    with transaction.atomic(using=job.processor.using):
        return _report(job, job.processor.charge(job, error), stages)


def _report(job: Job, done: DeliveryOutcome | None, stages: BatchStages) -> DeliveryOutcome | None:
    """Tell the stages what was decided, in the transaction that decided it (its own, for a
    delivery charged after its transaction failed)."""
    if done is not None and isinstance(job.message, Message):
        stages.decided(job, job.message, done)
    return done


def _screen_claim_run(
    jobs: Sequence[Job],
    indexes: list[int],
    decided: list[DeliveryOutcome | None],
    stages: BatchStages,
    guarded: bool,
    failed: dict[int, Exception],
) -> None:
    """Decide ``indexes`` into ``decided``, in the batch's transaction: each screened (or, in
    ``failed``, charged its handler's error seen on the optimistic path); the inbox rows of the
    rest claimed in one statement; then the handlers of the claimed ones run, optimistic (a
    handler error raises :class:`_Fallback`) or ``guarded`` (a savepoint each)."""
    for index in indexes:
        job, message = jobs[index], jobs[index].message
        if index in failed and isinstance(message, Message):
            done = job.processor.failures.on_failure(
                job.delivery, message, failed[index], time.perf_counter()
            )
            decided[index] = _report(job, done, stages)
        else:
            decided[index] = stages.screen(job, message)
    claim = [i for i in indexes if decided[i] is None]
    if not claim:
        return
    keys = [(jobs[i].name, jobs[i].message.message_id) for i in claim]
    claimed, busy = _claim(
        jobs[0].processor.using, keys, any(jobs[i].delivery.redelivered for i in claim)
    )
    seen: set[tuple[str, str]] = set()
    for index, key in zip(claim, keys, strict=True):
        job, message = jobs[index], jobs[index].message
        assert isinstance(message, Message)
        if key in busy:
            done = job.processor.failures.busy(job.delivery, message)
        elif key not in claimed or key in seen:
            done = DUPLICATE
        else:
            seen.add(key)
            done = _run(job, index, stages, guarded=guarded, copies_open=claimed[key])
        decided[index] = _report(job, done, stages)


def _claim(
    using: str, keys: list[tuple[str, str]], redelivered: bool
) -> tuple[dict[tuple[str, str], bool], set[tuple[str, str]]]:
    """The inbox claim of ``keys`` (see :func:`claim_inbox_rows`); our statement, before any
    handler ran, so its failure is the database's trouble or our own, never a handler's."""
    try:
        claimed, busy = claim_inbox_rows(using, keys, lock_wait_for(keys, redelivered))
    except DatabaseError as exc:
        raise_database_trouble(exc, keys[0][1])
        more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
        raise InboxClaimFailed(
            f"the inbox claim of message_id={keys[0][1]}{more} failed: {exc}"
        ) from exc
    remember_busy(busy)
    return claimed, busy


def _run(
    job: Job, index: int, stages: BatchStages, *, guarded: bool, copies_open: bool
) -> DeliveryOutcome:
    """Run the handler of ``job``, its inbox row claimed, in a savepoint when ``guarded``; the
    outcome of its success or failure."""
    processor, message = job.processor, job.message
    assert isinstance(message, Message)
    started = time.perf_counter()
    try:
        savepoint = transaction.atomic(using=processor.using) if guarded else nullcontext()
        with savepoint, stages.handling(job, message):
            processor.spec.handler(job.for_handler or message)
    except (DatabaseUnavailable, DatabaseConflict):
        raise
    except Exception as exc:  # any handler error is an outcome to decide on
        if not guarded:
            # The batch is redone guarded, this failure decided there. Not the handler's
            # failure when the database did it: deciding it would spend an attempt on the
            # database's outage or conflict. Nothing is decided then.
            raise_database_trouble(
                exc, message.message_id, lost=lambda: _connection_lost(processor.using)
            )
            raise _Fallback(processor, index, exc) from exc
        raise_database_trouble(
            exc, message.message_id, lost=lambda: not processor.connection_usable()
        )
        # Its effects rolled back with the savepoint; its inbox row, claimed before, goes too.
        ProcessedMessage.objects.using(processor.using).forget(job.name, message.message_id)
        return processor.failures.on_failure(job.delivery, message, exc, started)
    return DeliveryOutcome(
        Acknowledge(OutcomeLabel.PROCESSED),
        OutcomeLabel.PROCESSED,
        time.perf_counter() - started,
        processed=True,
        copies_open=copies_open,
    )


def _connection_lost(using: str) -> bool:
    """After a handler's database error on the optimistic path: is the connection gone?

    Without a savepoint to roll back to, a failed statement leaves the transaction aborted, so a
    probe query fails whether or not the connection lives: what tells them apart is that a live
    server answers (``current transaction is aborted``, an InternalError) while a lost
    connection raises OperationalError or InterfaceError without one.
    """
    try:
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT 1")
    except (OperationalError, InterfaceError):
        return True
    except Exception:  # noqa: BLE001 - the server answered: the connection (and transaction) live
        return False
    return False


def _one_by_one(
    jobs: Sequence[Job], settled: Sequence[DeliveryOutcome | None], stages: BatchStages
) -> list[DeliveryOutcome | None]:
    decided: list[DeliveryOutcome | None] = []
    held_queues: set[str] = set()
    for job, done in zip(jobs, settled, strict=True):
        if job.delivery.queue in held_queues:
            decided.append(None)
            continue
        if done is None:
            done = _process_batch([job], [None], stages)[0]
        decided.append(done)
        if done is not None and isinstance(done.outcome, RetryInPlace):
            held_queues.add(job.delivery.queue)
    return decided
