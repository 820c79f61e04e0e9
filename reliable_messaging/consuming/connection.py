"""The consumer's connection thread: owns the broker connection, its channels and consumers;
(re)connects, subscribes, puts deliveries on the :class:`~.board.WorkBoard`, settles outcomes."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .. import metrics
from ..broker.queues import describe_broker_error
from ..broker.topology import broker_dead_letter_queues, consumer_queues
from ..broker.transport import BrokerChannel, BrokerTransport
from ..conf import MessagingSettings
from ..core.announcements import announce
from ..core.backoff import Backoff
from ..core.envelope import delivery_from_frame
from ..core.liveness import HealthState
from ..core.registry import ConsumerSpec
from ..exceptions import TopologyMismatchError
from .board import DeliveryWork, Link, WorkBoard
from .breaker import BreakerState, ConsumerBreakers
from .fastpath import DuplicateCache
from .settling import OutcomeSettler

logger = logging.getLogger(__name__)

# Seconds between two tries at the queues the broker could not declare (their node down).
TOPOLOGY_RETRY = 5.0
# Seconds a connection may spend storing ordered consumers' quorum dead letters before it
# takes their partitions (see ConnectionThread._ingest_dead_letters_first).
DEAD_LETTERS_FIRST = 10.0


class ChannelLost(Exception):
    """The broker closed one of our consuming channels or cancelled one of our consumers."""


@dataclass(eq=False, repr=False)  # no repr: the settings hold the broker's password
class ConnectionThread:
    """Consumes ``specs`` over connections from ``transport`` until ``stop`` is set."""

    specs: list[ConsumerSpec]
    _: KW_ONLY
    transport: BrokerTransport
    board: WorkBoard
    lane_of: Mapping[str, int]
    settler: OutcomeSettler
    settings: MessagingSettings
    stop: threading.Event
    concurrency: int
    idle_timeout: float | None
    progress_interval: float
    cache: DuplicateCache | None
    health: HealthState
    breakers: ConsumerBreakers
    exit_code: int = field(default=0, init=False)
    connected: threading.Event = field(default_factory=threading.Event, init=False)

    def __post_init__(self) -> None:
        self._last_delivery = time.monotonic()
        self._reconnect = Backoff(0.5, self.settings.reconnect_max_delay)
        # Every queue of this process unavailable (their nodes down): connected, yet idle.
        self._consuming_nothing = False

    def run(self) -> int:
        """Connect, consume, and connect again when the connection or a channel is lost, until
        stopped; the exit code (2: the broker's topology conflicts with ours)."""
        reconnect_on: tuple[type[BaseException], ...] = (
            *self.transport.connection_errors,
            ChannelLost,
        )
        while not self.stop.is_set():
            try:
                self._run_connection()
            except TopologyMismatchError as exc:
                logger.error("%s", exc)
                self.exit_code = 2
                break
            except reconnect_on as exc:
                self.set_connected(False)
                if self.stop.is_set():
                    break
                wait = self._reconnect.next()
                logger.warning(
                    "broker connection to %s lost or refused (%s); reconnecting in %.1fs",
                    self.settings.broker_shown,
                    describe_broker_error(exc, self.settings),
                    wait,
                )
                self._wait_alive(wait)
        return self.exit_code

    def _wait_alive(self, seconds: float) -> None:
        """Wait to reconnect; the loop is alive meanwhile, not stuck (``/healthz``)."""
        end = time.monotonic() + seconds
        while not self.stop.is_set():
            self.health.heartbeat()
            left = end - time.monotonic()
            if left <= 0:
                return
            self.stop.wait(min(0.2, left))

    def set_connected(self, connected: bool) -> None:
        (self.connected.set if connected else self.connected.clear)()
        self.health.set_broker(connected)

    def idle_for_want_of_queues(self) -> list[str]:
        """A ``/healthz`` problem source: connected, yet no queue can be consumed."""
        if self._consuming_nothing and self.connected.is_set():
            return ["no queue of this process can be consumed now (their nodes down?)"]
        return []

    def _run_connection(self) -> None:
        connection = self.transport.connect(self.settings, f"consume pid={os.getpid()}")
        try:
            prefetch = max(self.settings.prefetch, self.concurrency)
            shared_channel, unavailable = connection.declare_topology(self.specs)
            connection.retire_leftovers(self.specs)
            link = Link(connection, [shared_channel], unavailable=unavailable, stopping=self.stop)
            shared_channel.basic_qos(prefetch_count=1)
            self._watch(link, shared_channel)
            self._ingest_dead_letters_first(link)
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
                f", duplicate fast path in cache {self.cache.alias!r}" if self.cache else "",
            )
            self._reconnect.reset()
            self.set_connected(True)
            self._last_delivery = time.monotonic()
            next_progress = time.monotonic() + self.progress_interval
            while not self.stop.is_set():
                connection.process_data_events(time_limit=0.2)
                self._check_channels(link)
                if link.unavailable and time.monotonic() >= link.retry_topology_at:
                    self._declare_again(link)
                if link.open_up:
                    self._open_up(link, prefetch)
                self.health.heartbeat()
                if time.monotonic() >= next_progress:
                    self._log_progress()
                    next_progress = time.monotonic() + self.progress_interval
                if self._idle_expired(link):
                    announce(
                        logger, "no delivery for %ss: stopping (--idle-timeout)", self.idle_timeout
                    )
                    self.stop.set()
            if not stop_gracefully(link, self.settings):
                self.exit_code = 1
        finally:
            self.set_connected(False)
            if connection.is_open:
                try:
                    connection.close()
                except Exception:
                    logger.debug("error while closing the broker connection", exc_info=True)

    def _ingest_dead_letters_first(self, link: Link) -> None:
        """Ordered quorum consumers: store their ``.dead`` queues' messages before taking the
        partitions, so a key's later messages never run ahead of its head's dead letter."""
        specs = [spec for spec in self.specs if spec.ordered]
        if self.settings.queue_type != "quorum" or not specs:
            return
        self._subscribe_all(link, specs, dead_letters_only=True)
        queues = [
            queue
            for spec in specs
            for queue in broker_dead_letter_queues(spec)
            if queue not in link.unavailable
        ]
        deadline = time.monotonic() + DEAD_LETTERS_FIRST
        while time.monotonic() < deadline and not self.stop.is_set():
            link.connection.process_data_events(time_limit=0.1)
            if not link.busy and not link.connection.messages_ready(queues):
                return

    def _subscribe_all(
        self, link: Link, specs: Iterable[ConsumerSpec], *, dead_letters_only: bool = False
    ) -> list[str]:
        """Subscribe to the available queues of ``specs`` (only the ``.dead`` ones with
        ``dead_letters_only``); returns their names."""
        shared_channel = link.channels[0]
        queues: list[str] = []
        for spec in specs:
            dead_letters = (
                broker_dead_letter_queues(spec) if self.settings.queue_type == "quorum" else []
            )
            wanted = [] if dead_letters_only else list(consumer_queues(spec, self.settings))
            wanted += dead_letters
            for queue in wanted:
                if queue in link.unavailable or any(q == queue for _, _, q, _ in link.consumers):
                    continue
                channel = shared_channel
                if spec.ordered and queue not in dead_letters:
                    # Its own prefetch window; no cautious start: re-subscribing would hand
                    # the partition (single active consumer) to a standby mid-stream.
                    channel = link.connection.channel()
                    channel.basic_qos(prefetch_count=self.settings.prefetch)
                    link.channels.append(channel)
                    link.ordered.add(channel.channel_number)
                    self._watch(link, channel)
                on_message = functools.partial(
                    self._on_message, link, spec, queue, queue in dead_letters
                )
                tag = channel.basic_consume(queue, on_message)
                link.consumers.append((channel, tag, queue, on_message))
                queues.append(queue)
        return queues

    def _breaker_pausing(self) -> bool:
        """A breaker is not closed: its messages wait in the process, which is not idle."""
        return any(
            breaker is not None and breaker.state is not BreakerState.CLOSED
            for breaker in (self.breakers.get(spec.name) for spec in self.specs)
        )

    def _declare_again(self, link: Link) -> None:
        """Declare the whole topology again on a channel of its own (a refusal closes it) and
        consume the queues that are back; every ``TOPOLOGY_RETRY`` seconds while any is missing."""
        before = set(link.unavailable)
        channel, link.unavailable = link.connection.declare_topology(
            self.specs, known_unavailable=before
        )
        if channel.is_open:
            channel.close()
        back = before - set(link.unavailable)
        if back:
            logger.warning("available again: %s", ", ".join(sorted(back)))
            self._subscribe_all(link, self.specs)
        self._note_unavailable(link)

    def _note_unavailable(self, link: Link) -> None:
        link.retry_topology_at = time.monotonic() + TOPOLOGY_RETRY
        metrics.consumer_queues_unavailable(len(link.unavailable))
        self._consuming_nothing = not link.consumers
        self.health.note(
            "queues_unavailable",
            "not available now (consuming the rest): " + ", ".join(sorted(link.unavailable))
            if link.unavailable
            else None,
        )

    def _watch(self, link: Link, channel: BrokerChannel) -> None:
        """Note a broker ``basic.cancel`` on ``channel``: the main loop then reconnects."""
        number = channel.channel_number

        def on_cancel(frame: object) -> None:
            link.lost = f"the broker cancelled a consumer on channel {number} (queue deleted?)"

        channel.add_on_cancel_callback(on_cancel)

    def _open_up(self, link: Link, prefetch: int) -> None:
        """The first fresh delivery arrived: give the shared channel the full ``PREFETCH``.
        RabbitMQ applies prefetch at subscribe time, so this subscribes again."""
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

    def _check_channels(self, link: Link) -> None:
        """Raise :class:`ChannelLost` when the broker closed a channel or cancelled a consumer
        (pika raises nothing until a closed channel is used)."""
        if link.dropping is not None and link.connection.is_open:
            logger.warning(
                "%s: dropping the connection so the broker gives its partitions back in "
                "place, then connecting again",
                link.dropping,
            )
            link.connection.drop()
            link.lost = link.dropping
        if link.lost is None:
            for channel in link.channels:
                if not channel.is_open:
                    link.lost = f"the broker closed channel {channel.channel_number}"
                    break
        if link.lost is not None and not self.stop.is_set():
            raise ChannelLost(link.lost)

    def _log_progress(self) -> None:
        counts = self.settler.counts()
        if counts:
            announce(
                logger,
                "progress: %s",
                ", ".join(f"{label}={count}" for label, count in sorted(counts.items())),
            )

    def _idle_expired(self, link: Link) -> bool:
        if self.idle_timeout is None:
            return False
        if link.busy or not self.board.empty() or self._breaker_pausing():
            self._last_delivery = time.monotonic()
            return False
        return time.monotonic() - self._last_delivery >= self.idle_timeout

    def _on_message(
        self,
        link: Link,
        spec: ConsumerSpec,
        queue: str,
        from_dead_letter_queue: bool,
        channel: BrokerChannel,
        method: Any,
        properties: Any,
        body: bytes,
    ) -> None:
        delivery = delivery_from_frame(queue, method, properties, body)
        number = channel.channel_number
        link.unsettled.setdefault(number, {})[delivery.delivery_tag] = None
        if link.held_for_the_drop(channel):
            return  # a graceful stop drops the connection: the broker requeues it in place
        if link.cautious and not delivery.redelivered and channel is link.channels[0]:
            link.open_up = True
        if not from_dead_letter_queue:
            metrics.consumer_received(spec.name, delivery.redelivered)
        with link.lock:
            link.in_flight += 1
        self._last_delivery = time.monotonic()
        item = DeliveryWork(
            link, channel, spec, delivery, properties, from_dead_letter_queue=from_dead_letter_queue
        )
        self.board.put(item, self.lane_of.get(queue))


def stop_gracefully(link: Link, settings: MessagingSettings) -> bool:
    """Let the handlers in flight finish within ``SHUTDOWN_TIMEOUT``; False when some were
    still running. Ordered partitions are not cancelled but dropped without a close handshake,
    so the broker requeues them in place before a standby takes over (``docs/guarantees.md``)."""
    for channel, tag, _, _ in link.consumers:
        if channel.channel_number not in link.ordered:
            channel.basic_cancel(tag)
    deadline = time.monotonic() + settings.shutdown_timeout
    while time.monotonic() < deadline and link.busy:
        link.connection.process_data_events(time_limit=0.1)
    if link.ordered:
        link.connection.drop()
    with link.lock:
        left = link.in_flight
    if left:
        logger.error(
            "%d handler(s) still running after SHUTDOWN_TIMEOUT=%ss; their messages "
            "are not acked and will be redelivered",
            left,
            settings.shutdown_timeout,
        )
        return False
    announce(logger, "stopped gracefully: every handler in flight finished and was acked")
    return True
