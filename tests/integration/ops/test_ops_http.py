"""The ops HTTP server of the long-running processes: /metrics, /healthz, nothing else."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from reliable_messaging import metrics
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.ops.http import IDLE_TIMEOUT, OpsServer, start_ops_server
from tests.support import wait_until

from .conftest import http_get, http_json, parse_samples


@pytest.fixture
def health() -> HealthState:
    return HealthState()


@pytest.fixture
def server(health: HealthState) -> Iterator[OpsServer]:
    ops = start_ops_server(0, health, host="127.0.0.1")
    yield ops
    ops.close()


def url(server: OpsServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def test_port_zero_picks_a_free_port(server: OpsServer) -> None:
    assert server.port > 0 and server.host == "127.0.0.1"


def test_metrics_serves_the_process_counters_and_the_health_gauge(
    server: OpsServer, health: HealthState
) -> None:
    metrics.relay_published(3)
    status, headers, body = http_get(url(server, "/metrics"))
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    samples = parse_samples(body.decode())
    assert samples[("reliable_messaging_relay_published_total", frozenset())] >= 3
    assert samples[("reliable_messaging_healthy", frozenset())] == 0

    health.set_broker(True)
    samples = parse_samples(http_get(url(server, "/metrics"))[2].decode())
    assert samples[("reliable_messaging_healthy", frozenset())] == 1


def test_metrics_speaks_openmetrics_and_gzip_when_asked(server: OpsServer) -> None:
    request = urllib.request.Request(
        url(server, "/metrics"),
        headers={"Accept": "application/openmetrics-text", "Accept-Encoding": "gzip"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(response.read()).decode()
    assert "reliable_messaging_healthy" in text
    assert text.rstrip().endswith("# EOF")


def test_healthz_answers_503_with_reasons_then_200(server: OpsServer, health: HealthState) -> None:
    health.set_database(False, "connection refused")
    status, body = http_json(url(server, "/healthz"))
    assert status == 503
    assert body == {
        "status": "unhealthy",
        "reasons": ["broker not connected", "database failing: connection refused"],
    }

    health.set_broker(True)
    health.set_database(True)
    assert http_json(url(server, "/healthz")) == (200, {"status": "ok"})


def test_other_paths_are_404_and_requests_are_not_logged_at_info(
    server: OpsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="reliable_messaging")
    status, _, body = http_get(url(server, "/admin/"))
    assert status == 404
    assert "/metrics" in json.loads(body)["error"]
    http_get(url(server, "/metrics"))
    assert "GET /" not in caplog.text


def test_close_frees_the_port(health: HealthState) -> None:
    ops = start_ops_server(0, health, host="127.0.0.1")
    port = ops.port
    ops.close()
    again = start_ops_server(port, health, host="127.0.0.1")
    try:
        assert again.port == port
    finally:
        again.close()


def serving_threads() -> int:
    """The ops server's threads of one connection each (``ThreadingHTTPServer`` names them
    after their target): other threads of the process come and go meanwhile."""
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def test_a_connection_that_never_sends_its_request_is_closed_and_leaves_no_thread(
    server: OpsServer,
) -> None:
    """A client gone without closing (a half-open connection, a probe that only connects)
    holds a server thread while its request line is awaited: each is let go after
    IDLE_TIMEOUT, so over weeks they never pile up; the others are served meanwhile."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    try:
        wait_until(
            lambda: serving_threads() == 20, timeout=10, message="a thread for each connection"
        )
        assert http_get(url(server, "/healthz"))[0] == 503  # served beside them
        started = time.monotonic()
        for connection in idle:
            connection.settimeout(IDLE_TIMEOUT + 10)
            assert connection.recv(1) == b""  # closed by the server
        assert time.monotonic() - started < IDLE_TIMEOUT + 5
        wait_until(
            lambda: serving_threads() == 0,
            timeout=10,
            message=lambda: f"their threads ended: {serving_threads()} left",
        )
    finally:
        for connection in idle:
            connection.close()
