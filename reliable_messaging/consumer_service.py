"""The long-running consumer: one pika connection, N worker threads, reconnects by itself.

Threading: pika objects live on the connection's thread (the one calling :meth:`run`). Deliveries
are copied into plain :class:`Delivery` values and queued for the worker threads, which do all
database work; each worker hands its outcome back with ``add_callback_threadsafe`` so acks,
nacks and retry publishes happen on the connection's thread again.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pika
import pika.exceptions
from django.db import close_old_connections, connections
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection
from pika.spec import Basic, BasicProperties

from .backoff import Backoff
from .conf import MessagingSettings, messaging_settings, redact_url
from .envelope import CONTENT_TYPE, Delivery, normalize_headers
from .exceptions import DatabaseUnavailable, TopologyMismatchError
from .inbox import DeliveryProcessor
from .outcomes import Acknowledge, Outcome, Release, ScheduleRetry
from .registry import ConsumerSpec
from .topology import connection_parameters, declare_topology, delay_exchange_name

logger = logging.getLogger(__name__)

# Errors after which the connection is gone and a new one must be made.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.StreamLostError,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
    OSError,
)


@dataclass
class _Link:
    """One broker connection and what was received on it. Deliveries are tied to the channel
    they came on: after a reconnect, outcomes of the old link are dropped (the broker redelivers
    those messages, and the inbox recognises any that did commit)."""

    connection: BlockingConnection
    consume_channel: BlockingChannel
    publish_channel: BlockingChannel
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def open(self) -> bool:
        return self.connection.is_open and self.consume_channel.is_open


@dataclass(frozen=True)
class _WorkItem:
    link: _Link
    spec: ConsumerSpec
    delivery: Delivery
    properties: BasicProperties


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
    ) -> None:
        self.specs = list(specs)
        if not self.specs:
            raise ValueError("no consumers to run")
        self.concurrency = max(1, concurrency)
        self.idle_timeout = idle_timeout
        self.settings = settings
        self.on_outcome = on_outcome
        self.exit_code = 0
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._work: queue.Queue[_WorkItem | None] = queue.Queue()
        self._processors = {spec.name: DeliveryProcessor(spec, settings) for spec in self.specs}
        self._workers: list[threading.Thread] = []
        self._last_delivery = time.monotonic()
        self._reconnect = Backoff(0.5, settings.reconnect_max_delay)

    # -- lifecycle ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop taking deliveries, let handlers in flight finish, then return from :meth:`run`.
        Safe to call from a signal handler or another thread."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> int:
        self._start_workers()
        try:
            while not self._stop.is_set():
                try:
                    self._run_connection()
                except TopologyMismatchError as exc:
                    logger.error("%s", exc)
                    self.exit_code = 2
                    break
                except CONNECTION_ERRORS as exc:
                    self.connected.clear()
                    if self._stop.is_set():
                        break
                    wait = self._reconnect.next()
                    logger.warning(
                        "broker connection to %s lost or refused (%s: %s); reconnecting in %.1fs",
                        redact_url(self.settings.broker_url),
                        type(exc).__name__,
                        exc,
                        wait,
                    )
                    self._stop.wait(wait)
        finally:
            self.connected.clear()
            self._stop_workers()
        return self.exit_code

    def _start_workers(self) -> None:
        for index in range(self.concurrency):
            thread = threading.Thread(
                target=self._worker_loop, name=f"rm-worker-{index}", daemon=True
            )
            thread.start()
            self._workers.append(thread)

    def _stop_workers(self) -> None:
        for _ in self._workers:
            self._work.put(None)
        deadline = time.monotonic() + 5
        for thread in self._workers:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the connection's thread ---------------------------------------------------------------

    def _run_connection(self) -> None:
        params = connection_parameters(self.settings, name=f"consume pid={os.getpid()}")
        connection = pika.BlockingConnection(params)
        try:
            consume_channel = connection.channel()
            consume_channel.basic_qos(prefetch_count=max(self.settings.prefetch, self.concurrency))
            declare_topology(consume_channel, self.specs, self.settings)
            publish_channel = connection.channel()
            # Retry copies must reach their delay queue before the original is acked.
            publish_channel.confirm_delivery()
            link = _Link(connection, consume_channel, publish_channel)
            tags = [
                consume_channel.basic_consume(
                    spec.queue, functools.partial(self._on_message, link, spec), auto_ack=False
                )
                for spec in self.specs
            ]
            logger.info(
                "consuming %s from %s (concurrency %d, prefetch %d)",
                ", ".join(s.queue for s in self.specs),
                redact_url(self.settings.broker_url),
                self.concurrency,
                max(self.settings.prefetch, self.concurrency),
            )
            self._reconnect.reset()
            self.connected.set()
            self._last_delivery = time.monotonic()
            while not self._stop.is_set():
                connection.process_data_events(time_limit=0.2)
                if self._idle_expired(link):
                    logger.info("no delivery for %ss: stopping (--idle-timeout)", self.idle_timeout)
                    self._stop.set()
            self._shutdown(link, tags)
        finally:
            self.connected.clear()
            if connection.is_open:
                try:
                    connection.close()
                except Exception:
                    logger.debug("error while closing the broker connection", exc_info=True)

    def _idle_expired(self, link: _Link) -> bool:
        if self.idle_timeout is None:
            return False
        with link.lock:
            busy = link.in_flight > 0
        if busy or not self._work.empty():
            self._last_delivery = time.monotonic()
            return False
        return time.monotonic() - self._last_delivery >= self.idle_timeout

    def _shutdown(self, link: _Link, tags: list[str]) -> None:
        """Graceful stop: cancel the consumers (pika nacks deliveries not yet dispatched), let the
        handlers in flight finish and settle their acks, within ``SHUTDOWN_TIMEOUT``."""
        for tag in tags:
            link.consume_channel.basic_cancel(tag)
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while time.monotonic() < deadline:
            with link.lock:
                if link.in_flight == 0:
                    break
            link.connection.process_data_events(time_limit=0.1)
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
            logger.info("stopped gracefully: every handler in flight finished and was acked")

    def _on_message(
        self,
        link: _Link,
        spec: ConsumerSpec,
        channel: BlockingChannel,
        method: Basic.Deliver,
        properties: BasicProperties,
        body: bytes,
    ) -> None:
        delivery = Delivery(
            body=body,
            queue=spec.queue,
            exchange=method.exchange or "",
            routing_key=method.routing_key or "",
            delivery_tag=method.delivery_tag or 0,
            redelivered=bool(method.redelivered),
            message_id=properties.message_id,
            content_type=properties.content_type,
            timestamp=properties.timestamp,
            headers=normalize_headers(properties.headers),
        )
        with link.lock:
            link.in_flight += 1
        self._last_delivery = time.monotonic()
        self._work.put(_WorkItem(link, spec, delivery, properties))

    def _settle(self, item: _WorkItem, outcome: Outcome) -> None:
        """Carry out ``outcome`` on the broker; runs on the connection's thread."""
        link, tag = item.link, item.delivery.delivery_tag
        with link.lock:
            link.in_flight -= 1
        if not link.open:
            logger.warning(
                "message_id=%s: connection closed before its %s could be settled; "
                "the broker will redeliver it",
                item.delivery.message_id,
                type(outcome).__name__,
            )
            return
        if isinstance(outcome, Acknowledge):
            link.consume_channel.basic_ack(tag)
        elif isinstance(outcome, ScheduleRetry):
            self._publish_retry(item, outcome)
        else:
            link.consume_channel.basic_nack(tag, requeue=True)
        if self.on_outcome is not None:
            self.on_outcome(item.spec, item.delivery, outcome)

    def _publish_retry(self, item: _WorkItem, retry: ScheduleRetry) -> None:
        link, delivery = item.link, item.delivery
        original = item.properties
        properties = BasicProperties(
            content_type=original.content_type or CONTENT_TYPE,
            delivery_mode=pika.DeliveryMode.Persistent,
            message_id=original.message_id,
            timestamp=original.timestamp,
            headers=dict(retry.headers),
        )
        try:
            link.publish_channel.basic_publish(
                exchange=delay_exchange_name(retry.delay, self.settings),
                routing_key=item.spec.queue,
                body=delivery.body,
                properties=properties,
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            logger.error(
                "message_id=%s: the broker refused the retry copy (%s); the original "
                "is requeued and will be tried again now",
                delivery.message_id,
                exc,
            )
            link.consume_channel.basic_nack(delivery.delivery_tag, requeue=True)
            return
        link.consume_channel.basic_ack(delivery.delivery_tag)

    # -- worker threads --------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        try:
            while True:
                item = self._work.get()
                if item is None:
                    return
                outcome = self._process(item)
                self._hand_back(item, outcome)
        finally:
            connections.close_all()

    def _process(self, item: _WorkItem) -> Outcome:
        if self._stop.is_set():
            return Release("stopping: not started")
        if not item.link.open:
            return Release("connection lost before the handler started")
        processor = self._processors[item.spec.name]
        wait = Backoff(0.5, self.settings.reconnect_max_delay)
        warned = False
        while True:
            # Drop connections that broke or outlived CONN_MAX_AGE, as Django does per request.
            close_old_connections()
            try:
                return processor.process(item.delivery)
            except DatabaseUnavailable as exc:
                delay = wait.next()
                log = logger.warning if not warned else logger.debug
                log(
                    "message_id=%s consumer=%s: %s; holding it unacked and retrying in %.1fs",
                    item.delivery.message_id,
                    item.spec.name,
                    exc.__cause__ or exc,
                    delay,
                )
                warned = True
            except Exception:
                # A bug on our side (never the handler's: its exceptions are outcomes). Hold the
                # delivery and try again rather than lose it or spin on it.
                delay = wait.next()
                logger.exception(
                    "message_id=%s consumer=%s: unexpected error while processing; "
                    "holding it unacked and retrying in %.1fs",
                    item.delivery.message_id,
                    item.spec.name,
                    delay,
                )
            finally:
                close_old_connections()
            for conn in connections.all(initialized_only=True):
                conn.close()
            if self._stop.wait(delay):
                return Release("stopping while the database is unavailable")
            if not item.link.open:
                return Release("connection lost while the database was unavailable")

    def _hand_back(self, item: _WorkItem, outcome: Outcome) -> None:
        try:
            item.link.connection.add_callback_threadsafe(
                functools.partial(self._settle, item, outcome)
            )
        except Exception:  # noqa: BLE001 - the connection is gone: the broker redelivers
            with item.link.lock:
                item.link.in_flight -= 1
            logger.warning(
                "message_id=%s: connection closed before its outcome could be "
                "settled; the broker will redeliver it",
                item.delivery.message_id,
            )
