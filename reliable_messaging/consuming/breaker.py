"""The circuit breaker of one consumer in one consume process (``docs/circuit-breaker.md``):
workers ask :meth:`ConsumerBreakers.admit` which deliveries may run and report their outcomes."""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .board import DeliveryWork

logger = logging.getLogger(__name__)

# Share of the hold bound (``max_hold_seconds``) a delivery may wait for its breaker.
BREAKER_HOLD_SHARE = 0.8

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
    """``spec``'s own breaker, none for ``breaker=False``, else the ``BREAKER`` setting's."""
    if spec.breaker is False:
        return None
    if spec.breaker is not None:
        return spec.breaker
    return settings.breaker


def handler_verdict(outcome: Outcome) -> bool | None:
    """True for the handler's failure (a retry or dead letter of its doing), False when it
    processed the message, None for anything that says nothing about the handler."""
    if isinstance(outcome, Acknowledge):
        if outcome.result == OutcomeLabel.PROCESSED:
            return False
        if outcome.result == OutcomeLabel.DEAD_LETTERED and outcome.reason in HANDLER_FAILURES:
            return True
    elif isinstance(outcome, ScheduleRetry | RetryInPlace):
        return None if outcome.deferred else True
    return None


# How often a delivery waiting for a half-open breaker looks again for a probe's place.
HALF_OPEN_LOOK = 0.1


@dataclass(frozen=True)
class Admission:
    """A delivery let in by a breaker: in which period (``epoch``, one per state) and whether
    as a half-open probe. Only a verdict of the current period counts."""

    epoch: int
    probe: bool = False


class CircuitBreaker:
    """The state of one consumer's breaker (thread-safe), as ``docs/circuit-breaker.md``
    describes; ``listener(breaker, old, new)`` hears every transition, under the lock."""

    def __init__(
        self,
        consumer: str,
        config: Breaker,
        *,
        clock: Callable[[], float] = time.monotonic,
        listener: Callable[[CircuitBreaker, BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.config = config
        self._clock = clock
        self._listener = listener
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._epoch = 0
        self._window: collections.deque[bool] = collections.deque(maxlen=config.window)
        self._reopen_at = 0.0
        self._reopenings = 0  # failed half-open rounds since it last closed
        self.pause = config.pause  # of the current (or last) opening
        self._probes_running = 0
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

    def look_again_in(self) -> float:
        """When a delivery not admitted should ask again (shortly while half-open)."""
        return HALF_OPEN_LOOK if self.state is BreakerState.HALF_OPEN else self.resumes_in

    def room(self) -> int:
        """How many deliveries may start together: closed, as many as could fail before it
        opens (at least one); 0 otherwise (probes are admitted one by one)."""
        with self._lock:
            if self._current() is not BreakerState.CLOSED:
                return 0
            return max(1, self.config.min_failures - sum(self._window))

    def admit(self, *, overdue: bool = False) -> Admission | None:
        """May a delivery's handler run now? Closed, yes; half-open, as a probe; open, no.
        ``overdue`` ones run all the same, their verdict not counted."""
        with self._lock:
            state = self._current()
            if state is BreakerState.CLOSED:
                return Admission(self._epoch)
            if state is BreakerState.HALF_OPEN and self._probes_running < self.config.probes:
                self._probes_running += 1
                return Admission(self._epoch, probe=True)
            return Admission(-1) if overdue else None

    def record(self, admission: Admission, failed: bool | None) -> BreakerState | None:
        """Count a verdict (:func:`handler_verdict`); the new state when it changed."""
        with self._lock:
            state = self._current()
            if admission.epoch != self._epoch:
                return None  # started in an earlier period: the state it spoke of is gone
            if state is BreakerState.HALF_OPEN:
                if not admission.probe:
                    return None
                if failed is None:
                    # Said nothing about the handler: its place goes to another delivery.
                    self._probes_running -= 1
                    return None
                if failed:
                    self._reopenings += 1
                    return self._open(
                        f"a probe failed while half-open (after {self._probes_passed} passed)"
                    )
                self._probes_passed += 1
                if self._probes_passed >= self.config.probes:
                    return self._close()
                return None
            if state is not BreakerState.CLOSED or failed is None:
                return None
            self._window.append(failed)
            failures = sum(self._window)
            if failures >= self.config.min_failures and failures >= self.config.failure_rate * len(
                self._window
            ):
                return self._open(f"{failures} of the last {len(self._window)} deliveries failed")
            return None

    def _current(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self._reopen_at:
            self._move(BreakerState.HALF_OPEN)
            self._probes_running = 0
            self._probes_passed = 0
            logger.info(
                "circuit breaker of consumer=%s half-open: letting %d probe deliveries through",
                self.consumer,
                self.config.probes,
            )
        return self._state

    def _open(self, why: str) -> BreakerState:
        self.pause = self.config.pause_after(self._reopenings)
        self._reopen_at = self._clock() + self.pause
        self.opened += 1
        self._window.clear()
        self._move(BreakerState.OPEN)
        logger.warning(
            "circuit breaker of consumer=%s opened: %s (failure_rate %g, min_failures %d, "
            "window %d); starting none of its deliveries for %gs, no attempt charged meanwhile",
            self.consumer,
            why,
            self.config.failure_rate,
            self.config.min_failures,
            self.config.window,
            self.pause,
        )
        return BreakerState.OPEN

    def _close(self) -> BreakerState:
        self._window.clear()
        self._reopenings = 0
        self._move(BreakerState.CLOSED)
        logger.info(
            "circuit breaker of consumer=%s closed: %d probe deliveries succeeded; consuming again",
            self.consumer,
            self._probes_passed,
        )
        return BreakerState.CLOSED

    def _move(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        self._epoch += 1
        if self._listener is not None:
            self._listener(self, old, new)


class ConsumerBreakers:
    """The breakers of one consume process, by consumer name; transitions show in the metrics
    and as ``/healthz`` notes."""

    def __init__(
        self,
        specs: Iterable[ConsumerSpec],
        settings: MessagingSettings,
        *,
        health: HealthState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health = health if health is not None else HealthState()
        self.settings = settings
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

    def admit(
        self, batch: list[DeliveryWork]
    ) -> tuple[list[DeliveryWork], list[Admission | None], list[DeliveryWork], list[DeliveryWork]]:
        """Split ``batch`` into those admitted (with their admissions), those kept back until
        their breaker lets them in (with every later one of their queue), and those left for
        the next round (past what a closed breaker may see fail at once)."""
        admitted: list[DeliveryWork] = []
        admissions: list[Admission | None] = []
        kept_back: list[DeliveryWork] = []
        later: list[DeliveryWork] = []
        budget: dict[str, int] = {}
        waiting_queues: set[str] = set()
        for item in batch:
            name = item.spec.name
            breaker = None if item.from_dead_letter_queue else self.get(name)
            if breaker is None or not item.link.open:
                admitted.append(item)  # no breaker; or its link is gone: given back unstarted
                admissions.append(None)
                continue
            if item.delivery.queue in waiting_queues:
                kept_back.append(item)
                continue
            if name not in budget:
                budget[name] = breaker.room()
            admission = None
            if budget[name] > 0:
                budget[name] -= 1
                admission = breaker.admit()
            elif breaker.state is BreakerState.CLOSED:
                later.append(item)  # this round is full: decided after it, in order
                continue
            else:
                # Near the broker's consumer timeout it runs even with the breaker open.
                overdue = time.monotonic() - item.received >= self._hold_limit()
                admission = breaker.admit(overdue=overdue)
            if admission is None:
                kept_back.append(item)
                waiting_queues.add(item.delivery.queue)
            else:
                admitted.append(item)
                admissions.append(admission)
        return admitted, admissions, kept_back, later

    def asked_again_at(self, item: DeliveryWork) -> float:
        """When a delivery kept back is asked about again (a monotonic time)."""
        breaker = self.get(item.spec.name)
        again = breaker.look_again_in() if breaker is not None else 0.0
        return min(time.monotonic() + again, item.received + self._hold_limit())

    def report(
        self,
        batch: Sequence[DeliveryWork],
        admissions: Sequence[Admission | None],
        outcomes: Sequence[Outcome | None],
    ) -> None:
        """Count each admitted delivery's verdict with its breaker."""
        for item, admission, outcome in zip(batch, admissions, outcomes, strict=True):
            breaker = self.get(item.spec.name)
            if breaker is not None and admission is not None:
                breaker.record(admission, None if outcome is None else handler_verdict(outcome))

    def _hold_limit(self) -> float:
        return BREAKER_HOLD_SHARE * self.settings.max_hold_seconds

    def _changed(self, breaker: CircuitBreaker, old: BreakerState, new: BreakerState) -> None:
        metrics.breaker_state(breaker.consumer, new)
        if new is BreakerState.OPEN:
            metrics.breaker_opened(breaker.consumer)
        note: str | None = None
        if new is BreakerState.OPEN:
            note = (
                f"circuit breaker of consumer {breaker.consumer} open: starting none of its "
                f"deliveries for {breaker.pause:g}s (opened {breaker.opened} time(s))"
            )
        elif new is BreakerState.HALF_OPEN:
            note = (
                f"circuit breaker of consumer {breaker.consumer} half-open: "
                f"{breaker.config.probes} probe deliveries decide whether it closes"
            )
        self.health.note(f"breaker:{breaker.consumer}", note)
