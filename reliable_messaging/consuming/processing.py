"""The idempotent consumer: each delivery's handler commits with its inbox row, or not at all.

:func:`process_batch` runs on a worker thread and decides a batch of deliveries in one transaction,
returning one :mod:`outcome <reliable_messaging.core.outcomes>` per delivery, which the connection's
thread carries out after the commit. What a failed delivery becomes is decided in :mod:`.retries`;
which database errors are not its handler's failure in
:mod:`reliable_messaging.core.database_errors`; the inbox rows are written by
:mod:`reliable_messaging.storage.inbox`.
``docs/design.md#batches-one-transaction-for-many-deliveries`` explains the optimistic and guarded
ways a batch runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)

from .. import metrics, tracing
from ..choices import DeadLetterReason, ReplayOutcome
from ..conf import MessagingSettings, messaging_settings
from ..core.database_errors import (
    CONFLICT_RETRIES,
    DatabaseTrouble,
    classify,
    conflict_delay,
    describe,
    sqlstate,
)
from ..core.envelope import (
    REPLAY_HEADER,
    DecodeError,
    Delivery,
    Message,
    decode_delivery,
)
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel, RetryInPlace
from ..core.registry import ConsumerSpec
from ..core.routing import topic_matches
from ..dead_letters import ledger
from ..dead_letters.replay import mark_resolved, resolve_processed_copies
from ..exceptions import DatabaseConflict, DatabaseUnavailable
from ..models import DeadLetter, ProcessedMessage
from ..storage.inbox import (
    CLAIM_VENDORS,
    InboxRowBusy,
    claim_inbox_rows,
    claimed_atomic,
    lock_wait_for,
    remember_busy,
)
from .expiry import expiry_of
from .fastpath import DuplicateCache
from .retries import DeliveryFailures, DeliveryOutcome
from .time_limit import time_limits

logger = logging.getLogger(__name__)


class _AlreadyProcessed(Exception):
    """The message's inbox row is there already: a duplicate."""


class InboxClaimFailed(RuntimeError):
    """Our inbox claim failed for a reason that is neither a duplicate nor the database's
    known trouble: our own failure, never a handler's. The worker treats it as such (held,
    tried again, then a dead letter ``consumer_error``); it is not a database error, so no
    path that charges a handler for its database errors sees it."""


UNIQUE_VIOLATION = "23505"


@dataclasses.dataclass(frozen=True)
class Job:
    """One delivery for one consumer, as a worker hands it to :func:`process_batch`."""

    processor: DeliveryProcessor
    delivery: Delivery


class DeliveryProcessor:
    """Runs ``spec``'s handler for deliveries, exactly once per (consumer, message_id)."""

    def __init__(
        self,
        spec: ConsumerSpec,
        settings: MessagingSettings = messaging_settings,
        cache: DuplicateCache | None = None,
    ):
        self.spec = spec
        self.settings = settings
        self.cache = cache
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
        outcome = process_batch([Job(self, delivery)], cache=self.cache)[0]
        assert outcome is not None  # a lone delivery is never held behind another
        return outcome

    @property
    def timeout(self) -> float:
        return self.spec.timeout or self.settings.handler_timeout

    def call_handler(self, message: Message, delivery: Delivery) -> None:
        """Run the handler (inside the caller's transaction) under its time limit: past it, it
        raises :class:`~reliable_messaging.exceptions.HandlerTimeout` (see :mod:`.time_limit`).
        With tracing on, the delivery's span is the current one meanwhile."""
        with (
            tracing.handling(delivery),
            time_limits.limit(self.timeout, self.spec.name, message.message_id),
        ):
            self.spec.handler(message)

    def decode(self, delivery: Delivery) -> Message | DecodeError:
        return decode_delivery(
            delivery,
            max_body_bytes=self.settings.max_body_bytes,
            derive_message_id=self.settings.derive_message_id,
        )

    # -- inside the batch's transaction -----------------------------------------------------------

    def run(self, delivery: Delivery, decoded: Message | DecodeError) -> DeliveryOutcome:
        """Decide one delivery inside the caller's transaction; its writes are in savepoints."""
        if isinstance(decoded, DecodeError):
            return self.failures.reject_undecodable(delivery, decoded)
        if not self._expects(decoded.routing_key):
            return self.failures.reject(
                delivery,
                decoded,
                DeadLetterReason.UNEXPECTED_ROUTING_KEY,
                f"routing key {decoded.routing_key!r} matches none of the consumer's bindings "
                f"{list(self.spec.bindings)!r}: the message reached the queue some other way "
                f"(published straight to the queue, or a stale binding)",
            )
        late = expiry_of(delivery, decoded, self.spec)
        if late is not None:
            return self._expire(delivery, decoded, late)
        blocker = self._blocking_dead_letter(delivery, decoded)
        if blocker is not None:
            return self.failures.reject(
                delivery,
                decoded,
                DeadLetterReason.PARKED,
                f"ordering key {decoded.ordering_key!r} is parked behind dead letter "
                f"#{blocker.pk} (message_id={blocker.message_id}); replay or discard that one "
                f"first, then replay this one (replaying the key's dead letters oldest first "
                f"keeps their order)",
                label=OutcomeLabel.PARKED,
            )
        return self._handle(delivery, decoded)

    def _expire(self, delivery: Delivery, message: Message, why: str) -> DeliveryOutcome:
        """A message past its deadline is not handled (see :mod:`.expiry`). Before it is kept
        as a dead letter, the inbox is asked: a late redelivery of a message handled in time
        is a duplicate, not a failure for a person to review."""
        if self.spec.on_expiry == "dead_letter" and (
            ProcessedMessage.objects.using(self.using).has(self.spec.name, message.message_id)
        ):
            return DeliveryOutcome(
                Acknowledge(OutcomeLabel.DUPLICATE),
                OutcomeLabel.DUPLICATE,
                processed=True,
                after_commit=True,
            )
        return self.failures.expire(delivery, message, why)

    def _expects(self, routing_key: str) -> bool:
        if not self.spec.bindings:
            return True  # bound outside the app: nothing to compare with
        return any(topic_matches(binding, routing_key) for binding in self.spec.bindings)

    def _blocking_dead_letter(self, delivery: Delivery, message: Message) -> DeadLetter | None:
        """For an ordered consumer: the earliest unresolved dead letter of the message's key.

        A later message of a key whose earlier message is a dead letter must not overtake it,
        so it is parked as a dead letter too. A replayed message is held back only by dead
        letters older than its own, so replaying a key's dead letters oldest first releases it.
        """
        if not self.spec.ordered or message.ordering_key is None:
            return None
        letters = DeadLetter.objects.using(self.using)
        blocking = (
            letters.open()
            .filter(consumer=self.spec.name, ordering_key=message.ordering_key)
            .exclude(message_id=message.message_id)
        )
        if REPLAY_HEADER in delivery.headers:
            # An edited copy's own dead letter is the one it was edited from (the ledger says).
            own = ledger.replayed_dead_letter(
                delivery, self.spec.name, message.message_id, self.using
            )
            if own is None:
                own = (
                    letters.of(self.spec.name, message.message_id)
                    .values_list("pk", flat=True)
                    .first()
                )
            if own is not None:
                blocking = blocking.filter(pk__lt=own)
        return blocking.order_by("pk").first()

    def _handle(self, delivery: Delivery, message: Message) -> DeliveryOutcome:
        started = time.perf_counter()
        fresh = False
        try:
            # The insert comes first: on a duplicate it fails before the handler runs, and with
            # a concurrent twin it waits on the unique index until that one commits or rolls
            # back; so the unique constraint alone decides who takes effect.
            wait = lock_wait_for(
                [(self.spec.name, message.message_id)], delivery.redelivered, self.settings
            )
            with claimed_atomic(
                self.using, self.spec.name, message.message_id, lock_wait=wait
            ) as fresh:
                if not fresh:
                    raise _AlreadyProcessed
                self.call_handler(message, delivery)
                if REPLAY_HEADER in delivery.headers:
                    self._replay_done(delivery, message, ReplayOutcome.PROCESSED)
                elif not self.spec.ordered:
                    # An ordered consumer's dead letter keeps its key parked until replayed.
                    resolve_processed_copies(self.spec.name, [message.message_id], self.using)
        except InboxRowBusy:
            remember_busy([(self.spec.name, message.message_id)])
            return self.failures.busy(delivery, message)
        except (_AlreadyProcessed, IntegrityError) as exc:
            if not fresh and isinstance(exc, IntegrityError):
                # The inbox insert itself failed, before the handler: a unique violation is the
                # duplicate; anything else is ours or the database's, never a duplicate to ack.
                raise_database_trouble(exc, message.message_id)
                if sqlstate(exc) not in (None, UNIQUE_VIOLATION):
                    raise InboxClaimFailed(
                        f"the inbox claim of message_id={message.message_id} failed: {exc}"
                    ) from exc
            if not fresh:
                if REPLAY_HEADER in delivery.headers:
                    # Another copy of the message (published twice, sent again by a relay) was
                    # processed after the replay was queued: the dead letter is done with. Left
                    # "replayed", an ordered consumer's would park its key for good.
                    self._replay_done(delivery, message, ReplayOutcome.DUPLICATE)
                return DeliveryOutcome(
                    Acknowledge(OutcomeLabel.DUPLICATE),
                    OutcomeLabel.DUPLICATE,
                    processed=True,
                    after_commit=True,
                )
            return self.failures.on_failure(delivery, message, exc, started)
        except Exception as exc:  # any handler error is an outcome to decide on
            raise_database_trouble(
                exc, message.message_id, lost=lambda: not fresh or not self.connection_usable()
            )
            if not fresh:
                # Raised before the handler ran (by our inbox claim): not its failure.
                raise InboxClaimFailed(
                    f"the inbox claim of message_id={message.message_id} failed: {exc}"
                ) from exc
            return self.failures.on_failure(delivery, message, exc, started)
        duration = time.perf_counter() - started
        return DeliveryOutcome(
            Acknowledge(OutcomeLabel.PROCESSED),
            OutcomeLabel.PROCESSED,
            duration,
            processed=True,
            after_commit=True,
        )

    def _replay_done(self, delivery: Delivery, message: Message, outcome: ReplayOutcome) -> None:
        """A replayed copy was processed, or found processed by another copy: in the
        transaction that decided it, its dead letter is resolved and its ledger row settled
        (both naming the trace it was decided in)."""
        traced = tracing.ids_of(delivery)
        trace_id = traced[0] if traced else None
        if outcome == ReplayOutcome.PROCESSED:
            mark_resolved(self.spec.name, message.message_id, self.using, trace_id=trace_id)
        else:
            resolve_processed_copies(
                self.spec.name,
                [message.message_id],
                self.using,
                by="its replay found it processed by another copy",
                trace_id=trace_id,
            )
        ledger.settle(
            delivery,
            self.spec.name,
            message.message_id,
            outcome,
            using=self.using,
            trace_id=trace_id,
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

    def fits_batch_claim(self, delivery: Delivery, decoded: Message | DecodeError) -> bool:
        """Whether the batch claim (and the optimistic path) may take this delivery: a
        well-formed message of an unordered consumer, expected here, not a replay (those
        resolve a dead letter), not past its deadline (never claimed in the inbox). The others
        are decided one by one, each in its savepoints."""
        return (
            isinstance(decoded, Message)
            and not self.spec.ordered
            and REPLAY_HEADER not in delivery.headers
            and self._expects(decoded.routing_key)
            and expiry_of(delivery, decoded, self.spec) is None
        )

    def charge(self, delivery: Delivery, exc: Exception) -> Outcome:
        """The delivery's own transaction could not commit (a deferred constraint its handler
        broke), or kept meeting conflicts past their bound: a failure of the handler like any
        other, decided outside that transaction."""
        decoded = self.decode(delivery)
        if isinstance(decoded, DecodeError):  # cannot happen: those commit nothing of their own
            raise DatabaseUnavailable(f"the commit failed: {exc}") from exc
        done = self.failures.on_failure(delivery, decoded, exc, time.perf_counter())
        metrics.consumer_outcome(self.spec.name, done.label, done.duration)
        return done.outcome


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

    def __init__(self, processor: DeliveryProcessor, index: int, error: Exception) -> None:
        super().__init__(processor.spec.name)
        self.processor = processor
        self.index = index
        self.error = error


def process_batch(
    jobs: Sequence[Job], *, cache: DuplicateCache | None = None
) -> list[Outcome | None]:
    """Decide ``jobs`` in one transaction (:func:`_process_batch`), each delivery in a span of
    its own when tracing is on."""
    started = tracing.start_deliveries((job.delivery, job.processor.spec.name) for job in jobs)
    if started is None:
        return _process_batch(jobs, cache)
    deliveries = [job.delivery for job in jobs]
    try:
        outcomes = _process_batch(jobs, cache)
    except BaseException as exc:
        tracing.end_deliveries(started, deliveries, None, exc)
        raise
    tracing.end_deliveries(started, deliveries, outcomes)
    return outcomes


def _process_batch(jobs: Sequence[Job], cache: DuplicateCache | None) -> list[Outcome | None]:
    """Decide ``jobs`` in one transaction; the outcomes are only valid once this returns.

    A conflict the database reports (a deadlock, a serialization failure) rolls the transaction
    back and runs the batch again, up to ``CONFLICT_RETRIES`` times after the first, a short
    jittered pause apart; no attempt is charged for it. Past that bound a batch of several is
    decided one delivery per transaction (each with its own bound), and a lone delivery is
    charged the conflict as its handler's failure.

    See :func:`_process_batch_once` for the rest.
    """
    for retry in range(CONFLICT_RETRIES + 1):
        try:
            return _process_batch_once(jobs, cache=cache)
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
        return _one_by_one(jobs, cache)
    cause = conflict.__cause__
    charged = cause if isinstance(cause, Exception) else conflict
    logger.warning(
        "message_id=%s met database conflicts %d times in a row: charged as a failure of its "
        "handler",
        jobs[0].delivery.message_id,
        CONFLICT_RETRIES + 1,
    )
    return [jobs[0].processor.charge(jobs[0].delivery, charged)]


def _process_batch_once(
    jobs: Sequence[Job], *, cache: DuplicateCache | None = None
) -> list[Outcome | None]:
    """One try at deciding ``jobs`` in one transaction.

    The result lists one outcome per job, in order. ``None`` marks a job that was not run
    because an earlier delivery of its queue must first be retried in place (ordered
    consumers): the caller runs it again after that one.

    The batch's inbox rows go in first, with one ``INSERT ... ON CONFLICT DO NOTHING RETURNING``
    (the rows not returned are duplicates; a concurrent twin makes it wait until it commits, as
    a single insert would). Then the handlers run, in one of two ways with the same guarantees:

    - optimistic, for the common case of handlers that succeed: no savepoints. If a handler
      raises, the whole transaction rolls back and the batch is decided again, guarded; its
      consumer's next batches stay guarded for a while.
    - guarded: a savepoint per handler, so a failure rolls back its own effects (and its inbox
      row is removed) while the rest of the batch commits.

    Either way a handler may be invoked again after a rollback it did not cause; only its
    database effects are exactly-once (as after any crash or retry).

    Raises :class:`DatabaseUnavailable` when the database cannot be reached or the commit
    fails for want of a connection: nothing of the batch took effect or was decided.
    """
    if not jobs:
        return []
    began = time.perf_counter()
    if len({job.processor.using for job in jobs}) > 1:
        # A router sending consumers to different databases: one transaction per database.
        return [outcome for job in jobs for outcome in process_batch([job], cache=cache)]
    decoded = [job.processor.decode(job.delivery) for job in jobs]
    settled: list[DeliveryOutcome | None] = [None] * len(jobs)
    leased = _fast_path(jobs, decoded, settled, cache)
    optimistic = all(job.processor.guarded_batches == 0 for job in jobs)
    for processor in {job.processor for job in jobs}:
        processor.guarded_batches = max(0, processor.guarded_batches - 1)
    try:
        try:
            decided = _decide(jobs, decoded, settled, guarded=not optimistic)
        except _Fallback as fallback:
            fallback.processor.guarded_batches = GUARDED_BATCHES_AFTER_FAILURE
            # The handler that failed is not run again: its failure is decided as it was.
            failed = {fallback.index: fallback.error}
            decided = _decide(jobs, decoded, settled, guarded=True, failed=failed)
    except _CommitRefused as refused:
        if cache is not None:
            cache.remember((), leased)
        if len(jobs) == 1:
            return [jobs[0].processor.charge(jobs[0].delivery, refused.error)]
        logger.warning(
            "a batch of %d deliveries failed to commit (%s: %s); deciding them one by one",
            len(jobs),
            type(refused.error).__name__,
            refused.error,
        )
        return _one_by_one(jobs, cache)
    except (DatabaseUnavailable, DatabaseConflict):
        if cache is not None:
            cache.remember((), leased)
        raise
    if cache is not None:
        cache.remember(
            [
                (job.processor.spec.name, message.message_id)
                for job, message, done in zip(jobs, decoded, decided, strict=True)
                if done is not None and done.processed and isinstance(message, Message)
            ],
            leased,
        )
    outcomes: list[Outcome | None] = []
    now, processing = time.time(), time.perf_counter() - began
    for job, message, done in zip(jobs, decoded, decided, strict=True):
        if done is None:
            outcomes.append(None)
            continue
        metrics.consumer_outcome(job.processor.spec.name, done.label, done.duration)
        published_at = message.published_at if isinstance(message, Message) else None
        metrics.delivery_times(
            job.processor.spec.name,
            processing,
            now - published_at.timestamp()
            if published_at is not None and done.label == OutcomeLabel.PROCESSED
            else None,
            tracing.sampled_trace_id(job.delivery),
        )
        if done.after_commit and isinstance(message, Message):
            _log_committed(job.processor.spec.name, message, done)
        outcomes.append(done.outcome)
    return outcomes


def _log_committed(consumer: str, message: Message, done: DeliveryOutcome) -> None:
    if done.label == OutcomeLabel.DUPLICATE:
        logger.info(
            "duplicate message_id=%s consumer=%s attempt=%d outcome=duplicate: already "
            "processed, acked without running the handler",
            message.message_id,
            consumer,
            message.attempt,
        )
    elif done.label == OutcomeLabel.EXPIRED:
        why = done.outcome.reason if isinstance(done.outcome, Acknowledge) else None
        logger.info(
            "expired message_id=%s consumer=%s attempt=%d outcome=expired: %s; acked without "
            "running the handler",
            message.message_id,
            consumer,
            message.attempt,
            why,
        )
    else:
        logger.info(
            "processed message_id=%s consumer=%s attempt=%d outcome=processed duration_ms=%.1f",
            message.message_id,
            consumer,
            message.attempt,
            (done.duration or 0.0) * 1000,
        )


class _CommitRefused(Exception):
    def __init__(self, error: DatabaseError) -> None:
        super().__init__(str(error))
        self.error = error


def _decide(
    jobs: Sequence[Job],
    decoded: Sequence[Message | DecodeError],
    settled: Sequence[DeliveryOutcome | None],
    *,
    guarded: bool,
    failed: dict[int, Exception] | None = None,
) -> list[DeliveryOutcome | None]:
    """One transaction over the jobs the fast path did not settle. ``failed`` holds the
    handler errors already seen (on the optimistic path) of jobs not to run again."""
    decided = list(settled)
    pending = [index for index, done in enumerate(decided) if done is None]
    if not pending:
        return decided
    using = jobs[0].processor.using
    held_queues: set[str] = set()
    try:
        with transaction.atomic(using=using):
            claimable = []
            if connections[using].vendor in CLAIM_VENDORS:
                claimable = [
                    i
                    for i in pending
                    if jobs[i].processor.fits_batch_claim(jobs[i].delivery, decoded[i])
                ]
            if claimable:
                _run_claimed(jobs, decoded, decided, claimable, using, guarded, failed or {})
            # The rest (bad input, ordered consumers, replays) one by one, each in savepoints.
            for index in pending:
                job = jobs[index]
                if decided[index] is not None or job.delivery.queue in held_queues:
                    continue
                done = job.processor.run(job.delivery, decoded[index])
                decided[index] = done
                if isinstance(done.outcome, RetryInPlace):
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


def _run_claimed(
    jobs: Sequence[Job],
    decoded: Sequence[Message | DecodeError],
    decided: list[DeliveryOutcome | None],
    indexes: list[int],
    using: str,
    guarded: bool,
    failed: dict[int, Exception],
) -> None:
    """Claim the inbox rows of ``indexes`` in one statement, then run the handlers of the
    claimed ones: optimistic (a handler error raises :class:`_Fallback`) or guarded (a
    savepoint each; a failure removes its inbox row and is decided at once)."""
    for index, error in failed.items():
        message = decoded[index]
        assert isinstance(message, Message)
        decided[index] = jobs[index].processor.failures.on_failure(
            jobs[index].delivery, message, error, time.perf_counter()
        )
    indexes = [index for index in indexes if index not in failed]
    if not indexes:
        return
    messages: list[Message] = []
    keys: list[tuple[str, str]] = []
    for index in indexes:
        message = decoded[index]
        assert isinstance(message, Message)
        messages.append(message)
        keys.append((jobs[index].processor.spec.name, message.message_id))
    wait = lock_wait_for(
        keys,
        any(jobs[index].delivery.redelivered for index in indexes),
        jobs[indexes[0]].processor.settings,
    )
    try:
        claimed, busy = claim_inbox_rows(using, keys, wait)
    except DatabaseError as exc:
        # Our statement, before any handler ran: the database's trouble, or our own failure.
        raise_database_trouble(exc, messages[0].message_id)
        raise InboxClaimFailed(
            f"the inbox claim of message_id={messages[0].message_id}"
            f"{f' and {len(messages) - 1} more' if len(messages) > 1 else ''} failed: {exc}"
        ) from exc
    remember_busy(busy)
    seen: set[tuple[str, str]] = set()
    processed: dict[str, list[str]] = {}
    for index, key, message in zip(indexes, keys, messages, strict=True):
        processor = jobs[index].processor
        if key in busy:
            decided[index] = processor.failures.busy(jobs[index].delivery, message)
            continue
        if key not in claimed or key in seen:
            decided[index] = DeliveryOutcome(
                Acknowledge(OutcomeLabel.DUPLICATE),
                OutcomeLabel.DUPLICATE,
                processed=True,
                after_commit=True,
            )
            continue
        seen.add(key)
        started = time.perf_counter()
        if guarded:
            failure = _run_guarded(processor, jobs[index].delivery, message, started)
            if failure is not None:
                decided[index] = failure
                continue
        else:
            try:
                processor.call_handler(message, jobs[index].delivery)
            except Exception as exc:  # the batch is redone guarded, this failure decided there
                # Not the handler's failure when the database did it: deciding it would spend
                # an attempt on the database's outage or conflict. Nothing is decided then.
                raise_database_trouble(
                    exc, message.message_id, lost=lambda: _connection_lost(using)
                )
                raise _Fallback(processor, index, exc) from exc
        duration = time.perf_counter() - started
        decided[index] = DeliveryOutcome(
            Acknowledge(OutcomeLabel.PROCESSED),
            OutcomeLabel.PROCESSED,
            duration,
            processed=True,
            after_commit=True,
        )
        if claimed[key]:
            processed.setdefault(key[0], []).append(key[1])
    # In the same transaction: a dead letter of a message another copy just processed is
    # resolved. The claim told which keys have one (on PostgreSQL; elsewhere every key may):
    # usually none, and then no query at all.
    for consumer, message_ids in processed.items():
        resolve_processed_copies(consumer, message_ids, using)


def _run_guarded(
    processor: DeliveryProcessor, delivery: Delivery, message: Message, started: float
) -> DeliveryOutcome | None:
    """Run the handler in a savepoint; None when it succeeded, else its failure's outcome."""
    try:
        with transaction.atomic(using=processor.using):
            processor.call_handler(message, delivery)
    except Exception as exc:  # noqa: BLE001 - any handler error is an outcome to decide on
        raise_database_trouble(
            exc, message.message_id, lost=lambda: not processor.connection_usable()
        )
        # Its effects rolled back with the savepoint; the claimed inbox row goes too.
        ProcessedMessage.objects.using(processor.using).forget(
            processor.spec.name, message.message_id
        )
        return processor.failures.on_failure(delivery, message, exc, started)
    return None


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


def _one_by_one(jobs: Sequence[Job], cache: DuplicateCache | None) -> list[Outcome | None]:
    outcomes: list[Outcome | None] = []
    held_queues: set[str] = set()
    for job in jobs:
        if job.delivery.queue in held_queues:
            outcomes.append(None)
            continue
        outcome = process_batch([job], cache=cache)[0]
        outcomes.append(outcome)
        if isinstance(outcome, RetryInPlace):
            held_queues.add(job.delivery.queue)
    return outcomes


def _fast_path(
    jobs: Sequence[Job],
    decoded: Sequence[Message | DecodeError],
    decided: list[DeliveryOutcome | None],
    cache: DuplicateCache | None,
) -> list[tuple[str, str]]:
    """Settle what Redis already knows: duplicates, and messages another consumer is on.
    Returns the leases taken. Replays always go to the database (a forced replay has just
    removed its inbox row, which the cache may still remember)."""
    if cache is None:
        return []
    candidates = [
        (index, job.processor.spec.name, message)
        for index, (job, message) in enumerate(zip(jobs, decoded, strict=True))
        if isinstance(message, Message) and REPLAY_HEADER not in job.delivery.headers
    ]
    keys = list(dict.fromkeys((name, message.message_id) for _, name, message in candidates))
    # Ordered partitions have one consumer at a time already (single active consumer).
    wanted = {
        (name, message.message_id)
        for index, name, message in candidates
        if not jobs[index].processor.spec.ordered
    }
    known, leases = cache.check(keys, wanted)
    leased: list[tuple[str, str]] = []
    for index, name, message in candidates:
        key = (name, message.message_id)
        if key in known:
            metrics.dedup_cache(name, "hit")
            logger.info(
                "duplicate message_id=%s consumer=%s attempt=%d outcome=duplicate: already "
                "processed (fast path), acked without running the handler",
                message.message_id,
                name,
                message.attempt,
            )
            decided[index] = DeliveryOutcome(
                Acknowledge(OutcomeLabel.DUPLICATE), OutcomeLabel.DUPLICATE
            )
            continue
        metrics.dedup_cache(name, "miss")
        if leases is None or key not in leases:
            continue
        if leases[key]:
            leases[key] = False  # the same message twice in one batch: the inbox decides
            leased.append(key)
        elif key not in leased:
            metrics.dedup_cache(name, "lease_busy")
            decided[index] = jobs[index].processor.failures.defer(jobs[index].delivery, message)
    return leased
