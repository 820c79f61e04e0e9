"""When the relay claims (``docs/design.md#when-the-relay-claims``): on the I/O loop, but the
``*_job`` methods, which run on a database worker."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from django.db import DatabaseError

from ..broker.publisher import PublisherTransport
from ..core.backoff import Backoff
from ..core.liveness import HealthState
from .claims import Claim, ClaimTransaction, OutboxClaims, release_parked
from .database_worker import DatabaseWorker
from .in_flight import InFlight
from .listener import WakeUps
from .scheduled import PROMOTE_CHUNK, next_due_in, promote_due

logger = logging.getLogger("reliable_messaging.relay")

# Batches awaiting confirms at once, each on a database worker of its own.
MAX_IN_FLIGHT = 3
# A sweep for rows left parked by other means than a send (a row deleted by hand, say).
SWEEP_INTERVAL = 30.0
# After rows, the waits between claims that find none double from TRAIL_FIRST to TRAIL_LAST.
TRAIL_FIRST = 0.01
TRAIL_LAST = 0.64
# How often a busy relay looks for a scheduled row fallen due: how late one can go out.
SCHEDULED_LOOK = 0.5
# The first wait, doubling to SCHEDULED_LOOK, while a due scheduled row is locked elsewhere.
HELD_FIRST = 0.05


class ClaimOwner(Protocol):
    """What the scheduler asks the relay that runs it (:meth:`ClaimScheduler.start`)."""

    def stopping(self) -> bool:
        """A stop was asked for, or the deadline passed."""

    def holding(self) -> bool:
        """No claim now: the broker blocks us, or the consumers' queues are being declared."""

    def nothing_due(self) -> bool:
        """Nothing is due now; True when the relay stops for it (``--once``)."""


@dataclass(eq=False)
class ClaimScheduler:
    """Gives claims to the relay's database workers and publishes what they find."""

    publisher: PublisherTransport
    claims: OutboxClaims
    in_flight: InFlight
    wake_ups: WakeUps
    health: HealthState
    owner: ClaimOwner = field(init=False, repr=False)  # the relay, from start()

    def __post_init__(self) -> None:
        # One per batch that may be in flight; they run every query of the batches.
        self.workers: list[DatabaseWorker] = []
        self._look_again = False  # a claim was asked for while one was under way
        self._tick_at = 0.0  # monotonic time the pending tick timer fires
        self._tick_timer: object = None
        self._next_sweep = 0.0  # monotonic time of the next release_parked sweep
        self._sweep_after: int | None = None  # where the sweep's pass goes on
        self._next_promote = 0.0  # monotonic time to look for due scheduled rows next
        self._held_until = 0.0
        self._held_backoff = Backoff(HELD_FIRST, SCHEDULED_LOOK)
        self._db_backoff = Backoff(0.5, self.claims.settings.reconnect_max_delay)
        self._db_down_since: float | None = None  # monotonic start of a database outage
        self._trail: float | None = None

    def start(self, owner: ClaimOwner) -> None:
        """Start the database workers, named after the thread that runs ``owner``."""
        self.owner = owner
        name = threading.current_thread().name
        self.workers = [DatabaseWorker(f"{name}-db{i}") for i in range(MAX_IN_FLIGHT)]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def busy(self) -> bool:
        """A claim is under way or a batch is in flight or being recorded."""
        return not all(worker.free for worker in self.workers)

    def cancel(self) -> None:
        self.publisher.cancel(self._tick_timer)
        self._tick_timer = None

    def schedule(self, delay: float) -> None:
        """Claim again in ``delay`` seconds, unless a claim is already due sooner."""
        if not self.publisher.is_open:
            return
        at = time.monotonic() + delay
        if self._tick_timer is not None:
            if self._tick_at <= at:
                return
            self.publisher.cancel(self._tick_timer)
        self._tick_at = at
        self._tick_timer = self.publisher.call_later(delay, self._tick)

    def after_loop(self) -> None:
        """A loop ended: the workers finish their jobs; a claim never published rolls back."""
        for worker in self.workers:
            worker.drain()
            claimed, worker.claimed = worker.claimed, None
            worker.claiming = False
            worker.batch = None
            if claimed is not None and claimed.transaction is not None:
                worker.submit(functools.partial(self._roll_back_job, claimed.transaction))
                worker.drain()

    @staticmethod
    def _roll_back_job(held: ClaimTransaction) -> None:
        """Database worker: end a claim's transaction without a trace: its rows are due."""
        try:
            held.rollback(RuntimeError("not published"))
        except DatabaseError:
            logger.debug("rolling back an unpublished claim failed", exc_info=True)

    def on_recorded(self, recorded: bool) -> None:
        """I/O loop: a batch was recorded: claim again (after a backoff if it could not be)."""
        self.schedule(0 if recorded else self._db_backoff.next())

    def _tick(self) -> None:
        """I/O loop: give the next claim to a free database worker."""
        self._tick_timer = None
        if not self.publisher.ready:
            return
        if any(worker.claiming for worker in self.workers):
            # It may have looked before what this tick is for: its answer looks again.
            self._look_again = True
            return
        # A worker still finishing a job (recording a batch) takes the claim after it.
        worker = next((worker for worker in self.workers if worker.free), None)
        if worker is None:
            return  # the next batch to be recorded schedules a claim
        if self.owner.stopping():
            return  # the relay's watch closes the connection
        if self.owner.holding():
            return  # the unblock, or the declaration's end, schedules the next tick
        sweep = time.monotonic() >= self._next_sweep
        if sweep:
            # The sweep sets when the next one is due; this stands if it fails.
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL
        worker.claiming = True
        self._look_again = False
        worker.submit(functools.partial(self._claim_job, worker, sweep))

    def _claim_job(self, worker: DatabaseWorker, sweep: bool) -> None:
        """Database worker: claim a batch and hand it to the I/O loop."""
        try:
            if sweep:
                self._sweep()
            if time.monotonic() >= self._next_promote:
                self._promote()
            claim = self.claims.claim()
            if claim.transaction is None and not claim.parked:
                claim.wait = self._idle_wait()
        except DatabaseError as exc:
            self.claims.forget_connection()  # a fresh connection on the next try
            claim = Claim(rows=[], error=exc)
        except Exception as exc:  # a bug must not leave the relay waiting for this claim
            logger.exception("relay: unexpected error while claiming rows")
            claim = Claim(rows=[], error=DatabaseError(f"unexpected error: {exc!r}"))
        worker.claimed = claim
        self.publisher.post(functools.partial(self._on_claimed, worker))

    def _on_claimed(self, worker: DatabaseWorker) -> None:
        """I/O loop: publish what the claim found, and decide when to claim again."""
        claim, worker.claimed = worker.claimed, None
        worker.claiming = False
        if claim is None:
            return
        if not self.publisher.is_open:
            if claim.transaction is not None:
                worker.submit(functools.partial(self._roll_back_job, claim.transaction))
            return
        if claim.error is not None:
            self.health.set_database(False, str(claim.error))
            wait = self._db_backoff.next()
            first = self._db_down_since is None
            if first:
                self._db_down_since = time.monotonic()
            # Said once per outage, as the consumer says it; each retry at DEBUG.
            (logger.warning if first else logger.debug)(
                "relay: database unavailable (%s); rows stay pending, retrying in %.1fs%s",
                claim.error,
                wait,
                "; said once until it is back" if first else "",
            )
            self.schedule(wait)
            return
        if self._db_down_since is not None:
            logger.info(
                "relay: database available again after %.1fs",
                time.monotonic() - self._db_down_since,
            )
            self._db_down_since = None
        self._db_backoff.reset()
        self.health.set_database(True)
        if claim.transaction is not None:
            if not self.publisher.ready or self.owner.holding():
                # The channel went or the broker blocked us meanwhile: the rows are due again.
                worker.submit(functools.partial(self._roll_back_job, claim.transaction))
                return
            self.in_flight.publish(worker, claim, self.on_recorded)
        if claim.rows:
            self._trail = TRAIL_FIRST
        if claim.rows or claim.parked or self._look_again:
            # More may be due: claim the next batch while this one's confirms come back.
            self.schedule(0)
            return
        if self.in_flight or self.busy():
            return  # a batch in flight schedules a claim when it is recorded
        if self._tick_timer is not None and self._tick_at <= time.monotonic():
            return  # a claim is due already (asked for after this one looked)
        if self.owner.nothing_due():
            return
        self.schedule(self._next_wait(claim.wait))

    def _next_wait(self, idle_wait: float) -> float:
        """I/O loop: the wait after a claim that found nothing (the trail's next step)."""
        trail = self._trail
        if trail is None:
            return idle_wait
        self._trail = trail * 2 if trail < TRAIL_LAST else None
        return min(trail, idle_wait)

    def _sweep(self) -> None:
        """Release a slice of the parked rows nothing holds back any more."""
        released, self._sweep_after = release_parked(self.claims.using, self._sweep_after or 0)
        self._next_sweep = time.monotonic() + (1.0 if self._sweep_after else SWEEP_INTERVAL)
        if released:
            logger.info(
                "relay: %d parked row(s) released: the row before them is no longer unsent",
                released,
            )

    def _promote(self) -> None:
        """Database worker: make a chunk of due scheduled rows pending; note when to look next."""
        self._next_promote = time.monotonic() + SCHEDULED_LOOK  # meanwhile, for the others
        promoted = promote_due(self.claims.using)
        if promoted:
            logger.debug("relay: %d scheduled row(s) fell due", promoted)
        if promoted >= PROMOTE_CHUNK:
            self._next_promote = time.monotonic()  # more are due: look again at once
            return
        due_in = next_due_in(self.claims.using)
        if due_in == 0.0 and not promoted:
            # Due, yet skipped: another transaction holds it locked (see HELD_FIRST).
            self._held_until = time.monotonic() + self._held_backoff.next()
        else:
            self._held_until = 0.0
            self._held_backoff.reset()
        self._note_scheduled(due_in)

    def _note_scheduled(self, due_in: float | None) -> float | None:
        """Look for due scheduled rows at the next due time, at most SCHEDULED_LOOK from now."""
        if due_in == 0.0:
            due_in = max(0.0, self._held_until - time.monotonic())
        wait = SCHEDULED_LOOK if due_in is None else min(SCHEDULED_LOOK, due_in)
        self._next_promote = time.monotonic() + wait
        return due_in

    def _idle_wait(self) -> float:
        """Database worker: how long the relay may sleep before the next claim."""
        poll = self.claims.settings.relay_poll_interval
        if self.wake_ups.listening:
            # NOTIFY wakes us (a probe proved it); polling only catches backoffs and misses.
            poll = max(poll, 5.0)
        due_in = self.claims.next_due_in()  # a row waiting out a backoff or a lease
        if due_in is not None:
            poll = min(poll, due_in)
        # A scheduled row: at its due time, whatever the poll.
        scheduled_in = self._note_scheduled(next_due_in(self.claims.using))
        if scheduled_in is not None:
            poll = min(poll, scheduled_in)
        return min(poll, max(0.0, self._next_sweep - time.monotonic()))
