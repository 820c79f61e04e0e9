"""``--metrics-port`` and ``--metrics-host``, shared by ``consume`` and ``relay``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from reliable_messaging.core.liveness import HealthCheck
from reliable_messaging.ops.http import OpsServer, start_ops_server


def add_metrics_arguments(parser: CommandParser, health: str) -> None:
    """Add the two options; ``health`` says what makes this process's /healthz fail."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"serve Prometheus metrics on /metrics and the process's health on /healthz "
        f"(200, or 503 with the reasons: {health}) on this port; 0 picks a free one (logged)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",  # noqa: S104 - scraped and probed from other hosts or pods
        metavar="HOST",
        help="address --metrics-port listens on (default 0.0.0.0)",
    )


def serve_metrics(options: dict[str, Any], health: HealthCheck) -> OpsServer | None:
    """Start the /metrics and /healthz server the options ask for, if any; a port that cannot
    be bound is a command error, not a traceback."""
    port, host = options["metrics_port"], options["metrics_host"]
    if port is None:
        return None
    try:
        return start_ops_server(port, health, host=host)
    except OSError as exc:
        raise CommandError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
