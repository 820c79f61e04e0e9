"""What the long-running ``consume`` and ``relay`` share: TCP keepalives on the database
connections, the metrics server, stop signals, announcements on the command's output."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from reliable_messaging.core import announcements
from reliable_messaging.core.liveness import HealthCheck
from reliable_messaging.ops.http import start_ops_server

# libpq parameters: a dead database host is given up on in about a minute, not TCP's 15 (the
# server's side: docs/cluster.md); tcp_user_timeout bounds data never acknowledged (ms).
KEEPALIVE_OPTIONS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}


def keep_database_alive() -> list[str]:
    """Add :data:`KEEPALIVE_OPTIONS` to PostgreSQL databases' ``OPTIONS`` (a value there wins)."""
    changed = []
    for alias in connections:
        settings_dict = connections.settings[alias]
        if "postgresql" not in str(settings_dict.get("ENGINE", "")):
            continue
        options = settings_dict.setdefault("OPTIONS", {})
        if options.get("pool"):
            continue  # a pool's connections take their own kwargs: the project sets them there
        for key, value in KEEPALIVE_OPTIONS.items():
            options.setdefault(key, value)
        # A connection the system checks opened has not got them: the next one will.
        connections[alias].close()
        changed.append(alias)
    return changed


def add_metrics_arguments(parser: CommandParser) -> None:
    """``--metrics-port`` and ``--metrics-host``, read by :func:`serving`."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on /metrics and the process's health on /healthz (200, "
        "or 503 with the reasons: broker or database lost, loop stuck) on this port; 0 picks "
        "a free one (logged)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104 - scraped and probed from other hosts or pods
        metavar="HOST",
        help="address --metrics-port listens on (default 0.0.0.0)",
    )


@contextlib.contextmanager
def serving(
    command: BaseCommand,
    options: dict[str, Any],
    health: HealthCheck,
    on_signal: Callable[[signal.Signals], None],
) -> Iterator[None]:
    """For the block: the metrics server the options ask for (a port that cannot be bound is a
    command error), ``on_signal`` on SIGTERM and SIGINT, announcements on the command's output."""
    port, host = options["metrics_port"], options["metrics_host"]
    ops = None
    if port is not None:
        try:
            ops = start_ops_server(port, health, host=host)
        except OSError as exc:
            raise CommandError(f"cannot serve metrics on {host}:{port}: {exc}") from exc

    def handler(signum: int, frame: FrameType | None) -> None:
        on_signal(signal.Signals(signum))

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    announcements.attach(command.stdout.write)
    try:
        yield
    finally:
        if ops is not None:
            ops.close()
        announcements.detach()
