"""``manage.py relay``: publish the outbox with publisher confirms."""

from __future__ import annotations

import logging
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_messaging.broker.inspection import log_body_limit_in_background
from reliable_messaging.core import announcements
from reliable_messaging.core.liveness import HealthCheck, HealthGroup, HealthState
from reliable_messaging.core.registry import registry
from reliable_messaging.dead_letters.operation_process import OperationProcess
from reliable_messaging.dead_letters.operations import run_pending_operations
from reliable_messaging.management import long_running
from reliable_messaging.management.relay_beside import outbox_upkeep
from reliable_messaging.publishing.claims import CLAIM_BYTES
from reliable_messaging.publishing.lanes import RelayProgress, run_lanes
from reliable_messaging.publishing.listener import NOTIFY_CHANNEL
from reliable_messaging.publishing.relay import BATCH_SIZE, build_relay

logger = logging.getLogger("reliable_messaging.relay")


class Command(BaseCommand):
    help = (
        "Publish committed outbox rows to RabbitMQ with publisher confirms. Runs until "
        "SIGTERM/SIGINT (batches in flight are finished first), or with --once until "
        "nothing is due."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="send what is due, then exit (non-zero if rows are left failed or failing)",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            metavar="N",
            help=f"rows claimed and published per batch (default {BATCH_SIZE:,}; fewer past "
            f"{CLAIM_BYTES // 2**20} MiB of bodies)",
        )
        parser.add_argument(
            "--lanes",
            type=int,
            default=1,
            metavar="N",
            help="relays running side by side in this process, each with its own connections: "
            "more throughput on a backlog, at some latency cost (default 1)",
        )
        parser.add_argument(
            "--operation-batch-size",
            type=int,
            default=1000,
            metavar="N",
            help="dead letters replayed or discarded per transaction when carrying out the "
            "bulk operations recorded in the admin; 0 leaves them to another relay (default "
            "1000)",
        )
        long_running.add_metrics_arguments(parser)
        parser.add_argument(
            "--progress-interval",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="log a line with rows sent, the rate and rows pending this often while "
            "there is something to report; 0 turns it off (default 10)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        if options["lanes"] < 1:
            raise CommandError("--lanes must be at least 1")
        if options["progress_interval"] < 0:
            raise CommandError("--progress-interval must not be negative")
        if options["operation_batch_size"] < 0:
            raise CommandError("--operation-batch-size must not be negative")
        long_running.keep_database_alive()
        announcements.quiet_pika_info()
        # Each lane declares every registered consumer's queues before it sends.
        relays = [
            build_relay(
                batch_size=options["batch_size"],
                once=options["once"],
                health=HealthState(),
                consumers=registry.all(),
            )
            for _ in range(options["lanes"])
        ]

        def on_signal(received: signal.Signals) -> None:
            announcements.announce(
                logger,
                "received %s: finishing the batches in flight, then exiting",
                received.name,
            )
            for relay in relays:
                relay.request_stop()

        health: HealthCheck = relays[0].health
        if len(relays) > 1:
            health = HealthGroup({f"lane {n}": r.health for n, r in enumerate(relays, 1)})
        with long_running.serving(self, options, health, on_signal):
            progress = None
            if options["progress_interval"] > 0:
                progress = RelayProgress(relays, options["progress_interval"])
                progress.start()
            upkeep = outbox_upkeep(relays[0])
            upkeep.start()
            # A broker max_message_size under MAX_BODY_BYTES is said once, at ERROR.
            log_body_limit_in_background(relays[0].settings)
            # The admin's bulk replays and discards, in a process of their own that wakes the lanes.
            operations = None
            if options["operation_batch_size"]:
                if options["once"]:  # before the lanes start: they find the replays due
                    run_pending_operations(options["operation_batch_size"])
                else:
                    operations = OperationProcess(
                        batch_size=options["operation_batch_size"], notify_channel=NOTIFY_CHANNEL
                    )
                    operations.start()
            announcements.announce(
                logger,
                "relay: sending the outbox of database %r to %s (%d lane(s), batches of up to "
                "%d%s)",
                relays[0].using,
                relays[0].settings.broker_shown,
                len(relays),
                relays[0].batch_size,
                ", until nothing is due" if options["once"] else "",
            )
            try:
                report = run_lanes(relays)
            finally:
                if operations is not None:
                    operations.stop()
                upkeep.stop()
                if progress is not None:
                    progress.stop()
        self.stdout.write(f"relay: {report.summary()}")
        if options["once"] and (report.left_failed or report.left_retrying):
            raise CommandError(
                f"{report.left_failed} outbox row(s) are marked failed and "
                f"{report.left_retrying} are pending after failed sends; see the outbox admin "
                f"(status and last error) for why. Failed rows go again after the admin's retry "
                f"action.",
                returncode=1,
            )
