"""The long-running consumer: one broker connection (:mod:`.connection`), N worker threads
(:mod:`.workers`) and the :mod:`.board` between them; reconnects by itself
(``docs/design.md#the-consumer-service-and-its-threads``)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable

from django.db import connections, router

from .. import metrics
from ..broker.pika_transport import PikaTransport
from ..broker.topology import consumer_queues
from ..broker.transport import BrokerTransport
from ..conf import MessagingSettings, messaging_settings
from ..core.envelope import Delivery
from ..core.liveness import HealthState
from ..core.outcomes import Outcome
from ..core.registry import ConsumerSpec
from ..models import ProcessedMessage
from ..storage.partitions import PartitionUpkeep
from .board import WorkBoard
from .breaker import ConsumerBreakers
from .connection import ConnectionThread
from .crash_guard import TIMEOUT, CrashGuard
from .fastpath import duplicate_cache
from .processing import DeliveryProcessor
from .settling import OutcomeSettler
from .time_limit import time_limits
from .workers import WorkerPool

# Seconds between two progress lines of a running consumer.
PROGRESS_EVERY = 30.0


class ConsumerService:
    """Consumes the queues of ``specs`` until :meth:`request_stop` (or the idle timeout), over
    ``transport`` (pika unless given)."""

    def __init__(
        self,
        specs: Iterable[ConsumerSpec],
        *,
        concurrency: int = 1,
        idle_timeout: float | None = None,
        settings: MessagingSettings = messaging_settings,
        on_outcome: Callable[[ConsumerSpec, Delivery, Outcome], None] | None = None,
        health: HealthState | None = None,
        progress_interval: float = PROGRESS_EVERY,
        transport: BrokerTransport | None = None,
    ) -> None:
        self.specs = list(specs)
        if not self.specs:
            raise ValueError("no consumers to run")
        concurrency = max(1, concurrency)
        self.settings = settings
        # Without one (no /healthz), a state nobody reads, so the parts need not ask.
        self.health = health = health if health is not None else HealthState()
        self._stop = threading.Event()
        cache = duplicate_cache(settings)
        processors = {spec.name: DeliveryProcessor(spec, settings, cache) for spec in self.specs}
        metrics.consumers_started(processors)
        self._crash_guard = CrashGuard(settings.crash_limit)
        board = WorkBoard(concurrency)
        self.breakers = ConsumerBreakers(self.specs, settings, health=health)
        # Each ordered partition queue is tied to one worker, round robin.
        workers = itertools.cycle(range(concurrency))
        lane_of = {
            queue: next(workers)
            for spec in self.specs
            if spec.ordered
            for queue in consumer_queues(spec, settings)
        }
        settler = OutcomeSettler(on_outcome)
        self._connection = ConnectionThread(
            self.specs,
            transport=transport if transport is not None else PikaTransport(),
            board=board,
            lane_of=lane_of,
            settler=settler,
            settings=settings,
            stop=self._stop,
            concurrency=concurrency,
            idle_timeout=idle_timeout,
            # Seconds between progress lines (outcomes so far); 0: none.
            progress_interval=progress_interval if progress_interval > 0 else float("inf"),
            cache=cache,
            health=health,
            breakers=self.breakers,
        )
        self._workers = WorkerPool(
            board,
            processors,
            concurrency=concurrency,
            settings=settings,
            crash_guard=self._crash_guard,
            stop=self._stop,
            hand_back=settler.hand_back,
            health=health,
            breakers=self.breakers,
        )
        health.add_problem_source(self._connection.idle_for_want_of_queues)

    @property
    def connected(self) -> threading.Event:
        """Set while connected to the broker and consuming."""
        return self._connection.connected

    @property
    def exit_code(self) -> int:
        """0; 1: handlers still running at the stop; 2: topology conflict; 4: workers dying."""
        return self._workers.exit_code or self._connection.exit_code

    def request_stop(self) -> None:
        """Stop after the handlers in flight; safe from a signal handler or another thread."""
        self._stop.set()
        self.health.stopping()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        """Consume on the calling thread (the connection's thread) until stopped; the exit code."""
        self._start_time_limits()
        upkeep = PartitionUpkeep(
            router.db_for_write(ProcessedMessage),
            retention=self.settings.dedup_retention,
            health=self.health,
        )
        upkeep.start()
        self._workers.start()
        try:
            code = self._connection.run()
            return self._workers.exit_code or code
        finally:
            self._connection.set_connected(False)
            self._workers.stop()
            time_limits.stop()
            upkeep.stop()

    def _start_time_limits(self) -> None:
        def timed_out(consumer: str, message_id: str, seconds: float) -> None:
            metrics.handler_timeout(consumer)

        def hopeless(consumer: str, message_id: str) -> None:
            # The watchdog's own database connection: count the death before the exit.
            try:
                self._crash_guard.record_death(consumer, message_id, TIMEOUT)
            finally:
                connections.close_all()

        time_limits.on_timeout = timed_out
        time_limits.on_hopeless = hopeless
        time_limits.start(self.settings.handler_timeout_grace)
        self.health.add_problem_source(time_limits.overdue)
