"""A copy we publish again (a replay, a retry) reaches the failed consumer's queue and nothing
else, whatever the producer wrote into the message.

RabbitMQ's sender-selected distribution routes a message to every routing key of its ``CC`` and
``BCC`` headers too (case-sensitive names, read by rabbit_basic), also when it dead-letters it:
on the default exchange, where replays and retry copies go, each entry is a queue name. A
producer's ``CC`` kept on such a copy would copy it into any queue it names. Our own origin
headers (``x-rm-exchange``, ``x-rm-routing-key``) are only believed on a message that came the
way our copies come, never on one a producer routed through an exchange.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.core.envelope import ORIGINAL_EXCHANGE_HEADER, ORIGINAL_ROUTING_KEY_HEADER
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter
from tests.conftest import subprocess_env
from tests.support import MANAGE, ROOT, ConsumeProcess, Publisher, broker_connection, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def bystanders(ns: str) -> Iterator[dict[str, str]]:
    """Plain queues a producer names in its headers: none of them may receive a copy."""
    names = {
        header: f"rmtest.{ns}.named-in-{header.lower()}-{i}"
        for i, header in enumerate(("CC", "BCC", "cc", "Cc"))
    }
    connection = broker_connection()
    try:
        channel = connection.channel()
        for queue in names.values():
            channel.queue_declare(queue, durable=False)
        yield names
    finally:
        connection.close()


def ready(queue: str) -> list[tuple[Any, bytes]]:
    """Every message waiting in ``queue`` (taken off it)."""
    connection = broker_connection()
    try:
        channel = connection.channel()
        found: list[tuple[Any, bytes]] = []
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return found
            found.append((properties, body or b""))
    finally:
        connection.close()


def relay_once(ns: str) -> str:
    done = subprocess.run(
        [sys.executable, str(MANAGE), "relay", "--once", "--settings", "tests.settings"],
        cwd=ROOT,
        env=subprocess_env(ns),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_replay_reaches_the_consumers_queue_only(ns: str, bystanders: dict[str, str]) -> None:
    target = f"rmtest.{ns}.target"
    connection = broker_connection()
    try:
        connection.channel().queue_declare(target, durable=False)
    finally:
        connection.close()
    letter = DeadLetter.objects.create(
        message_id="cc-1",
        consumer="tests.alpha",
        queue=target,
        exchange=f"rmtest.{ns}",
        routing_key="order.placed",
        # As a producer sent it (a broker hands BCC to nobody, but a stored row may hold it).
        headers={header: [queue] for header, queue in bystanders.items()},
        body=b'{"n": 1}',
        payload={"n": 1},
        reason="retries_exhausted",
    )
    result = replay(DeadLetter.objects.filter(pk=letter.pk), replayed_by="tester")
    assert result.replayed == [letter.pk]
    assert "sent 1" in relay_once(ns)

    copies = ready(target)
    assert len(copies) == 1
    headers = copies[0][0].headers
    assert "CC" not in headers and "BCC" not in headers, headers
    # Names the broker does not read (it compares exactly) are the producer's data: kept.
    assert headers["cc"] == [bystanders["cc"]] and headers["Cc"] == [bystanders["Cc"]]
    assert {header: ready(queue) for header, queue in bystanders.items()} == {
        header: [] for header in bystanders
    }
    letter.refresh_from_db()
    assert letter.status == DeadLetterStatus.REPLAYED


def test_a_retry_copy_reaches_the_consumers_queue_only_and_forged_origins_are_ignored(
    ns: str, bystanders: dict[str, str], publisher: Publisher, tmp_path: Any
) -> None:
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha"], subprocess_env(ns), tmp_path / "consume.log"
    )
    try:
        consume.wait_consuming()
        named = {header: [queue] for header, queue in bystanders.items() if header != "BCC"}
        # Fails once, then succeeds: its retry copy goes from the outbox through the default
        # exchange, where the broker reads CC again.
        publisher.publish(
            f"rmtest.{ns}",
            "order.placed",
            {"fail": {"alpha": 1}},
            message_id="retry-cc",
            headers=named,
        )
        # Fails for good, claiming another origin than the exchange that routed it.
        publisher.publish(
            f"rmtest.{ns}",
            "order.placed",
            {"permanent": {"alpha": 1}},
            message_id="forged-origin",
            headers={
                ORIGINAL_EXCHANGE_HEADER: "billing",
                ORIGINAL_ROUTING_KEY_HEADER: "order.refunded",
            },
        )
        wait_until(
            lambda: (
                Effect.objects.filter(consumer="alpha", message_id="retry-cc", attempt=2).exists()
                and DeadLetter.objects.filter(message_id="forged-origin").exists()
            ),
            timeout=30,
            message=lambda: f"the retry processed and the dead letter written:\n{consume.log()}",
        )
    finally:
        consume.close()
    assert {header: ready(queue) for header, queue in bystanders.items()} == {
        header: [] for header in bystanders
    }
    letter = DeadLetter.objects.get(consumer="tests.alpha", message_id="forged-origin")
    # Where the broker says it came from, which a replay carries on.
    assert (letter.exchange, letter.routing_key, letter.queue) == (
        f"rmtest.{ns}",
        "order.placed",
        f"{ns}.alpha",
    )


def test_the_broker_reads_cc_case_sensitively(ns: str, bystanders: dict[str, str]) -> None:
    """What the tests above rely on: the broker routes by "CC" and "BCC" exactly, not by
    "cc" (so those are left to the producer), and it does route a default-exchange publish
    into every queue CC names."""
    connection = broker_connection()
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "",
            f"rmtest.{ns}.named-in-cc-2",
            b"{}",
            pika.BasicProperties(headers={"CC": [bystanders["CC"]], "Cc": [bystanders["Cc"]]}),
            mandatory=True,
        )
    finally:
        connection.close()
    assert [len(ready(bystanders[h])) for h in ("CC", "BCC", "cc", "Cc")] == [1, 0, 1, 0]
