"""The outbox relay's life (connect, reconnect, stop, flow control), routing what the broker
says to its parts; :func:`build_relay` assembles them over a publisher transport
(``docs/design.md#the-relay-a-pipeline-with-publisher-confirms``)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.db import DatabaseError, connections, router

from .. import metrics
from ..broker.publisher import ChannelClosed, ConfirmingPublisher, PublisherTransport, Returned
from ..conf import MessagingSettings, messaging_settings
from ..core.backoff import Backoff
from ..core.liveness import HealthState
from ..core.registry import ConsumerSpec
from ..models import OutboxMessage
from . import wake_after_commit
from .claims import OutboxClaims
from .consumer_topology import ConsumerTopology
from .in_flight import InFlight
from .listener import WakeUps
from .scheduling import MAX_IN_FLIGHT, ClaimScheduler

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")

# Seconds a claim's lease lasts past RELAY_CONFIRM_TIMEOUT.
LEASE_MARGIN = 5.0
# Outbox rows per batch unless `relay --batch-size` says otherwise (docs/benchmarks.md).
BATCH_SIZE = 2000


@dataclass
class RelayReport:
    """What a relay did; ``left_failed`` counts failed rows in the outbox when it stopped."""

    sent: int = 0
    nacked: int = 0
    returned: int = 0
    unrouted: int = 0  # events no queue was bound for, marked unrouted (also in ``returned``)
    timed_out: int = 0
    batches: int = 0
    left_failed: int = 0
    left_pending: int = 0
    left_retrying: int = 0  # pending rows that already failed at least once

    def add(self, other: RelayReport) -> None:
        """Add what ``other`` did (not what it left: that is read once for all lanes)."""
        for name in ("sent", "nacked", "returned", "unrouted", "timed_out", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count_left(self, using: str) -> None:
        """Read the rows left in the outbox: three counts, each through its own index."""
        outbox = OutboxMessage.objects.using(using)
        try:
            pending = outbox.pending()
            left = [q.count() for q in (pending, pending.filter(attempts__gt=0), outbox.failed())]
        except DatabaseError:
            logger.warning("relay: cannot count the outbox rows left (database unavailable)")
            return
        self.left_pending, self.left_retrying, self.left_failed = left

    def summary(self) -> str:
        return (
            f"sent {self.sent}, nacked {self.nacked}, unroutable {self.returned} "
            f"({self.unrouted} event(s) with no subscriber marked unrouted), "
            f"confirm timeouts {self.timed_out} in {self.batches} batch(es); outbox now has "
            f"{self.left_pending} pending ({self.left_retrying} after failed sends) and "
            f"{self.left_failed} failed row(s)"
        )


@dataclass(eq=False)
class OutboxRelay:
    """Publishes the outbox until stopped (``once``: until nothing is pending), on the I/O loop."""

    publisher: PublisherTransport
    claims: OutboxClaims
    in_flight: InFlight
    scheduler: ClaimScheduler
    wake_ups: WakeUps
    topology: ConsumerTopology
    report: RelayReport
    health: HealthState
    once: bool = False
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        self.settings = self.claims.settings
        self.using = self.claims.using
        self.batch_size = self.claims.batch_size
        self.deadline = None if self.max_seconds is None else time.monotonic() + self.max_seconds
        self._stop_requested = False
        self._finished = False
        self._blocked = False  # the broker sent connection.blocked on the current connection
        self._watch_timer: object = None
        self._reconnect = Backoff(0.5, self.settings.reconnect_max_delay)

    @property
    def listen(self) -> bool:
        """Whether the relay wakes on NOTIFY (PostgreSQL, psycopg 3) rather than only polls."""
        return self.wake_ups.enabled

    # -- lifecycle --------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the batch in flight, then return from :meth:`run`; safe in a signal handler."""
        self._stop_requested = True

    def run(self) -> RelayReport:
        self.scheduler.start(self)
        try:
            while not self._done():
                self.wake_ups.close(retry_at_once=True)  # a new loop gets a LISTEN of its own
                self.publisher.run(self)
                self._after_loop()
                if self._done():
                    break
                # Another node of the list is tried at once; the backoff is for a whole round.
                wait = 0.1 if self.publisher.more_brokers else self._reconnect.next()
                logger.warning(
                    "relay: broker %s unavailable; reconnecting in %.1fs",
                    self.settings.broker_shown,
                    wait,
                )
                self._sleep(wait)
        finally:
            self.health.stopping()
            self.wake_ups.close()
            self._after_loop()
            self.scheduler.close()
            self.topology.close()
        self.report.count_left(self.using)
        return self.report

    def _done(self) -> bool:
        return self._finished or self.stopping()

    def _after_loop(self) -> None:
        """A loop ended: what was in flight is recorded as far as it got."""
        self.in_flight.abort("the connection's loop ended")
        self.scheduler.after_loop()

    # -- what the scheduler asks (ClaimOwner) ------------------------------------------------

    def stopping(self) -> bool:
        return self._stop_requested or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )

    def holding(self) -> bool:
        return self._blocked or self.topology.declaring

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop_requested and time.monotonic() < end:
            self.health.heartbeat()  # waiting to reconnect is alive, not stuck
            # The clock moves between the check and this read: never a negative sleep.
            time.sleep(max(0.0, min(0.2, end - time.monotonic())))

    # -- what the broker says (PublisherEvents) ----------------------------------------------

    def on_ready(self) -> None:
        logger.info(
            "relay: publishing the outbox to %s with confirms (batch size %d%s)",
            self.settings.broker_shown,
            self.batch_size,
            ", LISTEN/NOTIFY wake-ups" if self.listen else ", polling",
        )
        self._reconnect.reset()
        self.health.set_broker(True)
        self._watch()
        # The first claim of a connection waits for the consumers' queues to be declared.
        self.topology.before_sending(lambda: self.scheduler.schedule(0))

    def on_connect_failed(self, error: str) -> None:
        self.health.set_broker(False)
        self.topology.failed()

    def on_connection_closed(self, reason: str) -> None:
        self.health.set_broker(False)
        self._set_blocked(False)
        self.in_flight.abort(f"connection closed: {reason}")
        self._cancel_timers()
        self.topology.connection_lost()
        if not (self._finished or self._stop_requested):
            self.topology.failed()
            logger.warning("relay: broker connection closed: %s", reason)

    def on_channel_closed(self, closed: ChannelClosed) -> None:
        if not self.in_flight.on_refused(closed):
            self.in_flight.abort(f"channel closed: {closed}")
        if self.publisher.is_open and not self._finished:
            logger.warning("relay: channel closed (%s); opening a new one", closed)
            self._cancel_timers()
            self.publisher.reopen_channel()

    def on_returned(self, returned: Returned) -> None:
        self.in_flight.on_returned(returned)

    def on_blocked(self, reason: str) -> None:
        if self._blocked:
            return
        self._set_blocked(True)
        logger.warning(
            "relay: the broker blocked the connection (%s); claiming no rows until it is "
            "unblocked, the batches in flight wait for their confirms",
            reason,
        )
        self.in_flight.pause_timers()

    def on_unblocked(self) -> None:
        if not self._blocked:
            return
        self._set_blocked(False)
        logger.info("relay: the broker unblocked the connection; resuming")
        self.in_flight.resume_timers()
        self.scheduler.schedule(0)

    def _set_blocked(self, blocked: bool) -> None:
        if blocked != self._blocked:
            self._blocked = blocked
            metrics.relay_blocked(blocked)
            # A note, not a failure: the relay is fine, and restarting it would not help.
            alarm = "the broker blocks publishing (a resource alarm): outbox rows wait"
            self.health.note("publish_blocked", alarm if blocked else None)

    def on_confirm(self, tag: int, multiple: bool, acked: bool) -> None:
        self.in_flight.on_confirm(tag, multiple, acked)

    # -- timers -----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Every 0.2 s: beat the heart, honour a stop or the deadline, look after LISTEN."""
        if not self.publisher.is_open:
            return
        self.health.heartbeat()
        if self._stop_requested:
            self.health.stopping()
        if self.stopping():
            if self._blocked:
                self._leave_blocked()
                return
            if not (self.in_flight or self.scheduler.busy()):
                self._finish()
                return
        self.in_flight.renew_leases()
        self.wake_ups.look_after(self.publisher, self._on_notify)
        self._watch_timer = self.publisher.call_later(0.2, self._watch)

    def _finish(self, close: Callable[[], None] | None = None) -> None:
        self._finished = True
        self._cancel_timers()
        (close or self.publisher.close)()

    def _cancel_timers(self) -> None:
        self.scheduler.cancel()
        self.publisher.cancel(self._watch_timer)
        self._watch_timer = None

    def _leave_blocked(self) -> None:
        """Stop while the broker blocks us: a batch in flight rolls back."""
        self.in_flight.abort("stopping while the broker blocks the connection")
        self._set_blocked(False)
        self._finish(self.publisher.abandon)

    def nothing_due(self) -> bool:
        """Nothing is due now: with ``once`` the relay stops (rows backing off are left)."""
        if not self.once:
            return False
        logger.info("relay: nothing left to send")
        self._finish()
        return True

    def _on_notify(self) -> None:
        if len(self.in_flight) < MAX_IN_FLIGHT:
            self.scheduler.schedule(0)
        # else: the next batch to finish schedules a claim


def build_relay(
    settings: MessagingSettings = messaging_settings,
    *,
    transport: PublisherTransport | None = None,
    batch_size: int | None = None,
    once: bool = False,
    max_seconds: float | None = None,
    listen: bool = True,
    on_batch: Callable[[RelayReport], None] | None = None,
    health: HealthState | None = None,
    consumers: Iterable[ConsumerSpec] = (),
    declare_once_per_process: bool = False,
) -> OutboxRelay:
    """A relay publishing through ``transport`` (pika's by default); it declares the queues of
    ``consumers`` before it sends. ``on_batch`` gets the report after each batch."""
    publisher = transport if transport is not None else ConfirmingPublisher(settings)
    health = health if health is not None else HealthState()
    using = router.db_for_write(OutboxMessage)
    report = RelayReport()
    lease = dt.timedelta(seconds=settings.relay_confirm_timeout + LEASE_MARGIN)
    claims = OutboxClaims(using, settings, batch_size or BATCH_SIZE, lease)
    in_flight = InFlight(publisher, claims, report, health, on_batch)
    wake_ups = WakeUps(
        using,
        enabled=listen and connections[using].vendor == "postgresql",
        poll_interval=settings.relay_poll_interval,
        dsn=settings.relay_listen_dsn,
        send_probe=wake_after_commit.sender.probe,
        health=health,
    )
    topology = ConsumerTopology(
        list(consumers), publisher, settings, health, declare_once_per_process
    )
    return OutboxRelay(
        publisher=publisher,
        claims=claims,
        in_flight=in_flight,
        scheduler=ClaimScheduler(publisher, claims, in_flight, wake_ups, health),
        wake_ups=wake_ups,
        topology=topology,
        report=report,
        health=health,
        once=once,
        max_seconds=max_seconds,
    )
