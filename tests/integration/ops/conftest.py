"""Fixtures and helpers of the operations tests (metrics, health, flow control).

The relay tests reuse the outbox suite's ``ob`` environment (a namespace, test queues, relay
subprocesses and threads, all cleaned up in teardown). Helpers here read metrics the way
Prometheus does: from the default registry in this process, or over HTTP from a subprocess.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

# The outbox suite's fixtures (and its hook attaching relay logs to failed reports).
from tests.integration.publishing.conftest import broker, ob, pytest_runtest_makereport  # noqa: F401


def sample(name: str, **labels: str) -> float:
    """The value of one sample in this process's default registry; 0 when it does not exist."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def free_port() -> int:
    """A TCP port nobody listens on right now (for a subprocess told to listen on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a GET, also for 4xx/5xx answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def http_json(url: str) -> tuple[int, Any]:
    status, _, body = http_get(url)
    return status, json.loads(body)


def parse_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """{(sample name, labels): value} of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scraped(url: str, name: str, **labels: str) -> float | None:
    """One sample's value from a /metrics endpoint, or None when the endpoint does not answer
    or does not have it."""
    try:
        status, _, body = http_get(url)
    except OSError:
        return None
    if status != 200:
        return None
    return parse_samples(body.decode()).get((name, frozenset(labels.items())))
