"""Several relays side by side in one process (``relay --lanes``), and their progress lines;
``SKIP LOCKED`` and the claim rule share the rows out, with no coordination."""

from __future__ import annotations

import logging
import threading
import time

from django.db import DatabaseError, connections

from ..core.announcements import announce
from ..models import OutboxMessage
from .relay import OutboxRelay, RelayReport

logger = logging.getLogger("reliable_messaging.relay")


def run_lanes(relays: list[OutboxRelay]) -> RelayReport:
    """Run the first relay on this thread (signals arrive here), the others on their own."""
    reports: list[RelayReport] = []

    def lane(relay: OutboxRelay) -> None:
        try:
            reports.append(relay.run())
        finally:
            connections.close_all()  # this thread's connections

    threads = [threading.Thread(target=lane, args=(r,), name="relay-lane") for r in relays[1:]]
    for thread in threads:
        thread.start()
    main = relays[0].run()
    if not relays[0].once:
        # The main lane stops only when told to: the others follow.
        for relay in relays[1:]:
            relay.request_stop()
    for thread in threads:
        thread.join()
    total = RelayReport()
    for report in [main, *reports]:
        total.add(report)
    total.count_left(relays[0].using)
    return total


class RelayProgress:
    """Logs a progress line every ``interval`` seconds while relays run, on its own thread."""

    def __init__(self, relays: list[OutboxRelay], interval: float) -> None:
        self.relays = relays
        self.interval = interval
        self.using = relays[0].using
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rm-relay-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        last_sent, last_time = 0, time.monotonic()
        try:
            while not self._stop.wait(self.interval):
                sent, now = sum(r.report.sent for r in self.relays), time.monotonic()
                pending = self._pending()
                if sent != last_sent or pending != 0:
                    announce(
                        logger,
                        "relay: %d sent so far, %.1f/s over the last %.0fs, %s pending",
                        sent,
                        (sent - last_sent) / max(now - last_time, 1e-9),
                        now - last_time,
                        "an unknown number of rows (database unavailable)"
                        if pending is None
                        else pending,
                    )
                last_sent, last_time = sent, now
        finally:
            connections.close_all()  # this thread's connections

    def _pending(self) -> int | None:
        try:
            return OutboxMessage.objects.using(self.using).pending().count()
        except DatabaseError:
            connections[self.using].close()
            return None
