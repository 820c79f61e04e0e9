"""The consumer's worker threads: batches from the :class:`~.board.WorkBoard` through the inbox,
outcomes handed back to the connection thread (``docs/design.md#worker-deaths``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from django.db import DatabaseError, close_old_connections, connections

from ..broker.topology import consumer_queues
from ..conf import MessagingSettings
from ..core.backoff import Backoff
from ..core.database_errors import CONFLICT_RETRIES, OutageLog, conflict_delay, describe
from ..core.liveness import HealthState
from ..core.outcomes import Outcome, Release, RetryInPlace
from ..exceptions import DatabaseConflict, DatabaseUnavailable
from .board import DeliveryWork, HeldPartition, WorkBoard
from .breaker import Admission, ConsumerBreakers
from .crash_guard import CRASHED, CrashGuard, SuspectGate, decide_suspect
from .last_resort import consumer_error, ingest_delivery_limit
from .processing import DeliveryProcessor, Job, process_batch, raise_database_trouble
from .time_limit import time_limits

logger = logging.getLogger(__name__)

# Worker threads that may die (and be replaced) in one process before it stops instead.
WORKER_DEATH_LIMIT = 3
# Failures of our own code (never the handler) on one delivery before it is ``consumer_error``.
CONSUMER_ERROR_LIMIT = 3
# Exit code of a consumer stopped because its worker threads kept dying.
EXIT_WORKERS_DYING = 4

# Outcomes a worker hands back: carried out on the connection's thread.
HandBack = Callable[[list[tuple[DeliveryWork, Outcome]]], None]


def _key(item: DeliveryWork) -> tuple[int, int, int]:
    """What identifies a delivery on its link (an in-place retry's copy included)."""
    return (id(item.link), item.channel.channel_number, item.delivery.delivery_tag)


def _held_back(held: dict[str, HeldPartition], item: DeliveryWork) -> bool:
    """Put ``item`` behind its queue's held deliveries, in order; False when none are held."""
    waiting = held.get(item.delivery.queue)
    if waiting is not None:
        waiting.items.append(item)
    return waiting is not None


class WorkerPool:
    """``concurrency`` daemon threads taking batches from ``board`` until it is closed."""

    def __init__(
        self,
        board: WorkBoard,
        processors: Mapping[str, DeliveryProcessor],
        *,
        concurrency: int,
        settings: MessagingSettings,
        crash_guard: CrashGuard,
        stop: threading.Event,
        hand_back: HandBack,
        health: HealthState | None = None,
        breakers: ConsumerBreakers | None = None,
    ) -> None:
        self.board = board
        self.processors = processors
        self.concurrency = concurrency
        self.settings = settings
        self.crash_guard = crash_guard
        # Without one (a test's pool), a state nobody reads.
        self.health = health if health is not None else HealthState()
        self._stop = stop
        self._deliver_outcomes = hand_back
        self.breakers = breakers if breakers is not None else ConsumerBreakers([], settings)
        self._gate = SuspectGate()
        self._threads: list[threading.Thread] = []
        # One WARNING when the database goes, one line when it is back, for all the threads.
        self._outage = OutageLog(logger)
        # The deliveries each worker thread took from the board and has not handed back yet.
        self._local = threading.local()
        self.deaths = 0
        self._deaths_lock = threading.Lock()
        # Why the pool gave up (its threads kept dying); the process then stops.
        self.failed: str | None = None
        self.health.add_problem_source(self.problems)

    def start(self) -> None:
        for index in range(self.concurrency):
            self._threads.append(self._start_worker(index))

    def _start_worker(self, index: int) -> threading.Thread:
        thread = threading.Thread(
            target=self._worker_loop, args=(index,), name=f"rm-worker-{index}", daemon=True
        )
        thread.start()
        return thread

    @property
    def exit_code(self) -> int:
        """0, or ``EXIT_WORKERS_DYING`` once the pool gave up."""
        return EXIT_WORKERS_DYING if self.failed else 0

    def problems(self) -> list[str]:
        """Why the pool is unhealthy now, in words (for ``/healthz``)."""
        if self.failed:
            return [self.failed]
        if self.board.closed or self._stop.is_set():
            return []
        return [
            f"worker thread {thread.name} is not running"
            for thread in list(self._threads)
            if not thread.is_alive()
        ]

    def stop(self, timeout: float = 5.0) -> None:
        """Close the board and wait (up to ``timeout``s) for the batches in hand to finish."""
        self.board.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _worker_loop(self, index: int) -> None:
        held: dict[str, HeldPartition] = {}
        limit = max(1, self.settings.consumer_batch_size)
        self._local.in_hand = {}
        try:
            while True:
                now = time.monotonic()
                batch: list[DeliveryWork] = []
                for queue in [q for q, h in held.items() if h.ready_at <= now]:
                    batch.extend(held.pop(queue).items)
                if self.board.closed or self._stop.is_set():
                    self._release_held(held, "stopping: kept for a retry in place or a breaker")
                if self.board.closed and self.board.empty() and not batch:
                    return
                wait = 0.0 if batch else 0.5
                if held and not batch:
                    wait = min(wait, max(0.0, min(h.ready_at for h in held.values()) - now))
                for item in self.board.take(index, limit - len(batch), wait):
                    self._local.in_hand[_key(item)] = item
                    if not held or not _held_back(held, item):
                        batch.append(item)
                if batch:
                    self._run_batch(batch, held)
        except BaseException as exc:  # noqa: BLE001 - see _worker_died
            self._worker_died(index, exc)
        finally:
            connections.close_all()

    def _count_death(self, item: DeliveryWork) -> None:
        """A suspect runs alone, so it killed the thread: count the death (:mod:`.crash_guard`)."""
        try:
            message_id = self.processors[item.spec.name].decode(item.delivery).message_id
            if message_id:
                self.crash_guard.record_death(item.spec.name, message_id, CRASHED)
        except Exception:  # given back all the same; counted on its redelivery
            logger.exception(
                "could not count the death of a worker against message_id=%s",
                item.delivery.message_id,
            )

    def _hand_back(self, settled: list[tuple[DeliveryWork, Outcome]]) -> None:
        for item, _ in settled:
            self._local.in_hand.pop(_key(item), None)
        self._deliver_outcomes(settled)

    def _worker_died(self, index: int, exc: BaseException) -> None:
        """Give back what the dying worker held, then replace it or, past the limit, stop."""
        # Its handler's time limit, if the exception left the call registered.
        time_limits.discard()
        items = list(self._local.in_hand.values())
        self._local.in_hand.clear()
        with self._deaths_lock:
            self.deaths += 1
            deaths = self.deaths
        replace = deaths < WORKER_DEATH_LIMIT
        ids = ", ".join(item.delivery.message_id or "?" for item in items[:10])
        logger.error(
            "worker thread rm-worker-%d died: %s: %s; giving its %d deliveries back to the "
            "broker unacked, no attempt charged (message_id=%s%s); %s",
            index,
            type(exc).__name__,
            exc,
            len(items),
            ids or "-",
            ", ..." if len(items) > 10 else "",
            f"replacing it (death {deaths} of {WORKER_DEATH_LIMIT} allowed)"
            if replace
            else f"{deaths} worker deaths: stopping the process with exit code "
            f"{EXIT_WORKERS_DYING} so that its supervisor starts a fresh one",
            exc_info=exc,
        )
        if len(items) == 1 and items[0].suspect:
            self._count_death(items[0])
        for item in items:
            if item.channel.channel_number in item.link.ordered and item.link.dropping is None:
                # A nack would lose the partition's order; a drop gives it back in place.
                item.link.dropping = (
                    f"worker thread died holding message_id={item.delivery.message_id} "
                    f"of ordered queue {item.delivery.queue}"
                )
        if items:
            self._hand_back([(item, Release(f"worker thread died: {exc!r}")) for item in items])
        if not replace:
            self.failed = (
                f"{deaths} worker threads died (last: {type(exc).__name__}: {exc}); stopping"
            )
            self._stop.set()
            return
        self.health.note(
            "worker-deaths",
            f"{deaths} worker thread(s) died and were replaced (last: "
            f"{type(exc).__name__}: {exc}); their deliveries went back to the broker",
        )
        if not self.board.closed:
            self._threads[index] = self._start_worker(index)

    def _release_held(self, held: dict[str, HeldPartition], why: str) -> None:
        items = [item for waiting in held.values() for item in waiting.items]
        held.clear()
        if items:
            self._hand_back([(item, Release(why)) for item in items])

    def _run_batch(self, batch: list[DeliveryWork], held: dict[str, HeldPartition]) -> None:
        """Decide ``batch`` in arrival order: fresh deliveries together, each suspect alone."""
        segment: list[DeliveryWork] = []
        for item in batch:
            if item.suspect or item.from_dead_letter_queue:
                self._run_segment(segment, held)
                self._run_segment([item], held)
                segment = []
            else:
                segment.append(item)
        self._run_segment(segment, held)

    def _run_segment(self, segment: list[DeliveryWork], held: dict[str, HeldPartition]) -> None:
        settled: list[tuple[DeliveryWork, Outcome]] = []
        rest = segment
        while rest:
            batch: list[DeliveryWork] = []
            for item in rest:
                if not held or not _held_back(held, item):
                    batch.append(item)
            rest = []
            admissions: list[Admission | None] = [None] * len(batch)
            kept_back: list[DeliveryWork] = []
            if batch and self.breakers:
                batch, admissions, kept_back, rest = self.breakers.admit(batch)
            if batch:
                outcomes = self._decide(batch)
                if self.breakers:
                    self.breakers.report(batch, admissions, outcomes)
                for item, outcome in zip(batch, outcomes, strict=True):
                    if isinstance(outcome, RetryInPlace):
                        held[item.delivery.queue] = HeldPartition(
                            time.monotonic() + outcome.delay, [item.again(outcome)]
                        )
                    elif outcome is None:
                        held[item.delivery.queue].items.append(item)
                    else:
                        settled.append((item, outcome))
            for item in kept_back:
                if not _held_back(held, item):
                    again_at = self.breakers.asked_again_at(item)
                    held[item.delivery.queue] = HeldPartition(again_at, [item])
        if settled:
            self._hand_back(settled)

    def _decide(self, batch: list[DeliveryWork]) -> list[Outcome | None]:
        """The batch's outcomes; deliveries whose link is gone are given back unstarted."""
        if self._stop.is_set():
            return [Release("stopping: not started")] * len(batch)
        gone = [not item.link.open for item in batch]
        if not any(gone):
            return self._decide_live(batch)
        live = [item for item, lost in zip(batch, gone, strict=True) if not lost]
        decided = iter(self._decide_live(live) if live else [])
        return [
            Release("connection lost before the handler started") if lost else next(decided)
            for lost in gone
        ]

    def _attempt(self, batch: list[DeliveryWork]) -> list[Outcome | None]:
        """One try at ``batch`` (a ``.dead`` delivery or a suspect alone); the database's
        trouble raises DatabaseUnavailable or DatabaseConflict, charged to no one."""
        item = batch[0]
        processor = self.processors[item.spec.name]
        try:
            if len(batch) == 1 and item.from_dead_letter_queue:
                queues = consumer_queues(item.spec, self.settings)
                return [ingest_delivery_limit(processor, item.delivery, queues)]
            if len(batch) == 1 and item.suspect:
                with self._gate.exclusive():
                    job = Job(processor, item.delivery)
                    return [
                        decide_suspect(
                            self.crash_guard,
                            processor,
                            item.delivery,
                            lambda: process_batch([job])[0],
                        )
                    ]
            jobs = [Job(self.processors[work.spec.name], work.delivery) for work in batch]
            with self._gate.shared():
                return process_batch(jobs)
        except DatabaseError as exc:
            raise_database_trouble(exc, item.delivery.message_id or "-")
            raise

    def _decide_live(self, batch: list[DeliveryWork]) -> list[Outcome | None]:
        wait = Backoff(0.5, self.settings.reconnect_max_delay)
        errors = 0
        conflicts = 0
        while True:
            # Drop connections that broke or outlived CONN_MAX_AGE, as Django does per request.
            close_old_connections()
            try:
                outcomes = self._attempt(batch)
                self.health.set_database(True)
                self._outage.recovered()
                return outcomes
            except DatabaseUnavailable as exc:
                delay = wait.next()
                self.health.set_database(False, describe(exc))
                self._outage.held([item.delivery.message_id or "-" for item in batch], exc, delay)
            except DatabaseConflict as exc:
                # Our bookkeeping's deadlock (a handler's is run again by process_batch).
                conflicts += 1
                if conflicts > CONFLICT_RETRIES:
                    item = batch[0]
                    return [consumer_error(self.processors[item.spec.name], item.delivery, exc, 1)]
                delay = conflict_delay(conflicts - 1)
                logger.info(
                    "database conflict (%s) on message_id=%s: running again in %.2fs",
                    describe(exc),
                    batch[0].delivery.message_id,
                    delay,
                )
            except Exception as exc:
                # A bug on our side (never the handler's: its exceptions are outcomes).
                errors += 1
                if len(batch) > 1:
                    logger.exception(
                        "unexpected error while processing %d deliveries (message_id=%s, ...); "
                        "deciding them one by one to find the one it comes from",
                        len(batch),
                        batch[0].delivery.message_id,
                    )
                    return self._decide_one_by_one(batch)
                if errors >= CONSUMER_ERROR_LIMIT:
                    item = batch[0]
                    return [
                        consumer_error(self.processors[item.spec.name], item.delivery, exc, errors)
                    ]
                delay = wait.next()
                logger.exception(
                    "unexpected error while processing message_id=%s (failure %d of %d before "
                    "it is dead-lettered); holding it unacked and retrying in %.1fs",
                    batch[0].delivery.message_id,
                    errors,
                    CONSUMER_ERROR_LIMIT,
                    delay,
                )
            finally:
                close_old_connections()
            for conn in connections.all(initialized_only=True):
                conn.close()
            if self._stop.wait(delay):
                return [Release("stopping while the database is unavailable")] * len(batch)
            if not all(item.link.open for item in batch):
                return [Release("connection lost while the database was unavailable")] * len(batch)
            if time.monotonic() - batch[0].received > self.settings.max_hold_seconds:
                logger.warning(
                    "message_id=%s%s held unacked for over %.0fs (half of "
                    "BROKER_CONSUMER_TIMEOUT): giving back to the broker",
                    batch[0].delivery.message_id,
                    f" and {len(batch) - 1} more" if len(batch) > 1 else "",
                    self.settings.max_hold_seconds,
                )
                return [Release("held too long without an outcome")] * len(batch)

    def _decide_one_by_one(self, batch: list[DeliveryWork]) -> list[Outcome | None]:
        outcomes: list[Outcome | None] = []
        held_queues: set[str] = set()
        for item in batch:
            if item.delivery.queue in held_queues:
                outcomes.append(None)  # behind an in-place retry of its partition
                continue
            outcome = self._decide_live([item])[0]
            outcomes.append(outcome)
            if isinstance(outcome, RetryInPlace):
                held_queues.add(item.delivery.queue)
        return outcomes
