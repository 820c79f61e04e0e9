"""Several deliveries, one transaction: every guarantee of the one-by-one inbox still holds.

:func:`process_batch` is driven directly with a known batch (what a worker hands it under
load), then the whole consumer runs with real RabbitMQ: the metrics after a known scenario, and
a kill -9 in the middle of a batch.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client import REGISTRY

from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.envelope import ATTEMPT_HEADER, Delivery, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.storage.inbox import claim_inbox_rows
from reliable_messaging.storage.partitions import INBOX_CLAIM_FUNCTION, ensure_covered
from reliable_messaging.testing import find_consumer
from tests.support import Publisher, wait_until
from tests.testapp.consumers import behave
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def job(
    message_id: str,
    payload: Any = None,
    body: bytes | None = None,
    headers: dict[str, Any] | None = None,
) -> Job:
    spec = find_consumer("tests.alpha")
    delivery = Delivery(
        body=encode_payload(payload if payload is not None else {}) if body is None else body,
        queue=spec.queue,
        exchange="rmtest",
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
        headers=headers or {},
    )
    return Job(DeliveryProcessor(spec), delivery)


def effects_of(message_id: str) -> int:
    return Effect.objects.filter(consumer="alpha", message_id=message_id).count()


def test_a_failing_handler_rolls_back_only_itself_and_the_batch_commits_once() -> None:
    jobs = [
        job("ok-1"),
        job("transient", {"fail": {"alpha": 1}}),
        job("permanent", {"permanent": {"alpha": 1}}),
        job("ok-1"),  # the same message twice in one batch: the second is the duplicate
        job("missing-field", {"require": "email", "fields": {}}, headers={ATTEMPT_HEADER: 3}),
        job("not-json", body=b"{nope"),
        job("ok-2"),
    ]
    outcomes = process_batch(jobs)
    assert outcomes[0] == Acknowledge("processed")
    assert isinstance(outcomes[1], ScheduleRetry) and outcomes[1].next_attempt == 2
    assert outcomes[2] == Acknowledge("dead_lettered", "permanent")
    assert outcomes[3] == Acknowledge("duplicate")
    assert outcomes[4] == Acknowledge("dead_lettered", "retries_exhausted")
    assert outcomes[5] == Acknowledge("dead_lettered", "invalid_json")
    assert outcomes[6] == Acknowledge("processed")

    assert effects_of("ok-1") == effects_of("ok-2") == 1
    for failed in ("transient", "permanent", "missing-field", "not-json"):
        assert effects_of(failed) == 0  # rolled back with its own savepoint only
    assert set(ProcessedMessage.objects.values_list("message_id", flat=True)) == {"ok-1", "ok-2"}
    reasons = dict(DeadLetter.objects.values_list("message_id", "reason"))
    assert reasons == {
        "permanent": DeadLetterReason.PERMANENT,
        "missing-field": DeadLetterReason.RETRIES_EXHAUSTED,
        "not-json": DeadLetterReason.INVALID_JSON,
    }
    assert "KeyError" in DeadLetter.objects.get(message_id="missing-field").exception_type


def test_a_later_copy_processed_resolves_the_dead_letter_of_its_message() -> None:
    """A copy failed for good (a dead letter), another copy of the same message succeeds
    later: the dead letter is resolved in that transaction, and nothing is left to review."""
    first = process_batch([job("twice", {"permanent": {"alpha": 1}}), job("other-dead")])
    assert first[0] == Acknowledge("dead_lettered", "permanent")
    DeadLetter.objects.create(
        consumer="tests.beta", message_id="twice", queue="q", reason="permanent", body=b"{}"
    )
    DeadLetter.objects.create(
        consumer="tests.alpha", message_id="lonely", queue="q", reason="permanent", body=b"{}"
    )

    # Optimistic batch path, then the guarded one (a failing neighbour forces it).
    assert process_batch([job("twice"), job("fresh")]) == [Acknowledge("processed")] * 2
    letter = DeadLetter.objects.get(consumer="tests.alpha", message_id="twice")
    assert letter.status == "resolved"
    assert letter.history[-1]["by"] == "a later copy was processed"
    # Only that consumer's dead letter of that message.
    assert DeadLetter.objects.get(consumer="tests.beta", message_id="twice").status == "dead"
    assert DeadLetter.objects.get(message_id="lonely").status == "dead"

    DeadLetter.objects.filter(message_id="lonely").update(status="replayed")
    outcomes = process_batch([job("boom", {"permanent": {"alpha": 1}}), job("lonely")])
    assert outcomes == [Acknowledge("dead_lettered", "permanent"), Acknowledge("processed")]
    assert DeadLetter.objects.get(message_id="lonely").status == "resolved"
    assert DeadLetter.objects.get(message_id="boom").status == "dead"


def test_a_copy_that_fails_again_leaves_the_dead_letter_open() -> None:
    DeadLetter.objects.create(
        consumer="tests.alpha", message_id="again", queue="q", reason="permanent", body=b"{}"
    )
    outcomes = process_batch([job("again", {"permanent": {"alpha": 1}}), job("fine")])
    assert outcomes == [Acknowledge("dead_lettered", "permanent"), Acknowledge("processed")]
    assert DeadLetter.objects.get(message_id="again").status == "dead"


def test_an_unexpected_routing_key_is_a_dead_letter_with_its_reason() -> None:
    spec = find_consumer("tests.alpha")
    stray = Delivery(
        body=b"{}",
        queue=spec.queue,
        exchange="",
        routing_key=spec.queue,  # published straight to the queue through the default exchange
        message_id="stray-1",
        content_type="application/json",
    )
    outcome = DeliveryProcessor(spec).process(stray)
    assert outcome == Acknowledge("dead_lettered", "unexpected_routing_key")
    letter = DeadLetter.objects.get(message_id="stray-1")
    assert "matches none of the consumer's bindings" in letter.exception_message
    assert effects_of("stray-1") == 0


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_after_twenty_messages_and_one_duplicate(
    ns: str, service: Any, publisher: Publisher
) -> None:
    consumer = f"{ns}.alpha"
    spec = ConsumerSpec(
        name=consumer,
        queue=consumer,
        handler=lambda message: behave("alpha", message),
        bindings=("order.*",),
    )
    service([spec], concurrency=2)
    ids = [f"m-{n}" for n in range(20)]
    for message_id in ids:
        publisher.publish(f"rmtest.{ns}", "order.placed", {"n": 1}, message_id=message_id)
    publisher.publish(f"rmtest.{ns}", "order.placed", {"n": 1}, message_id=ids[0])
    total = "reliable_messaging_consumer_messages_total"
    wait_until(
        lambda: (
            sample(total, consumer=consumer, outcome="processed")
            + sample(total, consumer=consumer, outcome="duplicate")
            == 21
        ),
        timeout=30,
        message="21 outcomes counted",
    )
    assert sample(total, consumer=consumer, outcome="processed") == 20
    assert sample(total, consumer=consumer, outcome="duplicate") == 1
    assert sample("reliable_messaging_consumer_received_total", consumer=consumer) == 21
    assert sample("reliable_messaging_handler_duration_seconds_count", consumer=consumer) == 20
    # Counted per batch: every delivery decided once, every processed one since its publish.
    assert sample("reliable_messaging_processing_time_seconds_count", consumer=consumer) == 21
    assert sample("reliable_messaging_critical_time_seconds_count", consumer=consumer) == 20
    assert Effect.objects.filter(consumer="alpha").count() == 20


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_kill_9_in_the_middle_of_a_batch_loses_nothing_and_doubles_nothing(
    ns: str, consume: Any, publisher: Publisher, tmp_path: Path
) -> None:
    proc = consume("--queue", f"{ns}.alpha").wait_consuming()
    ids = [f"b-{uuid.uuid4()}" for _ in range(40)]
    # Twenty quick messages first, committed before the rest is sent, so the batch that dies
    # cannot be the one that holds them (a broker that delivers all forty at once would put
    # them in one batch with the slow handler, committed after it).
    for n, message_id in enumerate(ids[:20]):
        publisher.publish(f"rmtest.{ns}", "order.placed", {"n": n}, message_id=message_id)
    wait_until(lambda: Effect.objects.filter(consumer="alpha").count() == 20, timeout=30)
    for n, message_id in enumerate(ids[20:], start=20):
        # Message 20's handler sleeps for 5 s, holding its batch open: the process dies while
        # it runs, after the batch's earlier handlers ran but before the commit.
        payload: dict[str, Any] = {"sleep": {"alpha": 5}} if n == 20 else {"n": n}
        publisher.publish(f"rmtest.{ns}", "order.placed", payload, message_id=message_id)
    time.sleep(1.5)
    proc.kill()
    assert Effect.objects.filter(consumer="alpha").count() == 20
    consume("--queue", f"{ns}.alpha").wait_consuming()
    wait_until(
        lambda: Effect.objects.filter(consumer="alpha").count() >= 40,
        timeout=60,
        message="all 40 effects after the restart",
    )
    for message_id in ids:
        assert effects_of(message_id) == 1


def inbox_statements(queries: list[dict[str, str]]) -> list[str]:
    return [
        q["sql"]
        for q in queries
        if "reliable_messaging_" in q["sql"]
        or "lock_timeout" in q["sql"]
        or "SAVEPOINT" in q["sql"]
    ]


def test_a_batch_costs_one_round_trip_for_its_inbox_rows_and_dead_letter_lookup() -> None:
    """The claim (savepoint, bounded lock wait, insert, the dead-letter lookup, restore) is one
    round trip; without a dead letter to resolve, the batch sends nothing else of its own."""
    DeadLetter.objects.create(
        consumer="tests.alpha", message_id="rt-3", queue="q", reason="permanent", body=b"{}"
    )
    jobs = [job(f"rt-{n}") for n in range(5)]
    # Which days have partitions is read once per process, by its first claim: not this one's.
    ensure_covered("default", timezone.now())
    with CaptureQueriesContext(connection) as captured:
        assert process_batch(jobs) == [Acknowledge("processed")] * 5
    ours = inbox_statements(captured.captured_queries)
    # The claim, then resolving rt-3's dead letter (looked up, locked, saved): nothing for
    # the four others.
    assert ours[0].startswith("SAVEPOINT rm_inbox_claim; SELECT set_config")
    assert f"{INBOX_CLAIM_FUNCTION}(" in ours[0] and "RELEASE SAVEPOINT rm_inbox_claim" in ours[0]
    assert all("processedmessage" not in sql and "lock_timeout" not in sql for sql in ours[1:])
    assert DeadLetter.objects.get(message_id="rt-3").status == "resolved"
    assert sorted(ProcessedMessage.objects.values_list("message_id", flat=True)) == [
        f"rt-{n}" for n in range(5)
    ]
    assert all(effects_of(f"rt-{n}") == 1 for n in range(5))

    fresh = [job(f"rt-fresh-{n}") for n in range(5)]
    with CaptureQueriesContext(connection) as captured:
        assert process_batch(fresh) == [Acknowledge("processed")] * 5
    assert len(inbox_statements(captured.captured_queries)) == 1


def test_a_claim_cut_short_by_a_held_row_defers_only_that_row_and_restores_lock_timeout() -> None:
    """Another transaction holds one key's inbox row: the one-round-trip claim times out, rolls
    back to its savepoint, and the rows are tried one by one: the held one is busy, the rest
    claimed, and the transaction goes on with its own lock_timeout."""
    settings_dict = connection.settings_dict
    other = psycopg.connect(
        dbname=settings_dict["NAME"],
        user=settings_dict.get("USER") or "postgres",
        host=settings_dict.get("HOST") or "127.0.0.1",
        port=settings_dict.get("PORT") or 5432,
    )
    try:
        other.execute(
            "INSERT INTO reliable_messaging_processedmessage (consumer, message_id, processed_at)"
            " VALUES ('tests.alpha', 'held', now())"
        )  # not committed: the row is held
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '7s'")
            keys = [("tests.alpha", "held"), ("tests.alpha", "free"), ("tests.alpha", "zzz")]
            claimed, busy = claim_inbox_rows("default", keys, 0.2)
            assert busy == {("tests.alpha", "held")}
            assert claimed == {("tests.alpha", "free"): False, ("tests.alpha", "zzz"): False}
            cursor.execute("SHOW lock_timeout")
            assert cursor.fetchone()[0] == "7s"
        assert set(ProcessedMessage.objects.values_list("message_id", flat=True)) == {
            "free",
            "zzz",
        }
    finally:
        other.rollback()
        other.close()
