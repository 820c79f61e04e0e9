"""The relay ``consume`` runs beside its handlers, so that consumers alone still send their
retry copies (``docs/design.md#where-a-retry-waits``)."""

from __future__ import annotations

import logging
import threading

from django.db import connections, router

from ..core.envelope import Delivery
from ..core.liveness import HealthState
from ..core.outcomes import Outcome, ScheduleRetry
from ..core.registry import ConsumerSpec
from ..models import OutboxMessage
from ..publishing.relay import OutboxRelay, build_relay
from ..publishing.wake_after_commit import sender
from ..storage.partitions import OUTBOX, PartitionUpkeep

logger = logging.getLogger("reliable_messaging.consume")

# Seconds ``stop`` waits for the relay's batches in flight.
STOP_TIMEOUT = 10.0


class RelayBeside:
    """A relay on a daemon thread, started and stopped with the consumer."""

    def __init__(self) -> None:
        self.relay: OutboxRelay = build_relay(health=HealthState())
        self._upkeep = outbox_upkeep(self.relay)
        self._thread = threading.Thread(target=self._run, name="rm-relay", daemon=True)

    def start(self) -> None:
        self._upkeep.start()
        self._thread.start()

    def problems(self) -> list[str]:
        """Why the relay is not doing its work now (empty when it is), for consume's /healthz."""
        if self.relay.stopping():
            return []
        if self._thread.ident is not None and not self._thread.is_alive():
            return ["the relay beside the handlers stopped: the outbox waits for another relay"]
        healthy, reasons = self.relay.health.check()
        return [] if healthy else [f"the relay beside the handlers: {r}" for r in reasons]

    def notes(self) -> list[str]:
        """What the relay notes without failing (a broker alarm, say), for consume's /healthz."""
        return [f"the relay beside the handlers: {note}" for note in self.relay.health.notes()]

    def stop(self) -> None:
        """Finish the batches in flight (rows not confirmed by then are sent again later)."""
        self.relay.request_stop()
        self._thread.join(STOP_TIMEOUT)
        self._upkeep.stop()

    def _run(self) -> None:
        try:
            self.relay.run()
        except Exception:
            logger.exception("the relay beside the consumer stopped; the outbox waits for another")
        finally:
            connections.close_all()  # this thread's connections


def outbox_upkeep(relay: OutboxRelay) -> PartitionUpkeep:
    """The upkeep of the outbox's day partitions (PostgreSQL), failing ``relay``'s health."""
    return PartitionUpkeep(
        router.db_for_write(OutboxMessage),
        spec=OUTBOX,
        retention=relay.settings.outbox_retention,
        health=relay.health,
    )


def wake_relays_on_retry(spec: ConsumerSpec, delivery: Delivery, outcome: Outcome) -> None:
    """The consumer's ``on_outcome``: wake the relays after a retry copy's commit."""
    if isinstance(outcome, ScheduleRetry):
        sender.request(router.db_for_write(OutboxMessage))
