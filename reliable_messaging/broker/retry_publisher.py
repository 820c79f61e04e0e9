"""The consumer's publishing side: retry copies go out, confirmed, on a broker connection and a
thread of their own, so that a resource alarm holds back only the deliveries waiting for one.

``docs/design.md#retry-copies-on-a-connection-of-their-own`` explains.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection
from pika.spec import BasicProperties

from .. import metrics
from ..conf import MessagingSettings, messaging_settings
from ..core.backoff import Backoff, exponential
from ..core.liveness import HealthState
from .queues import describe_broker_error
from .replies import NOT_FOUND
from .topology import CONNECTION_ERRORS, connect

logger = logging.getLogger(__name__)

# Backoff of a copy the broker refused, while its original stays unacked.
REFUSED_FIRST_DELAY = 1.0
# A publish waiting this long for its confirm is shown as blocked (see refresh).
STALL_AFTER = 5.0
# The longest the thread sleeps in the broker's I/O loop between two looks at its jobs.
TICK = 0.2


@dataclass
class RetryCopy:
    """One copy to publish, and what to do once it is placed (or cannot be)."""

    exchange: str
    routing_key: str
    body: bytes
    properties: BasicProperties
    message_id: str
    received: float  # when the original arrived (monotonic): the hold bound counts from it
    # Called on the publisher's thread: the copy is confirmed (ack the original), or no copy
    # could be placed in time (requeue the original).
    placed: Callable[[], None]
    give_back: Callable[[], None]
    # False once the original's connection is gone (the broker redelivers it then).
    wanted: Callable[[], bool] = lambda: True


@dataclass(order=True)
class _Job:
    ready_at: float
    seq: int
    copy: RetryCopy = field(compare=False)
    refusals: int = field(compare=False, default=0)


class RetryPublisher:
    """Publishes :class:`RetryCopy` values from a daemon thread over a connection of its own,
    opened at the first copy and kept (heartbeats served) until :meth:`stop`."""

    def __init__(
        self,
        settings: MessagingSettings = messaging_settings,
        *,
        health: HealthState | None = None,
        on_missing: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.health = health
        # Told the name of a delay exchange the broker says does not exist: declare again.
        self.on_missing = on_missing
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []
        self._seq = itertools.count()
        self._busy = 0  # jobs taken from the heap and not yet finished
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._connection: BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._reconnect = Backoff(0.5, settings.reconnect_max_delay)
        self._blocked_by: str | None = None  # the broker's reason while it blocks publishing
        # When the publish under way began (monotonic), else None; and what is shown now.
        self._publishing_since: float | None = None
        self._shown: str | None = None
        self._show_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rm-retry-publisher", daemon=True)

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> RetryPublisher:
        self._thread.start()
        return self

    def submit(self, copy: RetryCopy) -> None:
        with self._lock:
            heapq.heappush(self._jobs, _Job(time.monotonic(), next(self._seq), copy))
        self._poke()

    def pending(self) -> int:
        """Copies submitted and not yet placed, given back or dropped."""
        with self._lock:
            return len(self._jobs) + self._busy

    def stop(self, timeout: float = 5.0) -> None:
        """Stop; copies not yet placed are dropped (the broker redelivers their originals)."""
        self._stopping.set()
        self._poke()
        self._thread.join(timeout)
        left = self.pending()
        if left:
            logger.warning(
                "stopping with %d retry cop%s not placed; the broker redelivers their originals",
                left,
                "y" if left == 1 else "ies",
            )

    def _poke(self) -> None:
        self._wake.set()
        connection = self._connection
        if connection is not None:
            try:
                # Wakes the publisher's thread out of process_data_events at once.
                connection.add_callback_threadsafe(lambda: None)
            except Exception:  # closed meanwhile: the thread wakes by its tick
                logger.debug("could not wake the retry publisher", exc_info=True)

    # -- the publisher's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                job = self._take_ready()
                if job is None:
                    self._idle()
                    continue
                try:
                    self._publish(job)
                finally:
                    self._publishing_since = None
                    with self._lock:
                        self._busy -= 1
        finally:
            self._disconnect()

    def _take_ready(self) -> _Job | None:
        with self._lock:
            if self._jobs and self._jobs[0].ready_at <= time.monotonic():
                self._busy += 1
                return heapq.heappop(self._jobs)
            return None

    def _idle(self) -> None:
        with self._lock:
            wait = TICK
            if self._jobs:
                wait = max(0.0, min(wait, self._jobs[0].ready_at - time.monotonic()))
        self._wake.clear()
        connection = self._connection
        if connection is not None and connection.is_open:
            try:
                connection.process_data_events(time_limit=wait)
                return
            except CONNECTION_ERRORS as exc:
                logger.warning(
                    "retry publisher: broker connection lost (%s)",
                    describe_broker_error(exc, self.settings),
                )
                self._disconnect()
        self._wake.wait(wait)

    def _publish(self, job: _Job) -> None:
        copy = job.copy
        if not copy.wanted():
            return  # the original's connection is gone: the broker redelivers it
        try:
            channel = self._open_channel()
            self._publishing_since = time.monotonic()
            channel.basic_publish(
                copy.exchange, copy.routing_key, copy.body, copy.properties, mandatory=True
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            self._publishing_since = None
            self._refused(job, exc)
            return
        except Exception as exc:  # never die: the originals would wait forever
            if isinstance(exc, pika.exceptions.ChannelClosedByBroker):
                self._channel = None
                if exc.reply_code == NOT_FOUND and self.on_missing is not None:
                    self.on_missing(copy.exchange)
            else:
                if not isinstance(exc, CONNECTION_ERRORS):
                    logger.exception("retry publisher: unexpected error publishing a retry copy")
                self._disconnect()
            self._again(job, exc, self._reconnect.next())
            return
        self._reconnect.reset()
        copy.placed()

    def _refused(self, job: _Job, exc: Exception) -> None:
        refusals = job.refusals + 1
        delay = exponential(REFUSED_FIRST_DELAY, refusals - 1, self.settings.reconnect_max_delay)
        logger.error(
            "message_id=%s: the broker refused the retry copy (%s); the original stays unacked "
            "and the copy is published again in %.1fs (refusal %d)",
            job.copy.message_id,
            type(exc).__name__,
            delay,
            refusals,
        )
        self._again(job, exc, delay, refusals)

    def _again(self, job: _Job, exc: BaseException, delay: float, refusals: int = 0) -> None:
        copy = job.copy
        held = time.monotonic() - copy.received
        if self._stopping.is_set():
            return
        if held + delay > self.settings.max_hold_seconds:
            logger.error(
                "message_id=%s: no retry copy could be placed in %.0fs (%s); giving the "
                "original back to its queue",
                copy.message_id,
                held,
                describe_broker_error(exc, self.settings),
            )
            copy.give_back()
            return
        with self._lock:
            heapq.heappush(
                self._jobs,
                _Job(time.monotonic() + delay, next(self._seq), copy, refusals or job.refusals),
            )

    def _open_channel(self) -> BlockingChannel:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        if self._connection is None or not self._connection.is_open:
            self._disconnect()
            self._connection = connect(
                self.settings, name=f"consume pid={os.getpid()} retry copies"
            )
            self._connection.add_on_connection_blocked_callback(self._on_blocked)
            self._connection.add_on_connection_unblocked_callback(self._on_unblocked)
        self._channel = self._connection.channel()
        # A copy must be in its delay queue before the original is acked.
        self._channel.confirm_delivery()
        return self._channel

    def _on_blocked(self, connection: object, frame: object) -> None:
        reason = getattr(getattr(frame, "method", None), "reason", "") or "a resource alarm"
        self._blocked_by = str(reason)
        self.refresh()

    def _on_unblocked(self, connection: object = None, frame: object = None) -> None:
        self._blocked_by = None
        self.refresh()

    def refresh(self) -> None:
        """Show a block in the metrics and ``/healthz`` (from the consumer's loop). pika tells of
        a block only once the publish returns: a confirm awaited past STALL_AFTER counts too."""
        since = self._publishing_since
        waited = time.monotonic() - since if since is not None else 0.0
        text = None
        if self._blocked_by is not None:
            text = f"the broker blocks publishing ({self._blocked_by}): retry copies wait"
        elif waited > STALL_AFTER:
            text = (
                f"a retry copy has waited {waited:.0f}s for the broker's confirm (a resource "
                f"alarm blocking publishers?): retry copies wait"
            )
        with self._show_lock:
            if (text is None) == (self._shown is None):
                if text is not None and self.health is not None:
                    self.health.note("publish_blocked", text)
                return
            self._shown = text
        if text is not None:
            logger.warning("%s; every other delivery is handled and acked as usual", text)
        else:
            logger.warning("publishing works again: retry copies go out")
        metrics.consumer_blocked(text is not None)
        if self.health is not None:
            self.health.note("publish_blocked", text)

    def _disconnect(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        self._on_unblocked()
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # closing a broken connection: nothing to keep
                logger.debug("closing the retry publisher's connection failed", exc_info=True)
