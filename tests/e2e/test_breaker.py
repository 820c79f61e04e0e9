"""The circuit breaker in a real ``manage.py consume``: a payment provider goes down and comes back.

``tests.payments`` (tests/testapp/consumers.py, registered when ``RM_TEST_DOWNSTREAM_URL`` is set)
calls a local HTTP server run by the test in a thread; its breaker is small (window 10, 4
failures, a pause of 1s, 2 probes). The test stops the server, watches the breaker open without
spending the attempts of the waiting messages while the process keeps handling ``<ns>.alpha``,
starts the server again, and checks that every payment is handled once, none dead-lettered.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from django.db.models import Sum

from reliable_messaging.models import DeadLetter
from tests.conftest import subprocess_env
from tests.e2e.conftest import Provider
from tests.integration.ops.conftest import http_get
from tests.support import ConsumeProcess, Publisher, queue_counts, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

CONSUMER = "tests.payments"


def metric(port: int, name: str, consumer: str = CONSUMER) -> float | None:
    _, _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    found = re.search(rf'^{name}\{{consumer="{consumer}"\}} (\S+)$', body.decode(), re.M)
    return float(found.group(1)) if found else None


def payments_done() -> int:
    return Effect.objects.filter(consumer="payments").count()


def charged_attempts() -> int:
    """Failed attempts the payments were charged, from the handled messages: each failure
    raised the attempt of the copy that finally succeeded by one."""
    total = Effect.objects.filter(consumer="payments").aggregate(n=Sum("attempt"))["n"] or 0
    return int(total) - payments_done()


def test_a_downstream_outage_opens_the_breaker_spends_no_attempts_and_drains_after(
    ns: str, transactional_db: None, tmp_path: Path, provider: Provider, publisher: Publisher
) -> None:
    exchange = f"rmtest.{ns}"
    queues = ["--queue", f"{ns}.payments", "--queue", f"{ns}.alpha"]
    proc = ConsumeProcess(
        [*queues, "--metrics-port", "0"],
        subprocess_env(ns, RM_TEST_DOWNSTREAM_URL=provider.url),
        tmp_path / "consume.log",
    )
    try:
        proc.wait_consuming()
        metrics_port = proc.ops_port()
        for n in range(3):
            publisher.publish(exchange, "payment.due", {"n": n}, message_id=f"before-{n}")
        wait_until(lambda: payments_done() == 3, timeout=30, message="three payments before")
        assert metric(metrics_port, "reliable_messaging_breaker_state") == 0

        # The provider goes down; payments keep coming.
        provider.stop()
        outage = [f"during-{n}" for n in range(30)]
        for message_id in outage:
            publisher.publish(exchange, "payment.due", {"id": message_id}, message_id=message_id)
        proc.wait_for_log(f"circuit breaker of consumer={CONSUMER} opened", timeout=30)
        opened_lines = [line for line in proc.log().splitlines() if "opened:" in line]
        assert "WARNING" in opened_lines[0] and "for 1s" in opened_lines[0]
        # The window holds the three payments before: 4 failures of 7.
        assert "4 of the last 7 deliveries failed" in opened_lines[0]
        assert (metric(metrics_port, "reliable_messaging_breaker_opened_total") or 0) >= 1
        assert metric(metrics_port, "reliable_messaging_breaker_state") in (1, 2)
        status, _, body = http_get(f"http://127.0.0.1:{metrics_port}/healthz")
        health = json.loads(body)
        assert status == 200, health  # a note, not a sick process
        assert any(CONSUMER in note for note in health.get("notes", [])), health

        # The other queue of the process goes on meanwhile.
        for n in range(5):
            publisher.publish(exchange, "order.placed", {"n": n}, message_id=f"alpha-{n}")
        wait_until(
            lambda: Effect.objects.filter(consumer="alpha").count() == 5,
            timeout=30,
            message="alpha handled while the payments are paused",
        )
        # A few half-open rounds against the provider still down: each spends the attempts of
        # its probes only (2), not those of the 30 waiting payments.
        wait_until(
            lambda: proc.log().count(f"circuit breaker of consumer={CONSUMER} opened") >= 3,
            timeout=30,
            message="the breaker opening again after failed probes",
        )
        assert not DeadLetter.objects.exists()

        provider.start()
        proc.wait_for_log(f"circuit breaker of consumer={CONSUMER} closed", timeout=30)
        wait_until(lambda: payments_done() == 33, timeout=60, message="every payment handled")
        wait_until(lambda: queue_counts(f"{ns}.payments") == (0, 0), timeout=30)

        log = proc.log()
        opens = log.count(f"circuit breaker of consumer={CONSUMER} opened")
        retries = len(re.findall(rf"retrying message_id=\S+ consumer={CONSUMER} ", log))
        # 4 failures open it; every later opening is one half-open round of 2 probes, of which
        # the first failure reopens it (the second may be decided in the same batch).
        assert retries <= 4 + 2 * (opens - 1), log
        assert charged_attempts() == retries
        # While open the process kept the payments it held, unstarted, and took no more (its
        # prefetch window full): each payment came at most twice, besides the retry copies.
        # Given back and taken again in a loop, they would come thousands of times.
        received = metric(metrics_port, "reliable_messaging_consumer_received_total")
        assert received is not None and received <= 3 + 2 * 30 + retries + 2 * opens, received
        assert not DeadLetter.objects.exists()
        assert provider.calls == 33  # each payment charged once at the provider
        for message_id in [f"before-{n}" for n in range(3)] + outage:
            assert Effect.objects.filter(consumer="payments", message_id=message_id).count() == 1
        # Most payments waited the outage out without a failed attempt.
        assert Effect.objects.filter(consumer="payments", attempt=1).count() >= 33 - retries
        assert metric(metrics_port, "reliable_messaging_breaker_state") == 0
        status, _, body = http_get(f"http://127.0.0.1:{metrics_port}/healthz")
        assert status == 200 and "notes" not in json.loads(body)
        # One line per transition, never one per delivery.
        assert log.count(f"circuit breaker of consumer={CONSUMER} closed") == 1

        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.close()
