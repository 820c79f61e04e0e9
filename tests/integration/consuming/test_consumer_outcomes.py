"""Outcomes no handler decides, with a real ConsumerService against RabbitMQ and PostgreSQL.

- ``consumer_error``: our own code (not the handler) failing on one delivery of a batch. The
  batch is split to find it; after ``workers.CONSUMER_ERROR_LIMIT`` failures it becomes a dead
  letter with reason ``consumer_error`` and is acked, and its neighbours are processed normally.
- the hold bound: a batch held while the database is unavailable is given back to the broker
  once held longer than ``max_hold_seconds`` (half of ``BROKER_CONSUMER_TIMEOUT``), and is
  processed once when the database is back.

The fixtures ``rec`` and ``make_spec`` and the helpers come from ``test_consumer_service``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.test import override_settings

import reliable_messaging.consuming.workers as consumer_workers
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.consuming.processing import DeliveryProcessor
from reliable_messaging.consuming.workers import WorkerPool
from reliable_messaging.core.envelope import DecodeError, Delivery, Message
from reliable_messaging.core.outcomes import Acknowledge, Release
from reliable_messaging.exceptions import DatabaseUnavailable
from reliable_messaging.models import DeadLetter
from tests.integration.consuming import test_consumer_service as base
from tests.integration.consuming.test_consumer_service import (
    Recorder,
    drained,
    effects,
    exchange_of,
)
from tests.support import Publisher, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# The fixtures of test_consumer_service, made available here.
rec = base.rec
make_spec = base.make_spec


@pytest.fixture
def tune(rm_settings: dict[str, Any]) -> Iterator[Callable[..., None]]:
    """``tune(KEY=value, ...)`` overrides RELIABLE_MESSAGING on top of ``rm_settings``. List it
    before ``service`` so the override outlives the services the test starts."""
    with contextlib.ExitStack() as stack:

        def apply(**values: Any) -> None:
            stack.enter_context(override_settings(RELIABLE_MESSAGING={**rm_settings, **values}))

        yield apply


# --------------------------------------------------------------------------- consumer_error


def test_our_own_error_on_one_delivery_dead_letters_it_and_spares_its_batch(
    ns: str,
    tune: Any,
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tune(RECONNECT_MAX_DELAY=0.5)
    monkeypatch.setattr(consumer_workers, "CONSUMER_ERROR_LIMIT", 2)
    real_decode = DeliveryProcessor.decode
    decode_calls: list[str] = []

    def decode(self: DeliveryProcessor, delivery: Delivery) -> Message | DecodeError:
        if delivery.message_id == "bad-1":
            decode_calls.append(delivery.message_id)
            raise RuntimeError("decoder exploded on bad-1")
        return real_decode(self, delivery)

    monkeypatch.setattr(DeliveryProcessor, "decode", decode)

    # The batches the service split to find the delivery it fails on.
    split: list[list[str]] = []
    real_split = WorkerPool._decide_one_by_one

    def decide_one_by_one(self: WorkerPool, batch: list[Any]) -> Any:
        split.append([item.delivery.message_id for item in batch])
        return real_split(self, batch)

    monkeypatch.setattr(WorkerPool, "_decide_one_by_one", decide_one_by_one)

    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec, concurrency=1)
    # The first message keeps the only worker busy while the next six arrive, so they are
    # taken as one batch (it also opens the channel's cautious prefetch of 1).
    publisher.publish(
        exchange_of(ns), "order.placed", {"sleep": {"alpha": 0.7}}, message_id="warm-0"
    )
    assert rec.started.wait(10), "the first message never reached the handler"
    good = [f"good-{i}" for i in range(5)]
    bad_payload = {"order": "bad"}
    for message_id in [*good[:2], "bad-1", *good[2:]]:
        payload = bad_payload if message_id == "bad-1" else {"order": message_id}
        publisher.publish(exchange_of(ns), "order.placed", payload, message_id=message_id)

    wait_until(
        lambda: DeadLetter.objects.filter(consumer=alpha.name).exists(),
        timeout=10,
        message=lambda: f"a dead letter for bad-1; outcomes so far: {rec.results(alpha.name)}",
    )
    rec.wait_count(alpha.name, 7, timeout=10)
    wait_until(lambda: drained(alpha.queue), timeout=10, message="the queue drained")

    # The bad delivery was in one batch with good ones, and that batch was split.
    assert any("bad-1" in batch and len(batch) > 1 for batch in split), (
        f"bad-1 never came in a batch with other deliveries; batches split: {split}"
    )
    # Every good message processed exactly once, the bad one never reached the handler.
    assert sorted(effects("alpha")) == sorted([("warm-0", 1)] + [(m, 1) for m in good])
    by_id = {s.delivery.message_id: s.outcome for s in rec.of(alpha.name)}
    assert all(by_id[m] == Acknowledge("processed") for m in good), by_id
    assert by_id["bad-1"] == Acknowledge("dead_lettered", DeadLetterReason.CONSUMER_ERROR)
    # One dead letter: consumer_error, the traceback of our failure, the raw body kept.
    (dead,) = DeadLetter.objects.filter(consumer=alpha.name)
    assert dead.message_id == "bad-1"
    assert dead.reason == DeadLetterReason.CONSUMER_ERROR == "consumer_error"
    assert dead.consumer == f"{ns}.alpha"
    assert "RuntimeError" in dead.traceback and "decoder exploded on bad-1" in dead.traceback
    assert bytes(dead.body) == json.dumps(bad_payload).encode()
    assert dead.attempts == 2  # CONSUMER_ERROR_LIMIT failures
    assert len(decode_calls) >= 2


# --------------------------------------------------------------------------- the hold bound


def test_batch_held_for_an_unavailable_database_is_given_back_past_the_hold_bound(
    ns: str,
    tune: Any,
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Hold for at most 1s (half of BROKER_CONSUMER_TIMEOUT); database probes every <= 0.5s.
    tune(BROKER_CONSUMER_TIMEOUT=2.0, RECONNECT_MAX_DELAY=0.5)
    real_process_batch = consumer_workers.process_batch
    down_until: list[float] = []
    refused: list[list[str]] = []
    lock = threading.Lock()

    def process_batch(jobs: Any, **kwargs: Any) -> Any:
        with lock:
            if not down_until:
                down_until.append(time.monotonic() + 3.0)
            down = time.monotonic() < down_until[0]
            if down:
                refused.append([job.delivery.message_id for job in jobs])
        if down:
            raise DatabaseUnavailable("database down (test)")
        return real_process_batch(jobs, **kwargs)

    monkeypatch.setattr(consumer_workers, "process_batch", process_batch)

    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec, concurrency=1)
    publisher.publish(exchange_of(ns), "order.placed", {"order": 1}, message_id="held-1")

    wait_until(
        lambda: Acknowledge("processed") in [s.outcome for s in rec.of(alpha.name)],
        timeout=12,
        message=lambda: f"held-1 processed; outcomes so far: {rec.results(alpha.name)}",
    )
    wait_until(lambda: drained(alpha.queue), timeout=10, message="the queue drained")

    seen = rec.of(alpha.name)
    outcomes = [s.outcome for s in seen]
    assert all(s.delivery.message_id == "held-1" for s in seen)
    # Given back (held too long) before it was finally processed, and processed once.
    releases = [o for o in outcomes if isinstance(o, Release)]
    assert releases, outcomes
    assert all(o.why == "held too long without an outcome" for o in releases), outcomes
    assert outcomes[-1] == Acknowledge("processed")
    assert outcomes.count(Acknowledge("processed")) == 1
    assert all(isinstance(o, Release) for o in outcomes[:-1]), outcomes
    assert effects("alpha") == [("held-1", 1)]
    assert not DeadLetter.objects.filter(consumer=alpha.name).exists()
    # The copy given back came again redelivered, the suspect path held it too.
    assert any(s.delivery.redelivered for s in seen)
    assert len(refused) >= 2
