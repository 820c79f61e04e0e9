"""The registered consumers' queues and bindings, declared by the relay before it sends; never
fatal (``docs/design.md#the-relay-declares-the-consumers-topology``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..broker.declaring import declare_tolerantly
from ..broker.publisher import PublisherTransport
from ..broker.topology import Declared, consumer_queues
from ..conf import MessagingSettings
from ..core.backoff import Backoff
from ..core.liveness import HealthState
from ..core.registry import ConsumerSpec

logger = logging.getLogger("reliable_messaging.relay")

# Seconds the relay waits for the declaration before it sends anyway (and the connect timeout).
DECLARE_WAIT = 30.0
# Seconds before a queue the broker could not serve is declared again, doubling up to the most.
REDECLARE_FIRST = 1.0
REDECLARE_MAX = 30.0
# The /healthz notes this module sets.
DRIFT_NOTE = "topology_drift"
UNDECLARED_NOTE = "topology_not_declared"

# What this process declared in full, for the relays that declare once per process.
_declared_in_process: set[Hashable] = set()
_declared_lock = threading.Lock()


@dataclass(eq=False)
class ConsumerTopology:
    """Declares ``specs``' topology once per relay connection (or process) before its first
    claim, on the I/O loop but :meth:`_declare`."""

    specs: list[ConsumerSpec]
    publisher: PublisherTransport
    settings: MessagingSettings
    health: HealthState
    once_per_process: bool = False

    def __post_init__(self) -> None:
        self._generation = 0  # the connection declared for; an earlier one's outcome is ignored
        self._declared = False  # for the current connection (or given up on)
        self._then: Callable[[], None] | None = None
        self._timer: object = None
        self._threads: list[threading.Thread] = []
        self._reported: set[str] = set()  # said at ERROR: a reconnect says them at DEBUG
        self._unavailable: dict[str, str] = {}  # queues the broker could not serve last time
        self._redeclare = Backoff(REDECLARE_FIRST, REDECLARE_MAX)
        self._redeclare_timer: object = None

    @property
    def declaring(self) -> bool:
        """A declaration for this connection is under way: no claim may start."""
        return self._then is not None

    def before_sending(self, then: Callable[[], None]) -> None:
        """A channel is ready: call ``then`` once this connection's declaration is done."""
        if self._declared or not self.specs or not self.settings.relay_declares_topology:
            then()
            return
        if self.once_per_process and self._process_key() in _declared_in_process:
            self._declared = True
            then()
            return
        started = self._then is not None
        self._then = then
        if started:
            return
        self._start_declaring()
        generation = self._generation
        self._timer = self.publisher.call_later(DECLARE_WAIT, lambda: self._waited(generation))

    def connection_lost(self) -> None:
        """The connection ended: the next one declares again."""
        self._generation += 1
        self._declared = False
        self._then = None
        self.publisher.cancel(self._timer)
        self._timer = None
        self.publisher.cancel(self._redeclare_timer)
        self._redeclare_timer = None
        self._redeclare.reset()

    def failed(self) -> None:
        """Declaring failed, or the connection did: the next relay of this process declares."""
        with _declared_lock:
            _declared_in_process.discard(self._process_key())

    def close(self, timeout: float = 5.0) -> None:
        """Wait a little for declarations still under way (the relay is stopping)."""
        for thread in self._threads:
            thread.join(timeout)

    def _process_key(self) -> Hashable:
        """What the declaration depends on, besides the broker."""
        return (
            self.settings.exchange,
            self.settings.queue_type,
            tuple((s.queue, s.exchange, s.bindings, s.ordered) for s in self.specs),
        )

    def _start_declaring(self) -> None:
        generation = self._generation
        known = set(self._unavailable)
        thread = threading.Thread(
            target=self._declare, args=(generation, known), name="rm-relay-declare", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    # -- the declaring thread ---------------------------------------------------------------

    def _declare(self, generation: int, known_unavailable: set[str]) -> None:
        """Declaring thread: declare on a connection of its own; the outcome goes to the loop."""
        outcome: Declared | str
        try:
            outcome = declare_tolerantly(
                self.specs,
                self.settings,
                name="relay (declaring)",
                timeout=DECLARE_WAIT,
                known_unavailable=known_unavailable,
            )
        except Exception as exc:  # never take the relay down for it
            logger.exception("relay: unexpected error while declaring the consumers' queues")
            outcome = f"unexpected error: {exc!r}"
        self.publisher.post(lambda: self._finished(generation, outcome))

    # -- back on the I/O loop ---------------------------------------------------------------

    def _finished(self, generation: int, outcome: Declared | str) -> None:
        if generation != self._generation:
            return  # declared for a connection that is gone; the new one declares again
        again = self._declared  # declared again for the queues that were unavailable
        if isinstance(outcome, str):
            self.failed()
            logger.warning(
                "relay: the queues and bindings of the registered consumers could not be "
                "declared (%s); sending anyway, and an event no queue is bound for yet is "
                "marked unrouted. The next connection tries again; meanwhile start consume "
                "first, or, if the broker refused, give the relay's user the configure "
                "permission on the vhost (or set RELAY_DECLARES_TOPOLOGY to False)",
                outcome,
            )
            self.health.note(UNDECLARED_NOTE, f"consumers' queues not declared: {outcome}")
            if again and self._unavailable:
                self._declare_later()
        else:
            self._report_mismatches(outcome.mismatched)
            if not again:
                queues = sum(len(consumer_queues(spec, self.settings)) for spec in self.specs)
                logger.info(
                    "relay: declared the queues and bindings of %d registered consumer(s) "
                    "(%d queue(s)) before sending",
                    len(self.specs),
                    queues,
                )
            back = sorted(set(self._unavailable) - set(outcome.unavailable))
            if again and back:
                logger.info(
                    "relay: declared %s, which the broker could not serve before", ", ".join(back)
                )
            self._note_unavailable(outcome.unavailable)
        self._done()

    def _note_unavailable(self, unavailable: dict[str, str]) -> None:
        """Remember what the broker could not serve; declare it again later on this connection."""
        newly = sorted(set(unavailable) - set(self._unavailable))
        self._unavailable = dict(unavailable)
        if not unavailable:
            self.health.note(UNDECLARED_NOTE, None)
            self._redeclare.reset()
            if self.once_per_process:
                with _declared_lock:
                    _declared_in_process.add(self._process_key())
            return
        self.failed()
        self.health.note(
            UNDECLARED_NOTE,
            f"consumers' queues not available now: {', '.join(sorted(unavailable))}",
        )
        delay = self._declare_later()
        (logger.warning if newly else logger.debug)(
            "relay: the broker cannot serve %s now (%s); an event bound for these alone is "
            "marked unrouted meanwhile. Declared again in %.1fs",
            ", ".join(sorted(unavailable)),
            "; ".join(f"{name}: {why}" for name, why in sorted(unavailable.items())),
            delay,
        )

    def _declare_later(self) -> float:
        """Declare again after the next backoff, on this connection; the delay."""
        delay = self._redeclare.next()
        generation = self._generation
        self._redeclare_timer = self.publisher.call_later(
            delay, lambda: self._declare_again(generation)
        )
        return delay

    def _declare_again(self, generation: int) -> None:
        """I/O loop: the backoff is over; declare again, claims going on meanwhile."""
        self._redeclare_timer = None
        if generation == self._generation:
            self._start_declaring()

    def _report_mismatches(self, mismatched: dict[str, str]) -> None:
        for name, what in sorted(mismatched.items()):
            log = logger.debug if name in self._reported else logger.error
            log("relay: %s It is used as it is (and bound); the relay goes on sending", what)
            self._reported.add(name)
        drift = (
            "declared with other arguments than these settings ask for (see the relay's log "
            f"and messaging_status --broker): {', '.join(sorted(mismatched))}"
        )
        self.health.note(DRIFT_NOTE, drift if mismatched else None)

    def _waited(self, generation: int) -> None:
        """I/O loop: the declaration takes longer than DECLARE_WAIT: send without it."""
        if generation != self._generation or self._declared:
            return
        self._timer = None
        logger.warning(
            "relay: declaring the consumers' queues takes more than %gs; sending meanwhile",
            DECLARE_WAIT,
        )
        self.health.note(UNDECLARED_NOTE, "consumers' queues: declaration still under way")
        self._done()

    def _done(self) -> None:
        if self._declared:
            return  # declared again, or sending already: nothing waits for it
        self._declared = True
        self.publisher.cancel(self._timer)
        self._timer = None
        then, self._then = self._then, None
        if then is not None:
            then()
