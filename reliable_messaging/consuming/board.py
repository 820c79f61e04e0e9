"""What passes between the consumer's connection thread and its worker threads: each delivery
as a :class:`DeliveryWork` on the :class:`WorkBoard`, settled on the :class:`Link` it came on."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..broker.transport import BrokerChannel, BrokerConnection
from ..core.envelope import Delivery
from ..core.outcomes import RetryInPlace
from ..core.registry import ConsumerSpec
from .processing import with_attempt


@dataclass
class Link:
    """One broker connection and what was received on it."""

    connection: BrokerConnection
    channels: list[BrokerChannel] = field(default_factory=list)
    # Deliveries handed to the workers and not yet settled (any thread, under ``lock``).
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Delivery tags received and not yet acked or nacked, per channel number, oldest first.
    # Only the connection's thread touches it (it receives and settles).
    unsettled: dict[int, dict[int, None]] = field(default_factory=dict)
    # What the broker did to a channel (closed it, cancelled a consumer), noticed by the loop.
    lost: str | None = None
    # The consumers: (channel, consumer tag, queue, callback), updated when re-subscribed.
    consumers: list[tuple[BrokerChannel, str, str, Callable[..., None]]] = field(
        default_factory=list
    )
    # The shared channel starts at a prefetch of 1 (see ConnectionThread._open_up).
    cautious: bool = True
    open_up: bool = False
    # The ordered partitions' channel numbers, and the process's stop event.
    ordered: set[int] = field(default_factory=set)
    stopping: threading.Event = field(default_factory=threading.Event)
    # Why this link is to be dropped (a worker died holding an ordered partition's delivery).
    dropping: str | None = None
    # Queues the broker could not declare (their node down): tried again now and then.
    unavailable: dict[str, str] = field(default_factory=dict)
    retry_topology_at: float = 0.0

    def held_for_the_drop(self, channel: BrokerChannel) -> bool:
        """An ordered partition's channel of a stopping process, or of a link to be dropped:
        nothing it holds is handled or nacked any more; the drop gives it back in order."""
        return (
            self.stopping.is_set() or self.dropping is not None
        ) and channel.channel_number in self.ordered

    @property
    def busy(self) -> bool:
        """Deliveries of this link are with the workers, not settled yet."""
        with self.lock:
            return self.in_flight > 0

    def forget(self, channel: BrokerChannel, tag: int) -> None:
        self.unsettled.get(channel.channel_number, {}).pop(tag, None)

    @property
    def open(self) -> bool:
        return (
            self.dropping is None
            and self.connection.is_open
            and all(c.is_open for c in self.channels)
        )


@dataclass(frozen=True)
class DeliveryWork:
    """One delivery waiting for (or under) a worker, with where to settle it."""

    link: Link
    channel: BrokerChannel
    spec: ConsumerSpec
    delivery: Delivery
    properties: Any
    received: float = field(default_factory=time.monotonic)
    # From the consumer's dead-letter queue (quorum x-delivery-limit), not a delivery to handle.
    from_dead_letter_queue: bool = False

    def again(self, retry: RetryInPlace) -> DeliveryWork:
        """The same delivery, for its in-place retry."""
        return replace(
            self, delivery=with_attempt(self.delivery, retry), from_dead_letter_queue=False
        )

    @property
    def suspect(self) -> bool:
        """Came back after its consumer went away: handled alone, under the crash guard."""
        return self.delivery.redelivered and not self.from_dead_letter_queue


@dataclass
class HeldPartition:
    """Deliveries of one queue a worker keeps, in order, until ``ready_at`` (behind an in-place
    retry or a circuit breaker)."""

    ready_at: float
    items: list[DeliveryWork]


class WorkBoard:
    """Deliveries for the workers: one lane per worker (its ordered partitions) and one shared."""

    def __init__(self, workers: int) -> None:
        self._cond = threading.Condition()
        self._own: list[collections.deque[DeliveryWork]] = [
            collections.deque() for _ in range(workers)
        ]
        self._shared: collections.deque[DeliveryWork] = collections.deque()
        self.closed = False

    def put(self, item: DeliveryWork, worker: int | None) -> None:
        with self._cond:
            (self._shared if worker is None else self._own[worker]).append(item)
            self._cond.notify_all()

    def take(self, worker: int, limit: int, timeout: float) -> list[DeliveryWork]:
        """Up to ``limit`` items, the worker's own first; waits at most ``timeout`` seconds."""
        with self._cond:
            own = self._own[worker]
            if not own and not self._shared and not self.closed and timeout > 0:
                self._cond.wait(timeout)
            items: list[DeliveryWork] = []
            for lane in (own, self._shared):
                while lane and len(items) < limit:
                    items.append(lane.popleft())
            return items

    def empty(self) -> bool:
        with self._cond:
            return not self._shared and not any(self._own)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
