"""The circuit breaker where it meets other features, with real ``consume`` processes.

- An ordered consumer with a breaker and a standby process: the partition's order holds
  whatever the breaker does (it never cancels a partition, which would hand it to the standby).
- Half-open on a quorum queue with a delivery limit, and on a classic queue: a delivery the
  breaker does not let in is kept, never given back, so it spends no delivery count and makes no
  redelivery loop.

The provider is the payment provider of ``test_breaker.py`` (an HTTP server the test stops and
starts); ``tests.ordered_payments`` calls it too (tests/testapp/consumers.py).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.models import DeadLetter
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess, Publisher, all_queue_counts, queue_counts, wait_until
from tests.testapp.models import Effect

from .conftest import Provider
from .test_breaker import CONSUMER, metric, payments_done

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

ORDERED = "tests.ordered_payments"


def opened(*processes: ConsumeProcess, consumer: str = CONSUMER) -> int:
    return sum(p.log().count(f"circuit breaker of consumer={consumer} opened") for p in processes)


def order_by_key() -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = collections.defaultdict(list)
    for effect in Effect.objects.filter(consumer="opayments").order_by("id"):
        payload: dict[str, Any] = effect.payload or {}
        seqs[payload["key"]].append(payload["seq"])
    return seqs


def test_an_ordered_consumer_keeps_each_keys_order_when_its_breaker_opens_beside_a_standby(
    ns: str, transactional_db: None, tmp_path: Path, provider: Provider, publisher: Publisher
) -> None:
    """Two processes consume the ordered payments: one active per partition, one standing by.
    The provider goes down while a key's head retries in place; the breaker opens and half-opens
    several times. Once the provider is back, every key's payments took effect once each, in
    publish order, and none became a dead letter."""
    exchange = f"rmtest.{ns}"
    env = subprocess_env(ns, RM_TEST_DOWNSTREAM_URL=provider.url)
    args = ["--queue", f"{ns}.opayments", "--concurrency", "2"]
    first = ConsumeProcess(args, env, tmp_path / "consume-1.log")
    second: ConsumeProcess | None = None
    keys = ["k1", "k2", "k3"]
    per_key = 10
    try:
        first.wait_consuming()
        second = ConsumeProcess(args, env, tmp_path / "consume-2.log").wait_consuming()
        provider.stop()
        for seq in range(per_key):
            for key in keys:
                publisher.publish(
                    exchange,
                    "opay.due",
                    {"key": key, "seq": seq},
                    message_id=f"{key}-{seq}",
                    headers={ORDERING_KEY_HEADER: key},
                )
        wait_until(
            lambda: opened(first, second, consumer=ORDERED) >= 3,
            timeout=60,
            message="the breaker opening, half-opening and opening again",
        )
        provider.start()
        wait_until(
            lambda: Effect.objects.filter(consumer="opayments").count() >= per_key * len(keys),
            timeout=90,
            message=lambda: f"every payment handled; so far {dict(order_by_key())}",
        )
        wait_until(
            lambda: (
                not any(
                    sum(counts)
                    for queue, counts in all_queue_counts().items()
                    if queue.startswith(f"{ns}.opayments.p")
                )
            ),
            timeout=30,
            message="the partitions drained",
        )
        assert order_by_key() == {key: list(range(per_key)) for key in keys}
        assert not DeadLetter.objects.exists()
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_half_open_keeps_what_it_does_not_run_spending_no_delivery_count(
    ns: str,
    transactional_db: None,
    tmp_path: Path,
    provider: Provider,
    publisher: Publisher,
    queue_type: str,
) -> None:
    """The provider goes down, the breaker opens; the provider comes back answering one call
    fast and the next slowly, so one probe ends while the other runs. Every payment is handled
    once, none reaches the quorum queue's delivery limit (20 here, RabbitMQ 4's default), and
    the process received each payment a bounded number of times: no redelivery loop."""
    exchange = f"rmtest.{ns}"
    env = subprocess_env(
        ns,
        RM_TEST_DOWNSTREAM_URL=provider.url,
        RM_TEST_QUEUE_TYPE=queue_type,
        RM_TEST_QUORUM_DELIVERY_LIMIT="20",
    )
    args = ["--queue", f"{ns}.payments", "--concurrency", "3", "--metrics-port", "0"]
    proc = ConsumeProcess(args, env, tmp_path / "consume.log")
    payments = [f"pay-{n}" for n in range(8)]
    try:
        proc.wait_consuming()
        metrics_port = proc.ops_port()
        provider.stop()
        for message_id in payments:
            publisher.publish(exchange, "payment.due", {"id": message_id}, message_id=message_id)
        wait_until(lambda: opened(proc) >= 2, timeout=60, message="the breaker opening twice")
        provider.delays = [0.0, 1.5]
        provider.start()
        wait_until(
            lambda: payments_done() >= len(payments),
            timeout=90,
            message=lambda: f"every payment handled; log:\n{proc.log()[-3000:]}",
        )
        wait_until(lambda: queue_counts(f"{ns}.payments") == (0, 0), timeout=30)
        assert not DeadLetter.objects.exists(), list(DeadLetter.objects.values("reason"))
        for message_id in payments:
            assert Effect.objects.filter(consumer="payments", message_id=message_id).count() == 1
        log = proc.log()
        retries = len(re.findall(rf"retrying message_id=\S+ consumer={CONSUMER} ", log))
        received = metric(metrics_port, "reliable_messaging_consumer_received_total")
        # Each payment once at first, once per retry copy: nothing given back and taken again.
        assert received is not None and received <= len(payments) + retries, (received, retries)
    finally:
        proc.close()
