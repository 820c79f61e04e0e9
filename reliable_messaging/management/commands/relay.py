"""``manage.py relay``: publish the outbox with publisher confirms."""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_messaging.relay import OutboxRelay

logger = logging.getLogger("reliable_messaging.relay")


class Command(BaseCommand):
    help = (
        "Publish committed outbox rows to RabbitMQ with publisher confirms. Runs until "
        "SIGTERM/SIGINT (the batch in flight is finished first), or with --once until "
        "nothing is pending."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="drain what is pending, then exit (non-zero if rows are left failed)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            metavar="N",
            help="rows claimed and published per batch (RELAY_BATCH_SIZE)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        relay = OutboxRelay(batch_size=options["batch_size"], once=options["once"])

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info(
                "received %s: finishing the batch in flight, then exiting",
                signal.Signals(signum).name,
            )
            relay.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        report = relay.run()
        self.stdout.write(f"relay: {report.summary()}")
        if options["once"] and (report.left_failed or report.left_retrying):
            raise CommandError(
                f"{report.left_failed} outbox row(s) are marked failed and "
                f"{report.left_retrying} are pending after failed sends; see the outbox admin "
                f"(status and last error) for why. Failed rows go again after the admin's retry "
                f"action.",
                returncode=1,
            )
