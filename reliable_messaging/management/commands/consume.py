"""``manage.py consume``: run the registered handlers until stopped."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_messaging.broker.inspection import log_findings_in_background
from reliable_messaging.consuming.service import PROGRESS_EVERY, ConsumerService
from reliable_messaging.core import announcements
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.registry import registry
from reliable_messaging.management import long_running
from reliable_messaging.management.relay_beside import RelayBeside, wake_relays_on_retry

logger = logging.getLogger("reliable_messaging.consume")


class Command(BaseCommand):
    help = (
        "Consume the registered handlers' queues with exactly-once effects. SIGTERM/SIGINT "
        "stop gracefully (a second signal exits at once)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="Q",
            help="consume only this queue (repeatable); default: all handlers",
        )
        parser.add_argument(
            "--concurrency",
            type=int,
            default=1,
            metavar="N",
            help="handler threads, each with its own database connection",
        )
        parser.add_argument(
            "--idle-timeout",
            type=float,
            default=None,
            metavar="S",
            help="exit 0 after S seconds without a delivery",
        )
        parser.add_argument(
            "--progress-interval",
            type=float,
            default=PROGRESS_EVERY,
            metavar="S",
            help="a line with the outcomes so far every S seconds while there are any "
            "(default %(default)g; 0: none)",
        )
        parser.add_argument(
            "--no-relay",
            action="store_false",
            dest="relay",
            help="do not run a relay beside the handlers (by default one sends the outbox's due "
            "rows, retry copies included, so that consumers alone still retry)",
        )
        long_running.add_metrics_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        specs = registry.all()
        if not specs:
            raise CommandError(
                "No consumers are registered. Define handlers with @consumer in "
                "a consumers.py module of an installed app."
            )
        wanted = options["queues"]
        if wanted:
            known = {s.queue for s in specs}
            if unknown := sorted(set(wanted) - known):
                raise CommandError(
                    f"Unknown queue(s): {', '.join(unknown)}. Registered queues: "
                    f"{', '.join(sorted(known))}."
                )
            specs = [s for s in specs if s.queue in wanted]
        if options["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1")
        if options["idle_timeout"] is not None and options["idle_timeout"] <= 0:
            raise CommandError("--idle-timeout must be a positive number of seconds")
        if options["progress_interval"] < 0:
            raise CommandError("--progress-interval must not be negative")
        announcements.quiet_pika_info()

        long_running.keep_database_alive()
        health = HealthState()
        service = ConsumerService(
            specs,
            concurrency=options["concurrency"],
            idle_timeout=options["idle_timeout"],
            health=health,
            progress_interval=options["progress_interval"],
            on_outcome=wake_relays_on_retry,
        )

        def on_signal(received: signal.Signals) -> None:
            if service.stopping:
                # Second signal: leave now. Uncommitted work rolls back when the database
                # connection drops and unacked deliveries go back to their queues.
                os._exit(128 + received)
            announcements.announce(
                logger,
                "received %s: finishing the handlers in flight, then exiting "
                "(send it again to exit at once)",
                received.name,
            )
            service.request_stop()

        with long_running.serving(self, options, health, on_signal):
            # What in the broker would drop or redeliver messages behind our back, logged once
            # at WARNING; it runs beside the service and never holds it up.
            log_findings_in_background(specs)
            # Retry copies wait in the outbox: a relay sends them, this one if no other runs.
            relay = RelayBeside() if options["relay"] else None
            if relay is not None:
                health.add_problem_source(relay.problems)
                health.add_note_source(relay.notes)
                relay.start()
            try:
                code = service.run()
            finally:
                if relay is not None:
                    relay.stop()
        if code:
            raise CommandError(f"consume stopped with exit code {code}", returncode=code)
