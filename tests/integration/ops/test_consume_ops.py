"""``manage.py consume --metrics-port``: its counters and its health, as a real process.

The second test stops the broker (restored in a ``finally``): run it alone.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.integration.publishing.conftest import ensure_broker_running
from tests.support import Publisher, rabbitmqctl, wait_until

from .conftest import http_json, scraped

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_consumer_metrics_count_what_it_did(ns: str, consume: Any, publisher: Publisher) -> None:
    proc = consume("--queue", f"{ns}.alpha", "--metrics-port", "0").wait_consuming()
    port = proc.ops_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    for n in range(5):
        publisher.publish(f"rmtest.{ns}", "order.placed", {"n": n}, message_id=f"ops-{n}")
    publisher.publish(f"rmtest.{ns}", "order.placed", {"n": 0}, message_id="ops-0")
    total = "reliable_messaging_consumer_messages_total"

    def counted(outcome: str) -> float | None:
        return scraped(metrics_url, total, consumer="tests.alpha", outcome=outcome)

    wait_until(
        lambda: counted("processed") == 5 and counted("duplicate") == 1,
        timeout=30,
        message=lambda: f"5 processed and 1 duplicate on /metrics; log:\n{proc.log()}",
    )
    received = "reliable_messaging_consumer_received_total"
    assert scraped(metrics_url, received, consumer="tests.alpha") == 6
    assert scraped(metrics_url, "reliable_messaging_healthy") == 1
    assert http_json(f"http://127.0.0.1:{port}/healthz") == (200, {"status": "ok"})
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.log()


def test_consumer_healthz_fails_while_the_broker_is_stopped(ns: str, consume: Any) -> None:
    proc = consume("--queue", f"{ns}.alpha", "--metrics-port", "0").wait_consuming()
    healthz = f"http://127.0.0.1:{proc.ops_port()}/healthz"
    wait_until(lambda: http_json(healthz)[0] == 200, timeout=30, message="/healthz ok")
    try:
        rabbitmqctl("stop_app")
        # The handlers' connection and the relay beside them (retry copies) both say so.
        down = ["broker not connected", "the relay beside the handlers: broker not connected"]
        wait_until(
            lambda: http_json(healthz) == (503, {"status": "unhealthy", "reasons": down}),
            timeout=60,
            interval=0.2,
            message=lambda: f"/healthz 503 (now {http_json(healthz)}); log:\n{proc.log()}",
        )
        assert proc.returncode is None, proc.log()
    finally:
        ensure_broker_running()
    wait_until(
        lambda: http_json(healthz) == (200, {"status": "ok"}),
        timeout=60,
        interval=0.2,
        message=lambda: f"/healthz ok again; log:\n{proc.log()}",
    )


def test_every_consumer_series_exists_from_the_start() -> None:
    from prometheus_client import REGISTRY

    from reliable_messaging.metrics import CONSUMER_OUTCOMES, consumers_started

    consumers_started(["tests.series-from-start"])
    for outcome in CONSUMER_OUTCOMES:
        value = REGISTRY.get_sample_value(
            "reliable_messaging_consumer_messages_total",
            {"consumer": "tests.series-from-start", "outcome": outcome},
        )
        assert value == 0.0, outcome
