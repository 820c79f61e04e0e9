"""The long-running consumer: one pika connection, N worker threads, reconnects by itself.

Threading: pika objects live on the connection's thread (the one calling :meth:`run`). Deliveries
are copied into plain :class:`Delivery` values and handed to the worker threads, which do all
database work; each worker hands its outcomes back with ``add_callback_threadsafe`` so acks,
nacks and retry publishes happen on the connection's thread again.

Throughput: a worker takes every delivery waiting for it (up to ``CONSUMER_BATCH_SIZE``) and
decides them in one transaction, a savepoint each (see :mod:`.inbox`); their acks go out after
the commit. Under load that is one commit for many messages; when idle, a batch of one.

Ordering: the partition queues of an ordered consumer are each tied to one worker, which takes
their deliveries in arrival order, and each has its own channel (so its own prefetch window): a
partition held by a message retrying in place stops only that partition, never the others.

Every delivery reaches an outcome in bounded time, whatever the broker or the message does:

- A channel the broker closes (``consumer_timeout``, any 406) or a consumer it cancels (queue
  deleted, a classic queue's node lost) is noticed within one loop turn: the connection is
  dropped and made again (re-declaring the topology), and ``/healthz`` says "broker not
  connected" meanwhile. Deliveries are never held unacked longer than half of the broker's
  ``consumer_timeout`` (``BROKER_CONSUMER_TIMEOUT``): past that they are given back.
- A delivery that comes back ``redelivered`` is a suspect: it runs alone in the process, under
  the crash guard (:mod:`.crash_guard`), so a message that kills its process is dead-lettered
  after ``CRASH_LIMIT`` deaths and its innocent neighbours are never charged. After a
  (re)connect every channel starts with a prefetch of 1 and opens up to ``PREFETCH`` at the
  first fresh delivery: while the queue's head is a suspect, only it is exposed to a death (a
  quorum queue counts every death against each message the dead process held).
- A handler past its time limit is interrupted (:mod:`.time_limit`).
- Our own code failing on a delivery (never the handler: its exceptions are outcomes) splits the
  batch to find the delivery, which after ``CONSUMER_ERROR_LIMIT`` failures is dead-lettered
  with reason ``consumer_error``.
- A retry copy the broker refuses (unroutable, nacked) is published again with backoff while the
  original stays unacked, never requeued at once (each requeue counts toward a quorum queue's
  delivery limit); quorum queues dead-letter what reaches that limit to ``<queue>.dead``, which
  this consumer reads and stores as ``delivery_limit`` dead letters (:mod:`.last_resort`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
from django.db import InterfaceError, OperationalError, close_old_connections, connections, router
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection
from pika.spec import Basic, BasicProperties

from . import metrics
from .backoff import Backoff
from .conf import MessagingSettings, messaging_settings
from .console import announce
from .crash_guard import TIMEOUT, CrashGuard, SuspectGate, decide_suspect
from .envelope import CONTENT_TYPE, Delivery, delivery_from_frame, wire_headers
from .exceptions import DatabaseUnavailable, TopologyMismatchError
from .fastpath import duplicate_cache
from .inbox import DeliveryProcessor, Job, process_batch, with_attempt
from .last_resort import consumer_error, ingest_delivery_limit
from .leftovers import retire_leftovers
from .models import ProcessedMessage
from .outcomes import Acknowledge, Outcome, Release, RetryInPlace, ScheduleRetry
from .partitions import PartitionUpkeep
from .registry import ConsumerSpec
from .retry_publisher import RetryCopy, RetryPublisher
from .time_limit import time_limits
from .topology import (
    CONNECTION_ERRORS,
    connect,
    consumer_queues,
    dead_letter_queue,
    declare_topology,
    delay_exchange_name,
)

logger = logging.getLogger(__name__)

# Seconds between two progress lines of a running consumer.
PROGRESS_EVERY = 30.0
# Seconds between two tries at the queues the broker could not declare (their node down).
TOPOLOGY_RETRY = 5.0


class ChannelLost(Exception):
    """The broker closed one of our consuming channels or cancelled one of our consumers."""


RECONNECT_ON: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, ChannelLost)


@dataclass
class _Link:
    """One broker connection and what was received on it. Deliveries are tied to the channel
    they came on: after a reconnect, outcomes of the old link are dropped (the broker redelivers
    those messages, and the inbox recognises any that did commit)."""

    connection: BlockingConnection
    channels: list[BlockingChannel] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Delivery tags received and not yet acked or nacked, per channel number, oldest first.
    # Only the connection's thread touches it (it receives and settles).
    unsettled: dict[int, dict[int, None]] = field(default_factory=dict)
    # What the broker did to a channel (closed it, cancelled a consumer), noticed by the loop.
    lost: str | None = None
    # The consumers: (channel, consumer tag, queue, callback), updated when re-subscribed.
    consumers: list[tuple[BlockingChannel, str, str, Callable[..., None]]] = field(
        default_factory=list
    )
    # The shared channel starts at a prefetch of 1 (see _open_up) and is opened up
    # to PREFETCH at the first fresh delivery.
    cautious: bool = True
    open_up: bool = False
    # Ordered channels being closed by a graceful stop: what they hold goes back in order.
    closing: set[int] = field(default_factory=set)
    # Queues the broker could not declare at connect (their node down): tried again now and
    # then, and consumed once they can be.
    unavailable: dict[str, str] = field(default_factory=dict)
    retry_topology_at: float = 0.0

    def forget(self, channel: BlockingChannel, tag: int) -> None:
        self.unsettled.get(channel.channel_number, {}).pop(tag, None)

    @property
    def open(self) -> bool:
        return self.connection.is_open and all(c.is_open for c in self.channels)


@dataclass(frozen=True)
class _WorkItem:
    link: _Link
    channel: BlockingChannel
    spec: ConsumerSpec
    delivery: Delivery
    properties: BasicProperties
    received: float = field(default_factory=time.monotonic)
    # From the consumer's dead-letter queue (quorum x-delivery-limit), not a delivery to handle.
    from_dead_letter_queue: bool = False

    def again(self, retry: RetryInPlace) -> _WorkItem:
        return _WorkItem(
            self.link,
            self.channel,
            self.spec,
            with_attempt(self.delivery, retry),
            self.properties,
            self.received,
        )

    @property
    def suspect(self) -> bool:
        """Came back after its consumer went away: handled alone, under the crash guard."""
        return self.delivery.redelivered and not self.from_dead_letter_queue


@dataclass
class _Held:
    """A partition waiting for its first delivery's in-place retry: nothing of it runs before."""

    ready_at: float
    items: list[_WorkItem]


class _Board:
    """Where the connection's thread leaves deliveries for the workers: one lane per worker
    (the ordered partitions tied to it, in arrival order) and one lane any worker may take."""

    def __init__(self, workers: int) -> None:
        self._cond = threading.Condition()
        self._own: list[collections.deque[_WorkItem]] = [
            collections.deque() for _ in range(workers)
        ]
        self._shared: collections.deque[_WorkItem] = collections.deque()
        self.closed = False

    def put(self, item: _WorkItem, worker: int | None) -> None:
        with self._cond:
            (self._shared if worker is None else self._own[worker]).append(item)
            self._cond.notify_all()

    def take(self, worker: int, limit: int, timeout: float) -> list[_WorkItem]:
        """Up to ``limit`` items: the worker's own first, then shared ones. Waits at most
        ``timeout`` seconds for the first."""
        with self._cond:
            own = self._own[worker]
            if not own and not self._shared and not self.closed and timeout > 0:
                self._cond.wait(timeout)
            items: list[_WorkItem] = []
            while own and len(items) < limit:
                items.append(own.popleft())
            while self._shared and len(items) < limit:
                items.append(self._shared.popleft())
            return items

    def empty(self) -> bool:
        with self._cond:
            return not self._shared and not any(self._own)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class ConsumerService:
    """Consumes the queues of ``specs`` until :meth:`request_stop` (or the idle timeout)."""

    def __init__(
        self,
        specs: Iterable[ConsumerSpec],
        *,
        concurrency: int = 1,
        idle_timeout: float | None = None,
        settings: MessagingSettings = messaging_settings,
        on_outcome: Callable[[ConsumerSpec, Delivery, Outcome], None] | None = None,
        health: metrics.HealthState | None = None,
        progress_interval: float = PROGRESS_EVERY,
    ) -> None:
        self.specs = list(specs)
        # Seconds between progress lines (outcomes so far); 0: none.
        self.progress_interval = progress_interval if progress_interval > 0 else float("inf")
        if not self.specs:
            raise ValueError("no consumers to run")
        self.concurrency = max(1, concurrency)
        self.idle_timeout = idle_timeout
        self.settings = settings
        self.on_outcome = on_outcome
        self.health = health
        self.exit_code = 0
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._board = _Board(self.concurrency)
        cache = duplicate_cache(settings)
        self._processors = {
            spec.name: DeliveryProcessor(spec, settings, cache) for spec in self.specs
        }
        metrics.consumers_started(self._processors)
        self._cache = cache
        # Each ordered partition queue is tied to one worker, round robin.
        workers = itertools.cycle(range(self.concurrency))
        self._lane_of = {
            queue: next(workers)
            for spec in self.specs
            if spec.ordered
            for queue in consumer_queues(spec, settings)
        }
        self._workers: list[threading.Thread] = []
        self._last_delivery = time.monotonic()
        self._reconnect = Backoff(0.5, settings.reconnect_max_delay)
        self._counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()
        self._crash_guard = CrashGuard(settings.crash_limit)
        self._gate = SuspectGate()
        # Retry copies go out on a connection of their own (see .retry_publisher).
        self._publisher = RetryPublisher(settings, health=health, on_missing=self._topology_lost)
        # Set from the publisher's thread when a delay exchange turned out missing.
        self._redeclare = threading.Event()
        # Every queue of this process unavailable (their nodes down): connected, yet idle.
        self._consuming_nothing = False
        if health is not None:
            health.add_problem_source(self._idle_for_want_of_queues)

    # -- lifecycle ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop taking deliveries, let handlers in flight finish, then return from :meth:`run`.
        Safe to call from a signal handler or another thread."""
        self._stop.set()
        if self.health is not None:
            self.health.stopping()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        self._start_time_limits()
        upkeep = PartitionUpkeep(router.db_for_write(ProcessedMessage))
        upkeep.start()
        self._start_workers()
        self._publisher.start()
        try:
            while not self._stop.is_set():
                try:
                    self._run_connection()
                except TopologyMismatchError as exc:
                    logger.error("%s", exc)
                    self.exit_code = 2
                    break
                except RECONNECT_ON as exc:
                    self._set_connected(False)
                    if self._stop.is_set():
                        break
                    wait = self._reconnect.next()
                    logger.warning(
                        "broker connection to %s lost or refused (%s: %s); reconnecting in %.1fs",
                        self.settings.broker_shown,
                        type(exc).__name__,
                        exc,
                        wait,
                    )
                    self._stop.wait(wait)
        finally:
            self._set_connected(False)
            self._stop_workers()
            self._publisher.stop()
            time_limits.stop()
            upkeep.stop()
        return self.exit_code

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
        if self.health is not None:
            self.health.add_problem_source(time_limits.overdue)

    def _set_connected(self, connected: bool) -> None:
        if connected:
            self.connected.set()
        else:
            self.connected.clear()
        if self.health is not None:
            self.health.set_broker(connected)

    def _start_workers(self) -> None:
        for index in range(self.concurrency):
            thread = threading.Thread(
                target=self._worker_loop, args=(index,), name=f"rm-worker-{index}", daemon=True
            )
            thread.start()
            self._workers.append(thread)

    def _stop_workers(self) -> None:
        self._board.close()
        deadline = time.monotonic() + 5
        for thread in self._workers:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the connection's thread ---------------------------------------------------------------

    def _run_connection(self) -> None:
        connection = connect(self.settings, name=f"consume pid={os.getpid()}")
        try:
            prefetch = max(self.settings.prefetch, self.concurrency)
            declared = declare_topology(connection.channel(), self.specs, self.settings)
            retire_leftovers(connection, self.specs, self.settings)
            shared_channel = declared.channel
            link = _Link(connection, [shared_channel], unavailable=declared.unavailable)
            shared_channel.basic_qos(prefetch_count=1)
            self._watch(link, shared_channel)
            queues = self._subscribe_all(link, self.specs)
            self._note_unavailable(link)
            announce(
                logger,
                "consuming %s from %s (concurrency %d, prefetch %d, batches of up to %d%s)",
                ", ".join(queues),
                self.settings.broker_shown,
                self.concurrency,
                prefetch,
                self.settings.consumer_batch_size,
                f", duplicate fast path in cache {self._cache.alias!r}" if self._cache else "",
            )
            self._reconnect.reset()
            self._set_connected(True)
            self._last_delivery = time.monotonic()
            next_progress = time.monotonic() + self.progress_interval
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.2)
                self._check_channels(link)
                if self._redeclare.is_set() or (
                    link.unavailable and time.monotonic() >= link.retry_topology_at
                ):
                    self._declare_again(link)
                if link.open_up:
                    self._open_up(link, prefetch)
                self._publisher.refresh()
                if self.health is not None:
                    self.health.heartbeat()
                if time.monotonic() >= next_progress:
                    self._log_progress()
                    next_progress = time.monotonic() + self.progress_interval
                if self._idle_expired(link):
                    announce(
                        logger, "no delivery for %ss: stopping (--idle-timeout)", self.idle_timeout
                    )
                    self._stop.set()
            self._shutdown(link)
        finally:
            self._set_connected(False)
            if connection.is_open:
                try:
                    connection.close()
                except Exception:
                    logger.debug("error while closing the broker connection", exc_info=True)

    def _subscribe_all(self, link: _Link, specs: Iterable[ConsumerSpec]) -> list[str]:
        """Subscribe to the queues of ``specs`` that are available; returns their names."""
        shared_channel = link.channels[0]
        queues: list[str] = []
        for spec in specs:
            wanted = list(consumer_queues(spec, self.settings))
            if self.settings.queue_type == "quorum":
                wanted.append(dead_letter_queue(spec))
            for queue in wanted:
                if queue in link.unavailable or any(q == queue for _, _, q, _ in link.consumers):
                    continue
                channel = shared_channel
                if spec.ordered and queue != dead_letter_queue(spec):
                    # Its own prefetch window: a held partition fills only its own. No
                    # cautious start here: re-subscribing to open it up would hand the
                    # partition (single active consumer) to a standby mid-stream.
                    channel = link.connection.channel()
                    channel.basic_qos(prefetch_count=self.settings.prefetch)
                    link.channels.append(channel)
                    self._watch(link, channel)
                self._subscribe(link, channel, spec, queue)
                queues.append(queue)
        return queues

    def _idle_for_want_of_queues(self) -> list[str]:
        if self._consuming_nothing and self.connected.is_set():
            return ["no queue of this process can be consumed now (their nodes down?)"]
        return []

    def _topology_lost(self, exchange: str) -> None:
        logger.warning("exchange %s is missing: declaring the topology again", exchange)
        self._redeclare.set()

    def _declare_again(self, link: _Link) -> None:
        """Try again the queues that could not be declared (their node down), or put back a
        delay exchange found missing, declaring the whole topology again (idempotent) on a
        channel of its own, since a refusal closes it; consume the queues that now can be.
        Every ``TOPOLOGY_RETRY`` seconds while any is missing."""
        self._redeclare.clear()
        before = set(link.unavailable)
        declared = declare_topology(
            link.connection.channel(), self.specs, self.settings, known_unavailable=before
        )
        if declared.channel.is_open:
            declared.channel.close()
        link.unavailable = declared.unavailable
        back = before - set(link.unavailable)
        if back:
            logger.warning("available again: %s", ", ".join(sorted(back)))
            self._subscribe_all(link, self.specs)
        self._note_unavailable(link)

    def _note_unavailable(self, link: _Link) -> None:
        link.retry_topology_at = time.monotonic() + TOPOLOGY_RETRY
        metrics.consumer_queues_unavailable(len(link.unavailable))
        self._consuming_nothing = not link.consumers
        if self.health is not None:
            self.health.note(
                "queues_unavailable",
                "not available now (consuming the rest): " + ", ".join(sorted(link.unavailable))
                if link.unavailable
                else None,
            )

    def _subscribe(
        self, link: _Link, channel: BlockingChannel, spec: ConsumerSpec, queue: str
    ) -> None:
        on_message = functools.partial(self._on_message, link, spec, queue)
        tag = channel.basic_consume(queue, on_message)
        link.consumers.append((channel, tag, queue, on_message))

    def _watch(self, link: _Link, channel: BlockingChannel) -> None:
        """Note a broker ``basic.cancel`` of a consumer on ``channel`` (its queue deleted, its
        node lost): the main loop then reconnects and declares the queue again."""
        number = channel.channel_number

        def on_cancel(frame: object) -> None:
            link.lost = f"the broker cancelled a consumer on channel {number} (queue deleted?)"

        channel.add_on_cancel_callback(on_cancel)

    def _open_up(self, link: _Link, prefetch: int) -> None:
        """The first fresh delivery arrived on the shared channel: give its consumers the full
        ``PREFETCH``.

        The shared channel starts every connection at a prefetch of 1: after a crash the head of
        a queue may be the message that killed the last process, redelivered first, and with a
        wide window every message behind it would be held (and, on a quorum queue, counted
        against its delivery limit) each time it kills again. RabbitMQ applies a consumer's
        prefetch when the consumer subscribes, so opening up means subscribing again; what was
        already delivered stays ours to settle on the channel.
        """
        link.open_up = False
        link.cautious = False
        shared = link.channels[0]
        if not shared.is_open:
            return
        shared.basic_qos(prefetch_count=prefetch)
        kept = []
        for channel, tag, queue, on_message in link.consumers:
            if channel is shared:
                channel.basic_cancel(tag)
                tag = channel.basic_consume(queue, on_message)
            kept.append((channel, tag, queue, on_message))
        link.consumers = kept

    def _check_channels(self, link: _Link) -> None:
        """Raise :class:`ChannelLost` when the broker closed a channel or cancelled a
        consumer: pika's blocking adapter records a channel closed by the broker but raises
        nothing until the channel is used, so without this look the process would go on
        reporting healthy while no delivery ever arrives again."""
        if link.lost is None:
            for channel in link.channels:
                if not channel.is_open:
                    link.lost = f"the broker closed channel {channel.channel_number}"
                    break
        if link.lost is not None and not self._stop.is_set():
            raise ChannelLost(link.lost)

    def _log_progress(self) -> None:
        with self._counts_lock:
            counts = dict(self._counts)
        if counts:
            announce(
                logger,
                "progress: %s",
                ", ".join(f"{label}={count}" for label, count in sorted(counts.items())),
            )

    def _idle_expired(self, link: _Link) -> bool:
        if self.idle_timeout is None:
            return False
        with link.lock:
            busy = link.in_flight > 0
        if busy or not self._board.empty():
            self._last_delivery = time.monotonic()
            return False
        return time.monotonic() - self._last_delivery >= self.idle_timeout

    def _shutdown(self, link: _Link) -> None:
        """Graceful stop: let the handlers in flight finish and settle their acks, within
        ``SHUTDOWN_TIMEOUT``; give back the rest.

        Plain queues: cancel the consumers (pika gives back deliveries not yet dispatched).
        Ordered partitions: no cancel, which would make the broker activate a standby consumer
        at once while this process still holds later messages of its keys (they would reach the
        standby after messages published later: order broken). Instead the deliveries not
        started are dropped here unsettled, the batch in flight finishes, and then the channel
        is closed, so the broker requeues what is left in place *before* it activates the next
        consumer of the partition.
        """
        ordered = {channel.channel_number for channel in link.channels[1:]}
        link.closing.update(ordered)
        for channel, tag, _, _ in link.consumers:
            if channel.channel_number not in ordered:
                channel.basic_cancel(tag)
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while time.monotonic() < deadline:
            with link.lock:
                # Retry copies still being placed count too: their originals' acks are due.
                if link.in_flight == 0 and self._publisher.pending() == 0:
                    break
            link.connection.process_data_events(time_limit=0.1)
        for channel in link.channels[1:]:
            _close_keeping_consumers(link.connection, channel)
        with link.lock:
            left = link.in_flight
        if left:
            logger.error(
                "%d handler(s) still running after SHUTDOWN_TIMEOUT=%ss; their messages "
                "are not acked and will be redelivered",
                left,
                self.settings.shutdown_timeout,
            )
            self.exit_code = 1
        else:
            announce(logger, "stopped gracefully: every handler in flight finished and was acked")

    def _on_message(
        self,
        link: _Link,
        spec: ConsumerSpec,
        queue: str,
        channel: BlockingChannel,
        method: Basic.Deliver,
        properties: BasicProperties,
        body: bytes,
    ) -> None:
        delivery = delivery_from_frame(queue, method, properties, body)
        number = channel.channel_number
        link.unsettled.setdefault(number, {})[delivery.delivery_tag] = None
        if number in link.closing:
            return  # a graceful stop closes this ordered channel: the broker requeues it
        if link.cautious and not delivery.redelivered and channel is link.channels[0]:
            link.open_up = True
        from_dead_letter_queue = self.settings.queue_type == "quorum" and queue == (
            dead_letter_queue(spec)
        )
        if not from_dead_letter_queue:
            metrics.consumer_received(spec.name, delivery.redelivered)
        with link.lock:
            link.in_flight += 1
        self._last_delivery = time.monotonic()
        item = _WorkItem(
            link, channel, spec, delivery, properties, from_dead_letter_queue=from_dead_letter_queue
        )
        self._board.put(item, self._lane_of.get(queue))

    def _settle_all(self, settled: list[tuple[_WorkItem, Outcome]]) -> None:
        """Carry out the outcomes of a batch on the broker; runs on the connection's thread.

        Acks are coalesced: the acked deliveries that are the oldest unsettled ones of their
        channel go out as one ``basic.ack(multiple=True)``, the others one by one. Nacks and
        retries are settled first, so a multiple ack never covers a delivery meant otherwise.
        """
        acks: dict[int, tuple[_Link, BlockingChannel, set[int]]] = {}
        done: list[tuple[_WorkItem, Outcome]] = []
        for item, outcome in settled:
            if not self._settleable(item, outcome):
                continue
            done.append((item, outcome))
            if isinstance(outcome, Acknowledge):
                _, _, tags = acks.setdefault(id(item.channel), (item.link, item.channel, set()))
                tags.add(item.delivery.delivery_tag)
            elif isinstance(outcome, ScheduleRetry):
                self._publish_retry(item, outcome)
            elif item.channel.channel_number in item.link.closing:
                # Closing the channel gives it back in place, behind nothing (ordered stop).
                pass
            else:
                item.channel.basic_nack(item.delivery.delivery_tag, requeue=True)
                item.link.forget(item.channel, item.delivery.delivery_tag)
        for link, channel, tags in acks.values():
            _ack_coalesced(link, channel, tags)
        if self.on_outcome is not None:
            for item, outcome in done:
                self.on_outcome(item.spec, item.delivery, outcome)

    def _settleable(self, item: _WorkItem, outcome: Outcome) -> bool:
        link = item.link
        with link.lock:
            link.in_flight -= 1
        if link.connection.is_open and item.channel.is_open:
            return True
        logger.warning(
            "message_id=%s: connection closed before its %s could be settled; "
            "the broker will redeliver it",
            item.delivery.message_id,
            type(outcome).__name__,
        )
        return False

    def _publish_retry(self, item: _WorkItem, retry: ScheduleRetry) -> None:
        """Hand the retry copy to the publisher (its own connection and thread); the original
        is acked here, on the connection's thread, once the broker has confirmed the copy."""
        link, delivery = item.link, item.delivery
        if not (link.connection.is_open and item.channel.is_open):
            return  # the broker redelivers the original
        original = item.properties
        properties = BasicProperties(
            content_type=original.content_type or CONTENT_TYPE,
            delivery_mode=pika.DeliveryMode.Persistent,
            message_id=original.message_id,
            timestamp=original.timestamp,
            headers=wire_headers(retry.headers),
        )

        def on_link(settle: Callable[[], None]) -> None:
            try:
                link.connection.add_callback_threadsafe(settle)
            except Exception:  # noqa: BLE001 - the connection is gone: the broker redelivers
                logger.debug("connection closed before a retry copy could be settled")

        def ack() -> None:
            if link.connection.is_open and item.channel.is_open:
                item.channel.basic_ack(delivery.delivery_tag)
                link.forget(item.channel, delivery.delivery_tag)

        def give_back() -> None:
            if link.connection.is_open and item.channel.is_open:
                item.channel.basic_nack(delivery.delivery_tag, requeue=True)
                link.forget(item.channel, delivery.delivery_tag)

        self._publisher.submit(
            RetryCopy(
                exchange=delay_exchange_name(retry.delay, self.settings),
                routing_key=delivery.queue,
                body=delivery.body,
                properties=properties,
                message_id=str(delivery.message_id),
                received=item.received,
                placed=lambda: on_link(ack),
                give_back=lambda: on_link(give_back),
                wanted=lambda: link.connection.is_open and item.channel.is_open,
            )
        )

    # -- worker threads --------------------------------------------------------------------------

    def _worker_loop(self, index: int) -> None:
        held: dict[str, _Held] = {}
        limit = max(1, self.settings.consumer_batch_size)
        try:
            while True:
                now = time.monotonic()
                batch: list[_WorkItem] = []
                for queue in [q for q, h in held.items() if h.ready_at <= now]:
                    batch.extend(held.pop(queue).items)
                if self._board.closed or self._stop.is_set():
                    self._release_held(held, "stopping while a retry in place waited")
                if self._board.closed and self._board.empty() and not batch:
                    return
                wait = 0.0 if batch else 0.5
                if held and not batch:
                    wait = min(wait, max(0.0, min(h.ready_at for h in held.values()) - now))
                for item in self._board.take(index, limit - len(batch), wait):
                    waiting = held.get(item.delivery.queue)
                    if waiting is not None:
                        waiting.items.append(item)  # behind its partition's retry, in order
                    else:
                        batch.append(item)
                if batch:
                    self._run_batch(batch, held)
        finally:
            connections.close_all()

    def _release_held(self, held: dict[str, _Held], why: str) -> None:
        items = [item for waiting in held.values() for item in waiting.items]
        held.clear()
        if items:
            self._hand_back([(item, Release(why)) for item in items])

    def _run_batch(self, batch: list[_WorkItem], held: dict[str, _Held]) -> None:
        """Decide ``batch`` in segments, in arrival order: the fresh deliveries together, each
        suspect (redelivered) alone. The happy path is one segment."""
        segment: list[_WorkItem] = []
        for item in batch:
            if item.suspect or item.from_dead_letter_queue:
                self._run_segment(segment, held)
                self._run_segment([item], held)
                segment = []
            else:
                segment.append(item)
        self._run_segment(segment, held)

    def _run_segment(self, segment: list[_WorkItem], held: dict[str, _Held]) -> None:
        batch: list[_WorkItem] = []
        for item in segment:
            waiting = held.get(item.delivery.queue)
            if waiting is not None:
                waiting.items.append(item)  # behind its partition's retry, in order
            else:
                batch.append(item)
        if not batch:
            return
        outcomes = self._decide(batch)
        settled: list[tuple[_WorkItem, Outcome]] = []
        for item, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, RetryInPlace):
                held[item.delivery.queue] = _Held(
                    time.monotonic() + outcome.delay, [item.again(outcome)]
                )
            elif outcome is None:
                held[item.delivery.queue].items.append(item)
            else:
                settled.append((item, outcome))
        if settled:
            self._hand_back(settled)

    def _decide(self, batch: list[_WorkItem]) -> list[Outcome | None]:
        """The batch's outcomes; holds it while the database is unreachable, retrying with
        backoff, and gives it back to the broker when stopping or disconnected meanwhile."""
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

    def _attempt(self, batch: list[_WorkItem]) -> list[Outcome | None]:
        """One try at deciding ``batch``: a suspect alone, under the crash guard and with the
        process to itself; anything else as one batch, beside other ordinary batches."""
        if len(batch) == 1 and batch[0].from_dead_letter_queue:
            item = batch[0]
            queues = consumer_queues(item.spec, self.settings)
            return [ingest_delivery_limit(self._processors[item.spec.name], item.delivery, queues)]
        if len(batch) == 1 and batch[0].suspect:
            with self._gate.exclusive():
                try:
                    return [self._attempt_suspect(batch[0])]
                except (OperationalError, InterfaceError) as exc:
                    # The crash guard's own statements: the database is down, hold it.
                    raise DatabaseUnavailable(f"crash guard: {exc}") from exc
        jobs = [Job(self._processors[item.spec.name], item.delivery) for item in batch]
        with self._gate.shared():
            return process_batch(jobs, cache=self._cache)

    def _attempt_suspect(self, item: _WorkItem) -> Outcome | None:
        processor = self._processors[item.spec.name]
        return decide_suspect(
            self._crash_guard,
            processor,
            item.delivery,
            lambda: process_batch([Job(processor, item.delivery)], cache=self._cache)[0],
        )

    def _decide_live(self, batch: list[_WorkItem]) -> list[Outcome | None]:
        wait = Backoff(0.5, self.settings.reconnect_max_delay)
        warned = False
        errors = 0
        while True:
            # Drop connections that broke or outlived CONN_MAX_AGE, as Django does per request.
            close_old_connections()
            try:
                outcomes = self._attempt(batch)
                if self.health is not None:
                    self.health.set_database(True)
                return outcomes
            except DatabaseUnavailable as exc:
                delay = wait.next()
                if self.health is not None:
                    self.health.set_database(False, str(exc.__cause__ or exc))
                log = logger.warning if not warned else logger.debug
                log(
                    "database unavailable (%s); message_id=%s%s: holding %s unacked and "
                    "retrying in %.1fs",
                    exc.__cause__ or exc,
                    batch[0].delivery.message_id,
                    f" and {len(batch) - 1} more" if len(batch) > 1 else "",
                    "it" if len(batch) == 1 else "them",
                    delay,
                )
                warned = True
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
                if errors >= self.settings.consumer_error_limit:
                    item = batch[0]
                    return [
                        consumer_error(self._processors[item.spec.name], item.delivery, exc, errors)
                    ]
                delay = wait.next()
                logger.exception(
                    "unexpected error while processing message_id=%s (failure %d of %d before "
                    "it is dead-lettered); holding it unacked and retrying in %.1fs",
                    batch[0].delivery.message_id,
                    errors,
                    self.settings.consumer_error_limit,
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
                # Held past half the broker's consumer_timeout, the broker would close the
                # channel under us (and redeliver anyway): give it back first.
                logger.warning(
                    "message_id=%s%s held unacked for over %.0fs (half of "
                    "BROKER_CONSUMER_TIMEOUT): giving back to the broker",
                    batch[0].delivery.message_id,
                    f" and {len(batch) - 1} more" if len(batch) > 1 else "",
                    self.settings.max_hold_seconds,
                )
                return [Release("held too long without an outcome")] * len(batch)

    def _decide_one_by_one(self, batch: list[_WorkItem]) -> list[Outcome | None]:
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

    def _hand_back(self, settled: list[tuple[_WorkItem, Outcome]]) -> None:
        with self._counts_lock:
            for _, outcome in settled:
                self._counts[_label(outcome)] += 1
        for item, outcome in settled:
            if isinstance(outcome, Release):
                metrics.consumer_outcome(item.spec.name, "released")
        # One callback per link: after a reconnect a batch may span the old and the new one.
        by_link: dict[int, list[tuple[_WorkItem, Outcome]]] = {}
        for pair in settled:
            by_link.setdefault(id(pair[0].link), []).append(pair)
        for pairs in by_link.values():
            link = pairs[0][0].link
            try:
                link.connection.add_callback_threadsafe(functools.partial(self._settle_all, pairs))
            except Exception:  # noqa: BLE001 - the connection is gone: the broker redelivers
                with link.lock:
                    link.in_flight -= len(pairs)
                logger.warning(
                    "connection closed before the outcomes of %d deliveries (message_id=%s%s) "
                    "could be settled; the broker will redeliver them",
                    len(pairs),
                    pairs[0][0].delivery.message_id,
                    ", ..." if len(pairs) > 1 else "",
                )


def _close_keeping_consumers(connection: BlockingConnection, channel: BlockingChannel) -> None:
    """Close ``channel`` without cancelling its consumers first.

    pika's ``BlockingChannel.close`` cancels every consumer before it closes the channel. On a
    single-active-consumer queue the cancel makes the broker activate the standby at once, and
    hand it the ready messages behind the ones this channel still holds, which come back only
    when the channel closes: order broken. Closing the channel itself makes the broker requeue
    what it held in place *before* it activates the next consumer (one step in the queue).
    """
    if not channel.is_open:
        return
    impl: Any = getattr(channel, "_impl")  # noqa: B009 - pika private, see above
    impl.close(reply_code=200, reply_text="graceful stop")
    deadline = time.monotonic() + 10
    while not channel.is_closed and time.monotonic() < deadline:
        connection.process_data_events(time_limit=0.1)


def _ack_coalesced(link: _Link, channel: BlockingChannel, tags: set[int]) -> None:
    """Ack ``tags`` on ``channel``: the run of them that starts at the channel's oldest
    unsettled delivery with one multiple ack, the rest one by one."""
    unsettled = link.unsettled.get(channel.channel_number, {})
    run: list[int] = []
    for tag in unsettled:  # oldest first: tags grow on a channel
        if tag not in tags:
            break
        run.append(tag)
    if run:
        channel.basic_ack(run[-1], multiple=True)
        for tag in run:
            del unsettled[tag]
            tags.discard(tag)
    for tag in sorted(tags):
        channel.basic_ack(tag)
        unsettled.pop(tag, None)


def _label(outcome: Outcome) -> str:
    if isinstance(outcome, Acknowledge):
        return outcome.result
    if isinstance(outcome, ScheduleRetry):
        return "deferred" if outcome.deferred else "retried"
    return "released"
