"""The fast path's processing leases against the real Redis and PostgreSQL of this machine.

Two consumers that receive the same message_id at the same time run its handler once: the one
that takes the lease runs it, the other puts its copy aside at once instead of waiting on the
first one's inbox row, and answers it as a duplicate when it comes back. When things run long,
a consumer whose lease expired does not take back the lease another consumer holds now, and a
consumer without retry delays still has somewhere to put a leased message aside.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections
from django_redis import get_redis_connection

from reliable_messaging.conf import messaging_settings
from reliable_messaging.consuming import fastpath
from reliable_messaging.consuming.fastpath import DuplicateCache
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.envelope import DEFERRALS_HEADER, Delivery, Message, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, Outcome, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import OutboxMessage
from reliable_messaging.storage import inbox
from tests.support import fast_path_key, wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def with_cache(settings: Any) -> Callable[..., None]:
    """``with_cache(**overrides)``: the fast path on (the ``messaging`` Redis cache), with
    RELIABLE_MESSAGING's other values overridden as given."""

    def configure(**overrides: Any) -> None:
        settings.RELIABLE_MESSAGING = {
            **settings.RELIABLE_MESSAGING,
            "CACHE_ALIAS": "messaging",
            **overrides,
        }

    configure()
    return configure


def spec_of(name: str, handler: Callable[[Message], None], **kwargs: Any) -> ConsumerSpec:
    return ConsumerSpec(name=name, queue=f"{name}.q", handler=handler, **kwargs)


def delivery_for(spec: ConsumerSpec, message_id: str) -> Delivery:
    return Delivery(
        body=encode_payload({"n": 1}),
        queue=spec.queue,
        exchange=messaging_settings.exchange,
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
    )


def record(message: Message) -> None:
    Effect.objects.create(consumer="leases", message_id=message.message_id, attempt=1)


def test_concurrent_twins_run_the_handler_once_and_the_second_yields_at_once(
    with_cache: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two consumers (each with its own cache client and token, as two processes have) receive
    the same message_id while the first is inside its handler, its inbox row not committed.
    Without the lease the second would wait on that row, up to the inbox's LOCK_TIMEOUT, holding a
    database connection and a handler thread all that time."""
    monkeypatch.setattr(inbox, "LOCK_TIMEOUT", 30.0)
    message_id = f"tw-{uuid.uuid4()}"
    inside, finish = threading.Event(), threading.Event()
    runs: list[str] = []

    def slow(message: Message) -> None:
        runs.append(message.message_id)
        record(message)
        inside.set()
        assert finish.wait(30), "the test never let the handler finish"

    spec = spec_of("leases.twins", slow)
    first = DeliveryProcessor(spec, cache=DuplicateCache("messaging", messaging_settings))
    second = DeliveryProcessor(spec, cache=DuplicateCache("messaging", messaging_settings))
    outcomes: dict[str, Outcome] = {}

    def consume(name: str, processor: DeliveryProcessor) -> None:
        try:
            outcomes[name] = processor.process(delivery_for(spec, message_id))
        finally:
            connections.close_all()

    one = threading.Thread(target=consume, args=("first", first))
    two = threading.Thread(target=consume, args=("second", second))
    one.start()
    try:
        assert inside.wait(30), "the first consumer never ran the handler"
        two.start()
        two.join(5)
        assert not two.is_alive(), "the twin waited on the first's inbox row instead of yielding"
    finally:
        finish.set()
        one.join(30)
        two.join(30)

    assert outcomes["first"] == Acknowledge("processed")
    deferred = outcomes["second"]
    assert isinstance(deferred, ScheduleRetry) and deferred.deferred
    assert deferred.next_attempt == 1  # nothing failed: no attempt spent
    assert runs == [message_id]
    # The copy comes back after its delay: by then the first consumer's done key answers it.
    first.cache.flush()  # type: ignore[union-attr]
    assert second.process(delivery_for(spec, message_id)) == Acknowledge("duplicate")
    assert runs == [message_id]
    assert Effect.objects.filter(consumer="leases", message_id=message_id).count() == 1


def test_a_fresh_batch_costs_one_round_trip_and_carries_the_last_batchs_marks(
    with_cache: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its inbox claim a batch asks Redis once (done keys and leases together); what it
    committed goes with the next batch's round trip, or with the flusher's a moment later."""
    monkeypatch.setattr(fastpath, "FLUSH_AFTER", 30.0)  # no flusher in this test's way
    cache = DuplicateCache("messaging", messaging_settings)
    redis = get_redis_connection("messaging")
    trips: list[int] = []
    run = DuplicateCache._run

    def counted(self: DuplicateCache, *args: Any, **kwargs: Any) -> Any:
        if self is cache:  # not a cache an earlier test of this process left flushing
            trips.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(DuplicateCache, "_run", counted)
    spec = spec_of("leases.trips", record)
    processor = DeliveryProcessor(spec, cache=cache)
    batches = [[f"rt{b}-{uuid.uuid4()}" for _ in range(5)] for b in range(2)]

    def run_batch(ids: list[str]) -> list[Outcome | None]:
        return process_batch([Job(processor, delivery_for(spec, m)) for m in ids])

    assert run_batch(batches[0]) == [Acknowledge("processed")] * 5
    assert len(trips) == 1
    assert not any(redis.exists(fast_path_key(cache, "done", spec.name, m)) for m in batches[0])
    assert redis.exists(
        fast_path_key(cache, "lease", spec.name, batches[0][0])
    )  # not given back yet

    assert run_batch(batches[1]) == [Acknowledge("processed")] * 5
    assert len(trips) == 2
    assert all(redis.exists(fast_path_key(cache, "done", spec.name, m)) for m in batches[0])
    assert not any(redis.exists(fast_path_key(cache, "lease", spec.name, m)) for m in batches[0])

    assert run_batch(batches[0]) == [Acknowledge("duplicate")] * 5  # Redis alone answers
    assert len(trips) == 3
    cache.flush()
    assert all(redis.exists(fast_path_key(cache, "done", spec.name, m)) for m in batches[1])
    assert not any(redis.exists(fast_path_key(cache, "lease", spec.name, m)) for m in batches[1])


def test_the_flusher_sends_the_last_batchs_marks_without_another_batch(
    with_cache: Callable[..., None],
) -> None:
    cache = DuplicateCache("messaging", messaging_settings)
    redis = get_redis_connection("messaging")
    spec = spec_of("leases.flusher", record)
    message_id = f"fl-{uuid.uuid4()}"
    assert DeliveryProcessor(spec, cache=cache).process(delivery_for(spec, message_id)) == (
        Acknowledge("processed")
    )
    wait_until(
        lambda: (
            redis.exists(fast_path_key(cache, "done", spec.name, message_id))
            and not redis.exists(fast_path_key(cache, "lease", spec.name, message_id))
        ),
        timeout=5,
        message="the flusher to write the done key and give the lease back",
    )


def test_a_process_that_ends_sends_what_its_last_batch_committed(
    with_cache: Callable[..., None],
) -> None:
    """The flusher is a daemon thread; a consumer process that exits before it ran still sends
    its last batch's done keys and gives its leases back."""
    key = ("leases.exit", f"ex-{uuid.uuid4()}")
    cache = DuplicateCache("messaging", messaging_settings)
    redis = get_redis_connection("messaging")
    assert cache.check([key], {key})[1] == {key: True}  # taken with this process's token...
    script = (
        "import django; django.setup()\n"
        "from reliable_messaging.consuming import fastpath\n"
        "fastpath.FLUSH_AFTER = 60.0\n"
        "cache = fastpath.DuplicateCache('messaging')\n"
        f"cache._token = {cache._token!r}\n"  # ...which the child holds, as if it took it
        f"cache.remember([{key!r}], [{key!r}])\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    assert redis.exists(fast_path_key(cache, "done", *key))
    assert not redis.exists(fast_path_key(cache, "lease", *key))


def test_a_consumer_without_retry_delays_defers_a_leased_message_to_a_declared_delay(
    with_cache: Callable[..., None],
) -> None:
    spec = spec_of("leases.no-delays", record, retry_delays=())
    message_id = f"nd-{uuid.uuid4()}"
    other = DuplicateCache("messaging", messaging_settings)
    assert other.check([(spec.name, message_id)], {(spec.name, message_id)})[1] == {
        (spec.name, message_id): True
    }

    processor = DeliveryProcessor(spec, cache=DuplicateCache("messaging", messaging_settings))
    outcome = processor.process(delivery_for(spec, message_id))

    assert isinstance(outcome, ScheduleRetry) and outcome.deferred
    assert outcome.next_attempt == 1  # nothing failed: no attempt spent
    # The settings' first delay, and the copy waits in the outbox for it, for this queue alone.
    assert outcome.delay == messaging_settings.retry_delays[0]
    (copy,) = OutboxMessage.objects.filter(message_id=message_id)
    assert (copy.status, copy.exchange, copy.routing_key) == ("scheduled", "", spec.queue)
    assert not Effect.objects.filter(message_id=message_id).exists()


def test_an_expired_lease_given_back_late_leaves_the_new_holders_lease(
    with_cache: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    key = ("leases.expired", f"ex-{uuid.uuid4()}")
    redis = get_redis_connection("messaging")
    slow = DuplicateCache("messaging", messaging_settings)
    other = DuplicateCache("messaging", messaging_settings)
    third = DuplicateCache("messaging", messaging_settings)
    lease_key = fast_path_key(slow, "lease", *key)

    monkeypatch.setattr(fastpath, "LEASE_SECONDS", 0.05)
    assert slow.check([key], {key})[1] == {key: True}
    wait_until(lambda: not redis.exists(lease_key), timeout=5, message="the lease to expire")
    monkeypatch.setattr(fastpath, "LEASE_SECONDS", 60.0)
    assert other.check([key], {key})[1] == {key: True}

    slow.remember([key], [key])  # the slow consumer finishes and gives back "its" lease
    slow.flush()

    assert redis.exists(lease_key), "the other consumer's lease was deleted"
    assert third.check([key])[0] == {key}  # the done key is written all the same
    other.remember([], [key])
    other.flush()
    assert not redis.exists(lease_key)  # its holder gives it back


def test_a_batch_that_outlived_its_leases_gives_back_only_its_own(
    with_cache: Callable[..., None],
) -> None:
    redis = get_redis_connection("messaging")
    cache = DuplicateCache("messaging", messaging_settings)
    other = DuplicateCache("messaging", messaging_settings)
    ids = [f"ol-{uuid.uuid4()}" for _ in range(3)]
    taken_over = ids[1]

    def slow_handler(message: Message) -> None:
        record(message)
        if message.message_id == taken_over:
            # This handler ran past the lease's LEASE_SECONDS: its lease is gone (as on expiry) and
            # another consumer, receiving a copy, takes the lease.
            redis.delete(fast_path_key(cache, "lease", spec.name, taken_over))
            assert other.check([(spec.name, taken_over)], {(spec.name, taken_over)})[1] == {
                (spec.name, taken_over): True
            }

    spec = spec_of("leases.outlived", slow_handler)
    processor = DeliveryProcessor(spec, cache=cache)
    jobs = [Job(processor, delivery_for(spec, message_id)) for message_id in ids]

    assert process_batch(jobs) == [Acknowledge("processed")] * 3
    cache.flush()

    assert redis.exists(fast_path_key(cache, "lease", spec.name, taken_over)), (
        "the other's lease was deleted"
    )
    for message_id in (ids[0], ids[2]):
        assert not redis.exists(fast_path_key(cache, "lease", spec.name, message_id))
    assert cache.check([(spec.name, m) for m in ids])[0] == {(spec.name, m) for m in ids}
    other.remember([], [(spec.name, taken_over)])
    other.flush()
    assert not redis.exists(fast_path_key(cache, "lease", spec.name, taken_over))


def test_a_copy_put_aside_again_and_again_waits_longer_each_time(
    with_cache: Callable[..., None],
) -> None:
    """Each deferral of the same copy takes the next of the consumer's delays (the last one
    after that), so a message held elsewhere for long costs a few deferrals, not one every
    first delay; a count a producer wrote that is not one counts as none."""
    spec = spec_of("leases.again", record, retry_delays=(0.2, 0.4, 0.8))
    message_id = f"ag-{uuid.uuid4()}"
    other = DuplicateCache("messaging", messaging_settings)
    assert other.check([(spec.name, message_id)], {(spec.name, message_id)})[1] == {
        (spec.name, message_id): True
    }
    processor = DeliveryProcessor(spec, cache=DuplicateCache("messaging", messaging_settings))

    seen = []
    for deferrals in (None, 1, 2, 7, "7", -3, True):
        delivery = delivery_for(spec, message_id)
        if deferrals is not None:
            delivery = dataclasses.replace(delivery, headers={DEFERRALS_HEADER: deferrals})
        outcome = processor.process(delivery)
        assert isinstance(outcome, ScheduleRetry) and outcome.deferred
        assert outcome.next_attempt == 1
        seen.append((outcome.delay, outcome.headers[DEFERRALS_HEADER]))

    assert seen == [(0.2, 1), (0.4, 2), (0.8, 3), (0.8, 8), (0.2, 1), (0.2, 1), (0.2, 1)]
    assert not Effect.objects.filter(message_id=message_id).exists()
    other.remember([], [(spec.name, message_id)])
