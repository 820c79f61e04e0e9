"""Expired messages are counted, not handled: real ``relay`` and ``consume`` processes.

Messages are published (``publish(..., expires=...)`` and the relay, or a foreign producer)
while no consumer runs, or fail and wait in the outbox longer than their deadline; the
``consume`` process that receives them late acks them without running the handler, counts
them ``expired`` on its /metrics, writes no inbox row, and a dead letter ``expired`` only for
the consumer that asks for one (tests/testapp/consumers.py: ``tests.delta`` and
``tests.epsilon`` have a max_age of 2 s, and retry after ``RM_TEST_LATE_RETRY_DELAY`` seconds;
epsilon keeps expired messages as dead letters).
"""

from __future__ import annotations

import io
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from prometheus_client.parser import text_string_to_metric_families

from reliable_messaging import publish
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus
from reliable_messaging.core.envelope import EXPIRES_AT_HEADER, PUBLISHED_AT_HEADER
from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess, Publisher, drained, wait_until
from tests.testapp.models import Effect
from tests.trace_file import read_spans

from .test_replay_routing import relay_once

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


class Consumers:
    """``manage.py consume`` processes of the test, each with its own /metrics port."""

    def __init__(self, ns: str, tmp_path: Path) -> None:
        self.ns = ns
        self.tmp_path = tmp_path
        self.running: list[ConsumeProcess] = []

    def start(self, *labels: str, **env: str) -> tuple[ConsumeProcess, int]:
        queues = [arg for label in labels for arg in ("--queue", f"{self.ns}.{label}")]
        process = ConsumeProcess(
            [*queues, "--metrics-port", "0"],
            {**subprocess_env(self.ns), **env},
            self.tmp_path / f"consume-{len(self.running) + 1}.log",
        )
        self.running.append(process)
        process.wait_consuming()
        return process, process.ops_port()

    def declare(self, *labels: str) -> None:
        """Run a consume process once and stop it: the queues and bindings exist, nobody
        consumes them."""
        process, _ = self.start(*labels)
        process.send(15)  # SIGTERM: a graceful stop
        assert process.wait(30) == 0, process.log()

    def close(self) -> None:
        for process in self.running:
            process.close()


@pytest.fixture
def consumers(ns: str, tmp_path: Path) -> Iterator[Consumers]:
    running = Consumers(ns, tmp_path)
    try:
        yield running
    finally:
        running.close()


def outcomes(port: int, consumer: str) -> dict[str, float]:
    """``reliable_messaging_consumer_messages_total`` of ``consumer`` by outcome, as the
    consume process on ``port`` serves it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "reliable_messaging_consumer_messages":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels["consumer"] == consumer:
                found[sample.labels["outcome"]] = sample.value
    return found


def wait_for_outcomes(port: int, consumer: str, **expected: float) -> dict[str, float]:
    def reached() -> bool:
        counted = outcomes(port, consumer)
        return all(counted.get(outcome, 0.0) >= n for outcome, n in expected.items())

    wait_until(reached, timeout=45, message=f"{consumer}'s outcomes {expected}")
    return outcomes(port, consumer)


def sleep_past(deadline: float) -> None:
    """Wait until this host's clock is past ``deadline`` (Unix seconds)."""
    time.sleep(max(0.0, deadline - time.time()) + 0.2)


def effects(label: str) -> list[str]:
    return sorted(Effect.objects.filter(consumer=label).values_list("message_id", flat=True))


def inbox(consumer: str) -> list[str]:
    return sorted(
        ProcessedMessage.objects.filter(consumer=consumer).values_list("message_id", flat=True)
    )


def test_messages_past_their_publish_deadline_are_counted_not_handled(
    ns: str, rm_settings: dict[str, Any], consumers: Consumers
) -> None:
    consumers.declare("alpha")
    late = [f"late-{n}" for n in range(3)]
    with transaction.atomic():
        for message_id in late:
            publish("order.placed", {"n": message_id}, message_id=message_id, expires=0.5)
        publish("order.placed", {"n": "fresh"}, message_id="fresh", expires=600)
    published = time.time()
    relay_once(ns)
    sleep_past(published + 0.5)

    process, port = consumers.start("alpha")
    counted = wait_for_outcomes(port, "tests.alpha", expired=3, processed=1)
    assert counted["expired"] == 3 and counted["processed"] == 1, counted
    assert counted.get("dead_lettered", 0) == 0, counted
    assert effects("alpha") == ["fresh"]  # the handler ran for the fresh message only
    assert inbox("tests.alpha") == ["fresh"]
    assert not DeadLetter.objects.exists()
    wait_until(lambda: drained(f"{ns}.alpha"), timeout=20, message="alpha's queue drained")
    log = process.log()
    for message_id in late:
        # Logged once, saying how late.
        [line] = [x for x in log.splitlines() if f"expired message_id={message_id} " in x]
        assert "consumer=tests.alpha" in line and "passed" in line and "s before" in line


def test_max_age_expires_old_messages_and_on_expiry_keeps_them_as_dead_letters_to_replay(
    ns: str, rm_settings: dict[str, Any], consumers: Consumers
) -> None:
    consumers.declare("delta", "epsilon")
    with transaction.atomic():
        publish("late.order", {"n": 1}, message_id="old-1")
        # A replay keeps this one's deadline (it is the producer's), and its publish time is new.
        publish("late.order", {"n": 2}, message_id="due-1", expires=1.0)
    relay_once(ns)
    sent = time.time()  # the relay stamps x-rm-published-at when it sends
    sleep_past(sent + 2.0)

    _, port = consumers.start("delta", "epsilon")
    assert wait_for_outcomes(port, "tests.delta", expired=2).get("processed", 0) == 0
    assert wait_for_outcomes(port, "tests.epsilon", expired=2).get("processed", 0) == 0
    assert effects("delta") == effects("epsilon") == []
    assert inbox("tests.delta") == inbox("tests.epsilon") == []
    # delta drops them; epsilon keeps them for a person to look at.
    assert not DeadLetter.objects.filter(consumer="tests.delta").exists()
    old, due = (
        DeadLetter.objects.get(consumer="tests.epsilon", message_id=message_id)
        for message_id in ("old-1", "due-1")
    )
    assert old.reason == due.reason == DeadLetterReason.EXPIRED
    assert "max_age of 2s" in old.exception_message
    assert EXPIRES_AT_HEADER in due.exception_message
    wait_until(
        lambda: drained(f"{ns}.delta", f"{ns}.epsilon"), timeout=20, message="queues drained"
    )

    # An operator's replay is a decision to handle it now: exempt from max_age.
    out = io.StringIO()
    call_command("replay_dead_letters", "--consumer", "tests.epsilon", stdout=out)
    assert "replayed 2 dead letter(s)" in out.getvalue()
    relay_once(ns)
    counted = wait_for_outcomes(port, "tests.epsilon", processed=2)
    assert counted["expired"] == 2, counted  # the replays were not expired again
    assert effects("epsilon") == inbox("tests.epsilon") == ["due-1", "old-1"]
    for letter in (old, due):
        letter.refresh_from_db()
        assert letter.status == DeadLetterStatus.RESOLVED


def test_a_retry_whose_delay_outlives_max_age_is_expired_not_retried_again(
    ns: str, consumers: Consumers, publisher: Publisher
) -> None:
    _, port = consumers.start("delta", "epsilon", RM_TEST_LATE_RETRY_DELAY="4")
    # Both fail their first attempt (in time); the retry comes back 4 s later, past 2 s.
    publisher.publish(
        f"rmtest.{ns}",
        "late.order",
        {"fail": {"delta": 5, "epsilon": 5}},
        message_id="slow-retry",
        # As the relay stamps it: in milliseconds (the AMQP timestamp has whole seconds only).
        headers={PUBLISHED_AT_HEADER: int(time.time() * 1000)},
    )
    for consumer in ("tests.delta", "tests.epsilon"):
        counted = wait_for_outcomes(port, consumer, retried=1, expired=1)
        assert counted["retried"] == 1 and counted["expired"] == 1, counted
        assert counted.get("processed", 0) == counted.get("dead_lettered", 0) == 0, counted
    assert not DeadLetter.objects.filter(consumer="tests.delta").exists()
    letter = DeadLetter.objects.get(consumer="tests.epsilon", message_id="slow-retry")
    assert letter.reason == DeadLetterReason.EXPIRED  # not retries_exhausted
    assert letter.attempts == 2
    assert inbox("tests.delta") == inbox("tests.epsilon") == []


def test_a_foreign_producers_deadline_as_text_is_honoured_and_garbage_is_ignored(
    ns: str, consumers: Consumers, publisher: Publisher, tmp_path: Path
) -> None:
    spans = tmp_path / "spans.jsonl"
    process, port = consumers.start("alpha", RM_TRACE_FILE=str(spans))
    now_ms = int(time.time() * 1000)
    exchange = f"rmtest.{ns}"
    for message_id, deadline in (
        ("text-past", str(now_ms - 1000)),
        ("text-future", str(now_ms + 600_000)),
        ("bytes-past", str(now_ms - 1000).encode()),
        ("garbage", "tomorrow"),
    ):
        publisher.publish(
            exchange,
            "order.placed",
            {"n": message_id},
            message_id=message_id,
            headers={EXPIRES_AT_HEADER: deadline},
        )
    counted = wait_for_outcomes(port, "tests.alpha", expired=2, processed=2)
    assert counted["expired"] == 2 and counted["processed"] == 2, counted
    assert effects("alpha") == ["garbage", "text-future"]
    assert inbox("tests.alpha") == ["garbage", "text-future"]
    assert not DeadLetter.objects.exists()
    warnings = [x for x in process.log().splitlines() if "message_id=garbage" in x]
    assert any("WARNING" in x and EXPIRES_AT_HEADER in x for x in warnings), warnings

    # Each delivery's span ends with its outcome, the expired ones saying how late they were.
    def outcome_of_spans() -> dict[str, tuple[str, str]]:
        return {
            span["attributes"]["messaging.message.id"]: (
                span["attributes"]["reliable_messaging.outcome"],
                span["attributes"].get("reliable_messaging.reason", ""),
            )
            for span in read_spans(spans)
            if span["name"] == f"process {ns}.alpha"
        }

    wait_until(lambda: len(outcome_of_spans()) == 4, timeout=20, message="four process spans")
    traced = outcome_of_spans()
    assert {m: outcome for m, (outcome, _) in traced.items()} == {
        "text-past": "expired",
        "bytes-past": "expired",
        "text-future": "processed",
        "garbage": "processed",
    }
    assert "passed" in traced["text-past"][1]
