"""The idempotent consumer: each delivery's handler commits with its inbox row, or not at all.

:func:`process_batch` runs on a worker thread with its own database connection and never touches
pika; it returns one :mod:`outcome <.outcomes>` per delivery, which the connection's thread
carries out (ack, publish a retry copy then ack, or give the delivery back) after the commit.

Several deliveries share one transaction: each runs in its own savepoint (inbox insert first,
then the handler), so a failing handler rolls back its own effects and inbox row only, and the
batch commits once. Nothing is acked before that commit, so a crash anywhere leaves every
delivery of the batch with the broker, and the inbox rows that did commit absorb the redelivery.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import traceback
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.utils import timezone

from . import metrics
from .choices import OPEN_DEAD_LETTER_STATUSES
from .conf import MessagingSettings, messaging_settings
from .dead_letters import record_dead_letter
from .envelope import (
    ATTEMPT_HEADER,
    BROKER_HEADERS,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    REPLAY_HEADER,
    DecodeError,
    Delivery,
    Message,
    decode_delivery,
)
from .exceptions import DatabaseUnavailable
from .fastpath import DuplicateCache
from .models import DeadLetter, DeadLetterReason, ProcessedMessage
from .outcomes import Acknowledge, Outcome, RetryInPlace, ScheduleRetry
from .partitions import CLAIM_LOCK_CLASS, LOCK_NOT_AVAILABLE
from .registry import ConsumerSpec
from .replay import mark_resolved, resolve_processed_copies
from .retry import GiveUp, decide
from .routing import topic_matches
from .time_limit import time_limits

CLIENT_CURSOR: type | None
try:
    from psycopg import ClientCursor as CLIENT_CURSOR
except ImportError:  # psycopg2, or no PostgreSQL at all
    CLIENT_CURSOR = None

logger = logging.getLogger(__name__)

# After a batch's claim timed out, each of its rows is tried alone for this long: the batch
# already waited INBOX_LOCK_TIMEOUT, so a row still locked now is the busy one.
ROW_LOCK_PROBE = 0.1


# Keys found held by another transaction, with when that was (monotonic): for a while their
# next copies wait only ROW_LOCK_PROBE, not INBOX_LOCK_TIMEOUT. A consumer cut off mid-batch
# holds its rows until the server ends its transaction; the copies the broker redelivered
# come back deferred again and again meanwhile, and each full wait would stall this consumer.
_BUSY_KEYS: dict[tuple[str, str], float] = {}
BUSY_MEMORY = 60.0
_BUSY_LOCK = threading.Lock()


def _remember_busy(keys: Iterable[tuple[str, str]]) -> None:
    now = time.monotonic()
    with _BUSY_LOCK:
        for key in keys:
            _BUSY_KEYS[key] = now
        if len(_BUSY_KEYS) > 10_000:
            for key, at in list(_BUSY_KEYS.items()):
                if now - at > BUSY_MEMORY:
                    del _BUSY_KEYS[key]


def lock_wait_for(keys: Iterable[tuple[str, str]], redelivered: bool, settings: Any) -> float:
    """How long an inbox claim of ``keys`` may wait on rows another transaction holds: the
    full ``INBOX_LOCK_TIMEOUT``, or only ROW_LOCK_PROBE for a redelivery (its last holder may
    be the consumer that went away with its transaction open) or a key found held lately."""
    if redelivered:
        return min(ROW_LOCK_PROBE, settings.inbox_lock_timeout)
    now = time.monotonic()
    with _BUSY_LOCK:
        if any(now - _BUSY_KEYS.get(key, -BUSY_MEMORY) < BUSY_MEMORY for key in keys):
            return min(ROW_LOCK_PROBE, settings.inbox_lock_timeout)
    return float(settings.inbox_lock_timeout)


class _AlreadyProcessed(Exception):
    """The message's inbox row is there already: a duplicate."""


class InboxRowBusy(Exception):
    """Another transaction holds this message's inbox row and did not end in time."""


@contextlib.contextmanager
def bounded_lock_wait(using: str, seconds: float) -> Iterator[None]:
    """Within the current transaction, let lock waits last ``seconds`` at most (PostgreSQL's
    ``lock_timeout``), then restore what it was, so a handler's own statements never see it.
    Used around the inbox insert: a twin's transaction that never ends (its consumer cut off
    from the network mid-batch) must turn a wait into a deferral, not stall this consumer.
    Raises :class:`InboxRowBusy` when the wait is cut short; the caller's savepoint must
    then be rolled back (the restore is skipped, and the rollback undoes the setting)."""
    connection = connections[using]
    if connection.vendor != "postgresql" or seconds <= 0:
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
            [f"{max(1, round(seconds * 1000))}ms"],
        )
        previous = cursor.fetchone()[0]
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            raise InboxRowBusy(str(exc)) from exc
        raise
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])


def retry_headers(
    delivery: Delivery, message: Message, exc: BaseException, next_attempt: int
) -> dict[str, Any]:
    """Headers of the retried copy: the original's, minus the broker's dead-letter bookkeeping,
    plus the next attempt number and where the message was first published."""
    headers = {k: v for k, v in delivery.headers.items() if k not in BROKER_HEADERS}
    headers[ATTEMPT_HEADER] = next_attempt
    headers[ORIGINAL_EXCHANGE_HEADER] = message.exchange
    headers[ORIGINAL_ROUTING_KEY_HEADER] = message.routing_key
    headers.setdefault(FIRST_FAILED_AT_HEADER, int(time.time() * 1000))
    headers[LAST_ERROR_HEADER] = f"{type(exc).__name__}: {exc}"[:500]
    return headers


# Dead-letter statuses that hold back the later messages of an ordered consumer's key.
BLOCKING_STATUSES = OPEN_DEAD_LETTER_STATUSES


@dataclasses.dataclass(frozen=True)
class Job:
    """One delivery for one consumer, as a worker hands it to :func:`process_batch`."""

    processor: DeliveryProcessor
    delivery: Delivery


@dataclasses.dataclass(frozen=True)
class _Decided:
    """An outcome plus what to count and remember once (if) the transaction commits."""

    outcome: Outcome
    label: str
    duration: float | None = None
    processed: bool = False  # the inbox holds the message now: the fast path may remember it
    # Logged once the transaction committed (a line saying "processed" must be true).
    after_commit: bool = False


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

    @property
    def max_attempts(self) -> int:
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def retry_delays(self) -> tuple[float, ...]:
        if self.spec.retry_delays is not None:
            return self.spec.retry_delays
        return self.settings.retry_delays

    def process(self, delivery: Delivery) -> Outcome:
        """Handle one delivery in its own transaction. Raises :class:`DatabaseUnavailable` when
        the database cannot be reached: the caller must hold the delivery and call again."""
        outcome = process_batch([Job(self, delivery)], cache=self.cache)[0]
        assert outcome is not None  # a lone delivery is never held behind another
        return outcome

    @property
    def timeout(self) -> float:
        return self.spec.timeout or self.settings.handler_timeout

    def call_handler(self, message: Message) -> None:
        """Run the handler (inside the caller's transaction) under its time limit: past it, it
        raises :class:`~.exceptions.HandlerTimeout` (see :mod:`.time_limit`)."""
        with time_limits.limit(self.timeout, self.spec.name, message.message_id):
            self.spec.handler(message)

    def decode(self, delivery: Delivery) -> Message | DecodeError:
        return decode_delivery(
            delivery,
            max_body_bytes=self.settings.max_body_bytes,
            derive_message_id=self.settings.derive_message_id,
        )

    # -- inside the batch's transaction -----------------------------------------------------------

    def run(self, delivery: Delivery, decoded: Message | DecodeError) -> _Decided:
        """Decide one delivery inside the caller's transaction; its writes are in savepoints."""
        if isinstance(decoded, DecodeError):
            return self._reject_undecodable(delivery, decoded)
        if not self._expects(decoded.routing_key):
            return self._reject(
                delivery,
                decoded,
                DeadLetterReason.UNEXPECTED_ROUTING_KEY,
                f"routing key {decoded.routing_key!r} matches none of the consumer's bindings "
                f"{list(self.spec.bindings)!r}: the message reached the queue some other way "
                f"(published straight to the queue, or a stale binding)",
            )
        blocker = self._blocking_dead_letter(delivery, decoded)
        if blocker is not None:
            return self._reject(
                delivery,
                decoded,
                DeadLetterReason.PARKED,
                f"ordering key {decoded.ordering_key!r} is parked behind dead letter "
                f"#{blocker.pk} (message_id={blocker.message_id}); replay or discard that one "
                f"first, then replay this one (replaying the key's dead letters oldest first "
                f"keeps their order)",
                label="parked",
            )
        return self._handle(delivery, decoded)

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
            own = (
                letters.of(self.spec.name, message.message_id).values_list("pk", flat=True).first()
            )
            if own is not None:
                blocking = blocking.filter(pk__lt=own)
        return blocking.order_by("pk").first()

    def _reject_undecodable(self, delivery: Delivery, error: DecodeError) -> _Decided:
        logger.error(
            "dead-lettering message_id=%s consumer=%s outcome=dead_lettered reason=%s: %s",
            error.message_id or "-",
            self.spec.name,
            error.reason,
            error.detail,
        )
        self._write_dead_letter(
            delivery=delivery,
            message_id=error.message_id,
            reason=error.reason,
            attempts=1,
            exception_message=error.detail,
        )
        return _Decided(Acknowledge("dead_lettered", error.reason), "dead_lettered")

    def _reject(
        self,
        delivery: Delivery,
        message: Message,
        reason: str,
        detail: str,
        label: str = "dead_lettered",
    ) -> _Decided:
        logger.error(
            "dead-lettering message_id=%s consumer=%s attempt=%d outcome=%s reason=%s: %s",
            message.message_id,
            self.spec.name,
            message.attempt,
            label,
            reason,
            detail,
        )
        self._write_dead_letter(
            delivery=delivery,
            message_id=message.message_id,
            reason=reason,
            attempts=message.attempt,
            payload=message.payload,
            exchange=message.exchange,
            routing_key=message.routing_key,
            exception_message=detail,
        )
        return _Decided(Acknowledge("dead_lettered", reason), label)

    def _handle(self, delivery: Delivery, message: Message) -> _Decided:
        started = time.perf_counter()
        inserted = False
        try:
            with transaction.atomic(using=self.using):
                # The insert comes first: on a duplicate it fails before the handler runs, and
                # with a concurrent twin it waits on the unique index until that one commits or
                # rolls back; so the unique constraint alone decides who takes effect.
                wait = lock_wait_for(
                    [(self.spec.name, message.message_id)], delivery.redelivered, self.settings
                )
                with bounded_lock_wait(self.using, wait):
                    if not insert_inbox_row(self.using, self.spec.name, message.message_id):
                        raise _AlreadyProcessed
                inserted = True
                self.call_handler(message)
                if REPLAY_HEADER in delivery.headers:
                    mark_resolved(self.spec.name, message.message_id, self.using)
                elif not self.spec.ordered:
                    # An ordered consumer's dead letter keeps its key parked until replayed.
                    resolve_processed_copies(self.spec.name, [message.message_id], self.using)
        except InboxRowBusy:
            _remember_busy([(self.spec.name, message.message_id)])
            return self.busy(delivery, message)
        except (_AlreadyProcessed, IntegrityError) as exc:
            if not inserted:
                if REPLAY_HEADER in delivery.headers:
                    # Another copy of the message (published twice, sent again by a relay) was
                    # processed after the replay was queued: the dead letter is done with. Left
                    # "replayed", an ordered consumer's would park its key for good.
                    resolve_processed_copies(
                        self.spec.name,
                        [message.message_id],
                        self.using,
                        by="its replay found it processed by another copy",
                    )
                return _Decided(
                    Acknowledge("duplicate"), "duplicate", processed=True, after_commit=True
                )
            return self.on_failure(delivery, message, exc, started)
        except (OperationalError, InterfaceError) as exc:
            if not inserted or not self.connection_usable():
                raise DatabaseUnavailable(
                    f"database error on message_id={message.message_id}: {exc}"
                ) from exc
            return self.on_failure(delivery, message, exc, started)
        except Exception as exc:  # noqa: BLE001 - any handler error is an outcome to decide on
            return self.on_failure(delivery, message, exc, started)
        duration = time.perf_counter() - started
        return _Decided(
            Acknowledge("processed"), "processed", duration, processed=True, after_commit=True
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

    def on_failure(
        self, delivery: Delivery, message: Message, exc: Exception, started: float
    ) -> _Decided:
        duration = time.perf_counter() - started
        decision = decide(
            exc, attempt=message.attempt, max_attempts=self.max_attempts, delays=self.retry_delays
        )
        if isinstance(decision, GiveUp):
            logger.error(
                "dead-lettering message_id=%s consumer=%s attempt=%d outcome=dead_lettered "
                "reason=%s duration_ms=%.1f: %s: %s",
                message.message_id,
                self.spec.name,
                message.attempt,
                decision.reason,
                duration * 1000,
                type(exc).__name__,
                exc,
            )
            self._write_dead_letter(
                delivery=delivery,
                message_id=message.message_id,
                reason=decision.reason,
                attempts=message.attempt,
                payload=message.payload,
                exchange=message.exchange,
                routing_key=message.routing_key,
                exception=exc,
                traceback_text="".join(traceback.format_exception(exc)),
            )
            return _Decided(
                Acknowledge("dead_lettered", decision.reason), "dead_lettered", duration
            )
        logger.warning(
            "retrying message_id=%s consumer=%s attempt=%d outcome=retry next_attempt=%d "
            "in %.3gs%s duration_ms=%.1f: %s: %s",
            message.message_id,
            self.spec.name,
            message.attempt,
            decision.next_attempt,
            decision.delay,
            " in place (ordered)" if self.spec.ordered else "",
            duration * 1000,
            type(exc).__name__,
            exc,
        )
        headers = retry_headers(delivery, message, exc, decision.next_attempt)
        error = f"{type(exc).__name__}: {exc}"
        if self.spec.ordered:
            # Through a delay queue a later message of the key would overtake it: the delivery
            # stays unacked, holding its partition, and runs again after the delay.
            return _Decided(
                RetryInPlace(decision.delay, decision.next_attempt, headers, error),
                "retried",
                duration,
            )
        return _Decided(
            ScheduleRetry(decision.delay, decision.next_attempt, headers, error),
            "retried",
            duration,
        )

    @property
    def defer_delay(self) -> float:
        """Seconds a copy put aside for a busy lease waits: the consumer's first retry delay,
        else the settings' first one. The copy goes through the delay queue of that value, so
        it must be one :func:`.topology.all_delays` declares: the settings' delays always are
        (and the system checks require RETRY_DELAYS to be non-empty), so a consumer with
        ``retry_delays=()`` (no retries) still has one."""
        return (self.spec.retry_delays or self.settings.retry_delays)[0]

    def defer(
        self,
        delivery: Delivery,
        message: Message,
        why: str = "another consumer is processing it right now",
        error: str = "lease held",
    ) -> _Decided:
        """Another consumer holds this message (its Redis lease, or its inbox row in a
        transaction not yet ended): have the copy come back shortly, at the same attempt.
        An ordered consumer's delivery waits in place instead, holding its partition."""
        delay = self.defer_delay
        logger.info(
            "message_id=%s consumer=%s attempt=%d outcome=deferred: %s; it comes back in %.3gs",
            message.message_id,
            self.spec.name,
            message.attempt,
            why,
            delay,
        )
        headers = {k: v for k, v in delivery.headers.items() if k not in BROKER_HEADERS}
        headers[ATTEMPT_HEADER] = message.attempt
        headers[ORIGINAL_EXCHANGE_HEADER] = message.exchange
        headers[ORIGINAL_ROUTING_KEY_HEADER] = message.routing_key
        if self.spec.ordered:
            return _Decided(RetryInPlace(delay, message.attempt, headers, error), "deferred")
        return _Decided(
            ScheduleRetry(delay, message.attempt, headers, error, deferred=True), "deferred"
        )

    def busy(self, delivery: Delivery, message: Message) -> _Decided:
        """The inbox row is locked by a transaction that did not end within
        ``INBOX_LOCK_TIMEOUT`` (a twin still running, or a consumer cut off mid-batch)."""
        return self.defer(
            delivery,
            message,
            why=f"its inbox row is held by another transaction for over "
            f"{self.settings.inbox_lock_timeout:g}s (a twin delivery running, or a consumer "
            f"cut off mid-batch)",
            error="inbox row locked",
        )

    def plain(self, delivery: Delivery, decoded: Message | DecodeError) -> bool:
        """Whether the optimistic path may take this delivery: a well-formed message of an
        unordered consumer, expected here, not a replay (those resolve a dead letter)."""
        return (
            isinstance(decoded, Message)
            and not self.spec.ordered
            and REPLAY_HEADER not in delivery.headers
            and self._expects(decoded.routing_key)
        )

    def commit_refused(self, delivery: Delivery, exc: DatabaseError) -> Outcome:
        """The delivery's own transaction could not commit (a deferred constraint its handler
        broke): a failure of the handler like any other, decided outside that transaction."""
        decoded = self.decode(delivery)
        if isinstance(decoded, DecodeError):  # cannot happen: those commit nothing of their own
            raise DatabaseUnavailable(f"the commit failed: {exc}") from exc
        done = self.on_failure(delivery, decoded, exc, time.perf_counter())
        metrics.consumer_outcome(self.spec.name, done.label, done.duration)
        return done.outcome

    def _write_dead_letter(self, **kwargs: Any) -> None:
        try:
            record_dead_letter(consumer=self.spec.name, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            # Without the row the message must stay with the broker: nothing is lost.
            raise DatabaseUnavailable(
                f"cannot record the dead letter of message_id={kwargs.get('message_id')}: {exc}"
            ) from exc


def with_attempt(delivery: Delivery, retry: RetryInPlace) -> Delivery:
    """The same delivery, as its next in-place attempt will see it."""
    return dataclasses.replace(delivery, headers=dict(retry.headers))


# Databases whose SQL has INSERT ... ON CONFLICT DO NOTHING RETURNING (the batched inbox claim);
# on others every delivery takes the one-by-one path.
CLAIM_VENDORS = frozenset({"postgresql", "sqlite"})
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
    """Decide ``jobs`` in one transaction; the outcomes are only valid once this returns.

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
    if len({job.processor.using for job in jobs}) > 1:
        # A router sending consumers to different databases: one transaction per database.
        return [outcome for job in jobs for outcome in process_batch([job], cache=cache)]
    decoded = [job.processor.decode(job.delivery) for job in jobs]
    settled: list[_Decided | None] = [None] * len(jobs)
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
            return [jobs[0].processor.commit_refused(jobs[0].delivery, refused.error)]
        logger.warning(
            "a batch of %d deliveries failed to commit (%s: %s); deciding them one by one",
            len(jobs),
            type(refused.error).__name__,
            refused.error,
        )
        return _one_by_one(jobs, cache)
    except DatabaseUnavailable:
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
    for job, message, done in zip(jobs, decoded, decided, strict=True):
        if done is None:
            outcomes.append(None)
            continue
        metrics.consumer_outcome(job.processor.spec.name, done.label, done.duration)
        if done.after_commit and isinstance(message, Message):
            _log_committed(job.processor.spec.name, message, done)
        outcomes.append(done.outcome)
    return outcomes


def _log_committed(consumer: str, message: Message, done: _Decided) -> None:
    if done.label == "duplicate":
        logger.info(
            "duplicate message_id=%s consumer=%s attempt=%d outcome=duplicate: already "
            "processed, acked without running the handler",
            message.message_id,
            consumer,
            message.attempt,
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
    settled: Sequence[_Decided | None],
    *,
    guarded: bool,
    failed: dict[int, Exception] | None = None,
) -> list[_Decided | None]:
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
            plain = []
            if connections[using].vendor in CLAIM_VENDORS:
                plain = [
                    i for i in pending if jobs[i].processor.plain(jobs[i].delivery, decoded[i])
                ]
            if plain:
                _run_claimed(jobs, decoded, decided, plain, using, guarded, failed or {})
            # The rest (bad input, ordered consumers, replays) one by one, each in savepoints.
            for index in pending:
                job = jobs[index]
                if decided[index] is not None or job.delivery.queue in held_queues:
                    continue
                done = job.processor.run(job.delivery, decoded[index])
                decided[index] = done
                if isinstance(done.outcome, RetryInPlace):
                    held_queues.add(job.delivery.queue)
    except (_Fallback, DatabaseUnavailable):
        raise
    except (OperationalError, InterfaceError) as exc:
        # Raised by the commit (or a statement outside any handler): the connection is gone.
        raise DatabaseUnavailable(f"database error while committing a batch: {exc}") from exc
    except DatabaseError as exc:
        # A deferred constraint (or the like) refused the commit: no savepoint can help.
        raise _CommitRefused(exc) from exc
    return decided


def _run_claimed(
    jobs: Sequence[Job],
    decoded: Sequence[Message | DecodeError],
    decided: list[_Decided | None],
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
        decided[index] = jobs[index].processor.on_failure(
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
    claimed, busy = _claim_inbox_rows(using, keys, wait)
    _remember_busy(busy)
    seen: set[tuple[str, str]] = set()
    processed: dict[str, list[str]] = {}
    for index, key, message in zip(indexes, keys, messages, strict=True):
        processor = jobs[index].processor
        if key in busy:
            decided[index] = processor.busy(jobs[index].delivery, message)
            continue
        if key not in claimed or key in seen:
            decided[index] = _Decided(
                Acknowledge("duplicate"), "duplicate", processed=True, after_commit=True
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
                processor.call_handler(message)
            except Exception as exc:  # the batch is redone guarded, this failure decided there
                if isinstance(exc, OperationalError | InterfaceError) and _connection_lost(using):
                    # Not the handler's failure: deciding it (after a reconnect) would spend an
                    # attempt on the database's outage. Nothing is decided, as when guarded.
                    raise DatabaseUnavailable(
                        f"database error on message_id={message.message_id}: {exc}"
                    ) from exc
                raise _Fallback(processor, index, exc) from exc
        duration = time.perf_counter() - started
        decided[index] = _Decided(
            Acknowledge("processed"), "processed", duration, processed=True, after_commit=True
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
) -> _Decided | None:
    """Run the handler in a savepoint; None when it succeeded, else its failure's outcome."""
    try:
        with transaction.atomic(using=processor.using):
            processor.call_handler(message)
    except Exception as exc:  # any handler error is an outcome to decide on
        if isinstance(exc, OperationalError | InterfaceError) and not (
            processor.connection_usable()
        ):
            raise DatabaseUnavailable(
                f"database error on message_id={message.message_id}: {exc}"
            ) from exc
        # Its effects rolled back with the savepoint; the claimed inbox row goes too.
        ProcessedMessage.objects.using(processor.using).forget(
            processor.spec.name, message.message_id
        )
        return processor.on_failure(delivery, message, exc, started)
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


def _claim_inbox_rows(
    using: str, keys: list[tuple[str, str]], lock_wait: float
) -> tuple[dict[tuple[str, str], bool], set[tuple[str, str]]]:
    """Insert the inbox rows of ``keys``; returns those this statement inserted (each with
    whether the consumer may hold an open dead letter of it: see :func:`_insert_inbox_rows`),
    and those another transaction holds (busy: not decided here, deferred).

    The rows go in sorted by key, not in batch order. A row another transaction inserted and
    has not committed makes the insert wait for that transaction; two batches sharing keys in
    different orders would each hold a row the other waits for (a deadlock, one batch killed).
    In one order for everyone, the second batch only waits for the first.

    The wait is bounded by ``lock_wait`` (see :func:`lock_wait_for`): past it the claim is rolled
    back to its savepoint and each row tried alone for a moment, so only the rows still held
    are put aside and the rest of the batch goes on.
    """
    ordered = sorted(set(keys))
    try:
        if _one_round_trip(using):
            return _claim_in_one_round_trip(using, ordered, lock_wait), set()
        with (
            transaction.atomic(using=using),
            bounded_lock_wait(using, lock_wait),
        ):
            return _insert_inbox_rows(using, ordered), set()
    except InboxRowBusy:
        pass
    claimed: dict[tuple[str, str], bool] = {}
    busy: set[tuple[str, str]] = set()
    for key in ordered:
        try:
            with transaction.atomic(using=using), bounded_lock_wait(using, ROW_LOCK_PROBE):
                claimed.update(_insert_inbox_rows(using, [key]))
        except InboxRowBusy:
            busy.add(key)
    return claimed, busy


# The batch claim's own savepoint, and the setting of the transaction that keeps the
# lock_timeout it replaces so that the same round trip can restore it.
CLAIM_SAVEPOINT = "rm_inbox_claim"
SAVED_LOCK_TIMEOUT = "reliable_messaging.saved_lock_timeout"


def _one_round_trip(using: str) -> bool:
    """Whether the claim may go as one script of several statements: PostgreSQL through
    psycopg 3 with client-side binding (Django's default). Server-side binding (the
    ``server_side_binding`` option) and psycopg2 take a statement per round trip."""
    connection = connections[using]
    if connection.vendor != "postgresql" or CLIENT_CURSOR is None:
        return False
    with connection.cursor() as cursor:
        return isinstance(cursor.cursor, CLIENT_CURSOR)


def _claim_in_one_round_trip(
    using: str, keys: list[tuple[str, str]], lock_wait: float
) -> dict[tuple[str, str], bool]:
    """The batch claim as :func:`bounded_lock_wait` around :func:`_insert_inbox_rows` in a
    savepoint does it, in one round trip instead of five (savepoint, set the lock_timeout,
    insert, restore it, release): on a loaded machine each round trip costs as much as the
    statement. Raises :class:`InboxRowBusy` when the wait was cut short, after rolling back to
    the savepoint (which restores the lock_timeout too)."""
    connection = connections[using]
    lock, lock_params = _key_locks_sql(keys)
    insert, params = _insert_inbox_rows_sql(using, keys)
    params = [*lock_params, *params]
    bounded = lock_wait > 0
    script = [f"SAVEPOINT {CLAIM_SAVEPOINT}"]
    if bounded:
        script.append(
            f"SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true), "
            "set_config('lock_timeout', %s, true)"
        )
        params = [f"{max(1, round(lock_wait * 1000))}ms", *params]
    script += [lock, insert]
    if bounded:
        script.append(
            f"SELECT set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true)"
        )
    script.append(f"RELEASE SAVEPOINT {CLAIM_SAVEPOINT}")
    with connection.cursor() as cursor:
        try:
            cursor.execute("; ".join(script), params)
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            cursor.execute(
                f"ROLLBACK TO SAVEPOINT {CLAIM_SAVEPOINT}; RELEASE SAVEPOINT {CLAIM_SAVEPOINT}"
            )
            raise InboxRowBusy(str(exc)) from exc
        raw = cursor.cursor
        while raw.description is None or raw.description[0].name != "consumer":
            if not raw.nextset():  # pragma: no cover - the script always has the claim
                raise RuntimeError("the inbox claim returned no rows")
        return {(consumer, message_id): bool(open_) for consumer, message_id, open_ in raw}


def _insert_inbox_rows_sql(using: str, keys: list[tuple[str, str]]) -> tuple[str, list[Any]]:
    """The claim's statement and parameters; see :func:`_insert_inbox_rows`."""
    connection = connections[using]
    table = connection.ops.quote_name(ProcessedMessage._meta.db_table)
    now = timezone.now()
    params: list[Any] = []
    for consumer, message_id in keys:
        params += [consumer, message_id, now]
    rows = ", ".join(["(%s, %s, %s)"] * (len(params) // 3))
    if connection.vendor != "postgresql":
        insert = (
            f"INSERT INTO {table} (consumer, message_id, processed_at) "  # noqa: S608
            f"VALUES {rows} ON CONFLICT (consumer, message_id) DO NOTHING "
            "RETURNING consumer, message_id"
        )
        # SQLite has no INSERT in a WITH: every claimed row may have an open dead letter.
        return f"{insert}, 1", params
    # The inbox is partitioned by day (partitions.py): a unique index spans one partition, so
    # the key is looked for in every partition first. Run after _key_locks_sql's statement, in
    # a snapshot of its own, this sees any copy committed while the lock was awaited; a copy
    # in the same partition and not yet committed makes ON CONFLICT wait, as before.
    insert = (
        f"INSERT INTO {table} (consumer, message_id, processed_at) "  # noqa: S608
        f"SELECT v.consumer, v.message_id, v.processed_at FROM (VALUES {rows}) "
        "AS v (consumer, message_id, processed_at) WHERE NOT EXISTS ("
        f"SELECT 1 FROM {table} AS p "
        "WHERE p.message_id = v.message_id AND p.consumer = v.consumer) "
        "ON CONFLICT DO NOTHING RETURNING consumer, message_id"
    )
    letters = connection.ops.quote_name(DeadLetter._meta.db_table)
    sql = (
        f"WITH claimed AS ({insert}) SELECT consumer, message_id, EXISTS ("  # noqa: S608
        f"SELECT 1 FROM {letters} AS d WHERE d.consumer = claimed.consumer "
        f"AND d.message_id = claimed.message_id AND d.status IN (%s, %s)) FROM claimed"
    )
    return sql, [*params, *BLOCKING_STATUSES]


def _insert_inbox_rows(using: str, keys: list[tuple[str, str]]) -> dict[tuple[str, str], bool]:
    """Insert the inbox rows of ``keys`` that are not there yet (``ON CONFLICT DO NOTHING``);
    returns those inserted, each with whether its consumer holds a dead letter of it that a
    processed copy must resolve (:func:`.replay.resolve_processed_copies`, after the handler).
    Looked up in the same statement on PostgreSQL, which saves the batch a round trip; a dead
    letter of the key can only appear meanwhile from a copy that could not take the inbox row
    (a malformed one, or one parked), as it can between any lookup and the commit."""
    sql, params = _insert_inbox_rows_sql(using, keys)
    with connections[using].cursor() as cursor:
        if connections[using].vendor == "postgresql":
            cursor.execute(*_key_locks_sql(keys))
        cursor.execute(sql, params)
        return {(consumer, message_id): bool(open_) for consumer, message_id, open_ in cursor}


def _key_hash(consumer: str, message_id: str) -> int:
    """A stable 32-bit signed hash of the pair (two pairs sharing one only wait for each
    other a moment longer)."""
    value = zlib.crc32(f"{consumer}\x1f{message_id}".encode("utf-8", "surrogatepass"))
    return value - (1 << 32) if value >= 1 << 31 else value


def _key_locks_sql(keys: Sequence[tuple[str, str]]) -> tuple[str, list[Any]]:
    """The statement that takes, in one order for everyone (so two batches sharing keys never
    deadlock), a transaction-scoped advisory lock per (consumer, message_id) of ``keys``. Two
    copies of a message handled at once wait for each other here whichever day's partition
    they would go to; the wait is bounded by the transaction's lock_timeout like a row's."""
    hashes = sorted({_key_hash(consumer, message_id) for consumer, message_id in keys})
    return (
        "SELECT count(pg_advisory_xact_lock(%s, k)) FROM unnest(%s::int[]) AS k",
        [CLAIM_LOCK_CLASS, hashes],
    )


def insert_inbox_row(using: str, consumer: str, message_id: str) -> bool:
    """Insert the inbox row of one message, in the caller's transaction: ``True`` if it went
    in, ``False`` if the key is already there (a duplicate). A copy of it in a transaction not
    yet committed makes this wait for that one's outcome."""
    if connections[using].vendor in CLAIM_VENDORS:
        return (consumer, message_id) in _insert_inbox_rows(using, [(consumer, message_id)])
    try:
        with transaction.atomic(using=using):
            ProcessedMessage.objects.using(using).create(consumer=consumer, message_id=message_id)
    except IntegrityError:
        return False
    return True


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
    decided: list[_Decided | None],
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
    known = cache.processed([(name, message.message_id) for _, name, message in candidates])
    to_lease: list[tuple[int, tuple[str, str], Message]] = []
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
            decided[index] = _Decided(Acknowledge("duplicate"), "duplicate")
            continue
        metrics.dedup_cache(name, "miss")
        if not jobs[index].processor.spec.ordered:
            # Ordered partitions have one consumer at a time already (single active consumer).
            to_lease.append((index, key, message))
    leases = cache.lease(list(dict.fromkeys(key for _, key, _ in to_lease)))
    if leases is None:
        return []
    leased: list[tuple[str, str]] = []
    for index, key, message in to_lease:
        if leases[key]:
            leases[key] = False  # the same message twice in one batch: the inbox decides
            leased.append(key)
        elif key not in leased:
            metrics.dedup_cache(key[0], "lease_busy")
            decided[index] = jobs[index].processor.defer(jobs[index].delivery, message)
    return leased
