"""``manage.py run_demo``: the shop end to end; see :mod:`demo_project.shop.scenario`."""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import pika.exceptions
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import OperationalError

from demo_project.shop.scenario import DemoError, run_demo


class Command(BaseCommand):
    help = (
        "Place orders, inject duplicates, transient and permanent failures, run relay and "
        "consume, and print a summary of what happened. Exits non-zero if a guarantee broke."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--timeout",
            type=float,
            default=120.0,
            metavar="S",
            help="give up waiting for the final state after S seconds (default 120)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        def say(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()  # progress must show while the workers run, even when piped

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            # Unwind like Ctrl-C does, so the relay and consume children are stopped too
            # (they run in their own session and would otherwise outlive the demo).
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            ok = run_demo(say, timeout=options["timeout"])
        except DemoError as exc:
            raise CommandError(str(exc)) from exc
        except OperationalError as exc:
            raise CommandError(
                f"database error: {exc}. If the server is down, `make services` starts it; "
                f"otherwise check DATABASE_URL"
            ) from exc
        except pika.exceptions.AMQPConnectionError as exc:
            raise CommandError(
                f"RabbitMQ is unreachable ({exc!r}); `make services` starts it"
            ) from exc
        except KeyboardInterrupt:
            raise CommandError(
                "interrupted; relay and consume were stopped", returncode=130
            ) from None
        if not ok:
            raise CommandError("the demo found problems (see above)", returncode=1)
