"""The ``/metrics`` and ``/healthz`` server of ``consume`` and ``relay`` (``--metrics-port``),
on a daemon thread; anything else is a 404."""

from __future__ import annotations

import json
import logging
import threading
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from ..core.liveness import HealthCheck
from ..metrics import HealthCollector
from .status import process_health

logger = logging.getLogger(__name__)

# Seconds a connection may keep a server thread waiting for a request or a read; a scraper
# or probe sends its request at once.
IDLE_TIMEOUT = 5.0


class _OpsHandler(MetricsHandler):
    health: HealthCheck
    timeout = IDLE_TIMEOUT  # else a client gone without closing holds its thread for ever

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            super().do_GET()
        elif path == "/healthz":
            report = process_health(self.health)
            self._send_json(report.http_status, report.as_dict())
        else:
            self._send_json(404, {"error": "not found; try /metrics or /healthz"})

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("ops http %s: " + format, self.address_string(), *args)


class OpsServer:
    """A running ops server; :meth:`close` stops it and frees the port."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host = str(server.server_address[0])
        self.port = int(server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_ops_server(
    port: int,
    health: HealthCheck,
    host: str = "0.0.0.0",  # noqa: S104 - scraped and probed from other hosts or pods
    registry: Collector = REGISTRY,
) -> OpsServer:
    """Serve ``/metrics`` and ``/healthz`` on ``host:port``; port 0 picks a free port."""
    # A registry has no describe(): it joins whole, its names clashing with none of the health's.
    served = CollectorRegistry(auto_describe=False)
    served.register(registry)
    served.register(HealthCollector(health))
    handler = type("OpsHandler", (_OpsHandler,), {"registry": served, "health": health})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="rm-ops-http", daemon=True
    )
    thread.start()
    ops = OpsServer(server, thread)
    logger.info("serving /metrics and /healthz on http://%s:%d", ops.host, ops.port)
    return ops
