"""The circuit breaker of one consumer in one consume process: closed, open, half-open.

Worker threads ask :meth:`CircuitBreaker.admit` before a delivery's handler may run and report
each decided outcome with :meth:`CircuitBreaker.record`; the connection's thread reads
:attr:`CircuitBreaker.state` in its loop and stops or resumes taking deliveries of the
consumer's queues to match (:mod:`.connection`). Only the handler's own failures count
(:func:`handler_verdict`): what the database, the broker or a bad message does never opens it,
as it never costs the handler an attempt. ``docs/circuit-breaker.md`` is the user's view.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable

from .. import metrics
from ..conf import MessagingSettings
from ..core.breaker import Breaker
from ..core.liveness import HealthState
from ..core.outcomes import (
    Acknowledge,
    FailureReason,
    Outcome,
    OutcomeLabel,
    RetryInPlace,
    ScheduleRetry,
)
from ..core.registry import ConsumerSpec

logger = logging.getLogger(__name__)

# Dead letters the handler itself caused; every other reason (undecodable, parked, crashed,
# our own error, the broker's delivery limit, expired) is not the handler's failure.
HANDLER_FAILURES = frozenset(
    {FailureReason.PERMANENT, FailureReason.RETRIES_EXHAUSTED, FailureReason.TIMEOUT}
)


class BreakerState(enum.IntEnum):
    """The value of ``reliable_messaging_breaker_state``."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


def breaker_for(spec: ConsumerSpec, settings: MessagingSettings) -> Breaker | None:
    """The breaker ``spec`` runs with: its own, none when it says ``breaker=False``, else the
    ``BREAKER`` setting's (None: no breaker)."""
    if spec.breaker is False:
        return None
    if spec.breaker is not None:
        return spec.breaker
    return settings.breaker


def handler_verdict(outcome: Outcome) -> bool | None:
    """True when ``outcome`` is the handler's failure (it raised or timed out: a retry or a
    dead letter of its doing), False when it processed the message, None for anything that
    says nothing about the handler (a duplicate, a deferral, a refusal of foreign input, a
    parked or expired message, a delivery given back undecided)."""
    if isinstance(outcome, Acknowledge):
        if outcome.result == OutcomeLabel.PROCESSED:
            return False
        if outcome.result == OutcomeLabel.DEAD_LETTERED and outcome.reason in HANDLER_FAILURES:
            return True
        return None
    if isinstance(outcome, ScheduleRetry | RetryInPlace):
        return None if outcome.deferred else True
    return None


Listener = Callable[["CircuitBreaker", BreakerState, BreakerState], None]


class CircuitBreaker:
    """The state of one consumer's breaker; thread-safe.

    Closed: outcomes fill a window of the last ``window`` verdicts; it opens when at least
    ``min_failures`` of them failed and they are at least ``failure_rate`` of the window.
    Open: :meth:`admit` refuses everything for ``pause`` seconds, and outcomes of deliveries
    that started before are not counted. Half-open: ``probes`` deliveries are admitted; it
    closes (with an empty window) once that many succeeded and opens again at the first
    failure. ``listener(breaker, old, new)`` hears every transition, under the breaker's lock
    (keep it short: a log line, a gauge, a note).
    """

    def __init__(
        self,
        consumer: str,
        config: Breaker,
        *,
        clock: Callable[[], float] = time.monotonic,
        listener: Listener | None = None,
    ) -> None:
        self.consumer = consumer
        self.config = config
        self._clock = clock
        self._listener = listener
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._window: collections.deque[bool] = collections.deque(maxlen=config.window)
        self._reopen_at = 0.0
        self._probes_admitted = 0
        self._probes_passed = 0
        self.opened = 0  # times it opened

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._current()

    @property
    def resumes_in(self) -> float:
        """Seconds left in the pause (0 unless open)."""
        with self._lock:
            if self._current() is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self._reopen_at - self._clock())

    def room(self) -> int:
        """How many deliveries may start together now: closed, as many as could fail before
        it opens (at least one), so that a batch does not spend a whole outage's worth of
        attempts before the breaker sees the first failure; 0 while open or half-open (a
        half-open breaker admits its probes one by one through :meth:`admit`)."""
        with self._lock:
            if self._current() is not BreakerState.CLOSED:
                return 0
            return max(1, self.config.min_failures - sum(self._window))

    def admit(self) -> bool:
        """May a delivery's handler run now? A half-open breaker admits ``probes`` of them."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return True
            if state is BreakerState.OPEN or self._probes_admitted >= self.config.probes:
                return False
            self._probes_admitted += 1
            return True

    def record(self, failed: bool | None) -> BreakerState | None:
        """Count the verdict of a decided delivery (see :func:`handler_verdict`); the new
        state when this verdict changed it."""
        with self._lock:
            state = self._current()
            if state is BreakerState.OPEN:
                return None  # started before it opened: the pause is already decided
            if state is BreakerState.HALF_OPEN:
                if failed is None:
                    # Said nothing about the handler: its probe slot goes to another delivery.
                    self._probes_admitted = max(0, self._probes_admitted - 1)
                    return None
                if failed:
                    return self._open(
                        f"a probe failed while half-open (after {self._probes_passed} passed)"
                    )
                self._probes_passed += 1
                if self._probes_passed >= self.config.probes:
                    return self._close()
                return None
            if failed is None:
                return None
            self._window.append(failed)
            failures = sum(self._window)
            if failures >= self.config.min_failures and failures >= self.config.failure_rate * len(
                self._window
            ):
                return self._open(f"{failures} of the last {len(self._window)} deliveries failed")
            return None

    # -- under the lock --------------------------------------------------------------------------

    def _current(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._reopen_at:
            self._move(BreakerState.HALF_OPEN)
            self._probes_admitted = 0
            self._probes_passed = 0
            logger.info(
                "circuit breaker of consumer=%s half-open: letting %d probe deliveries through",
                self.consumer,
                self.config.probes,
            )
        return self._state

    def _open(self, why: str) -> BreakerState:
        self._reopen_at = self._clock() + self.config.pause
        self.opened += 1
        self._window.clear()
        self._move(BreakerState.OPEN)
        logger.warning(
            "circuit breaker of consumer=%s opened: %s (failure_rate %g, min_failures %d, "
            "window %d); taking none of its deliveries for %gs, no attempt charged meanwhile",
            self.consumer,
            why,
            self.config.failure_rate,
            self.config.min_failures,
            self.config.window,
            self.config.pause,
        )
        return BreakerState.OPEN

    def _close(self) -> BreakerState:
        self._window.clear()
        self._move(BreakerState.CLOSED)
        logger.info(
            "circuit breaker of consumer=%s closed: %d probe deliveries succeeded; consuming again",
            self.consumer,
            self._probes_passed,
        )
        return BreakerState.CLOSED

    def _move(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        if self._listener is not None:
            self._listener(self, old, new)


class ConsumerBreakers:
    """The breakers of one consume process, by consumer name; each transition shows in the
    metrics and as a ``/healthz`` note (a paused consumer is not a sick process: restarting it
    would not bring the downstream back)."""

    def __init__(
        self,
        specs: Iterable[ConsumerSpec],
        settings: MessagingSettings,
        *,
        health: HealthState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health = health
        self._by_consumer: dict[str, CircuitBreaker] = {}
        for spec in specs:
            config = breaker_for(spec, settings)
            if config is None:
                continue
            self._by_consumer[spec.name] = CircuitBreaker(
                spec.name, config, clock=clock, listener=self._changed
            )
            metrics.breaker_state(spec.name, BreakerState.CLOSED)

    def __bool__(self) -> bool:
        return bool(self._by_consumer)

    def get(self, consumer: str) -> CircuitBreaker | None:
        return self._by_consumer.get(consumer)

    def _changed(self, breaker: CircuitBreaker, old: BreakerState, new: BreakerState) -> None:
        metrics.breaker_state(breaker.consumer, new)
        if new is BreakerState.OPEN:
            metrics.breaker_opened(breaker.consumer)
        if self.health is None:
            return
        note: str | None = None
        if new is BreakerState.OPEN:
            note = (
                f"circuit breaker of consumer {breaker.consumer} open: taking none of its "
                f"deliveries for {breaker.config.pause:g}s (opened {breaker.opened} time(s))"
            )
        elif new is BreakerState.HALF_OPEN:
            note = (
                f"circuit breaker of consumer {breaker.consumer} half-open: "
                f"{breaker.config.probes} probe deliveries decide whether it closes"
            )
        self.health.note(f"breaker:{breaker.consumer}", note)
