"""The fast path's processing leases against the real Redis of this machine.

A lease only keeps a second consumer from running a message in parallel; these tests hold it to
what that promises when things run long: a consumer whose lease expired does not take back the
lease another consumer holds now, and a consumer without retry delays still has somewhere to
put a leased message aside.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django_redis import get_redis_connection

from reliable_messaging.broker.topology import all_delays
from reliable_messaging.conf import messaging_settings
from reliable_messaging.consuming.fastpath import DuplicateCache
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.envelope import DEFERRALS_HEADER, Delivery, Message, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from tests.support import wait_until
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


def test_a_consumer_without_retry_delays_defers_a_leased_message_to_a_declared_delay(
    with_cache: Callable[..., None],
) -> None:
    spec = spec_of("leases.no-delays", record, retry_delays=())
    message_id = f"nd-{uuid.uuid4()}"
    other = DuplicateCache("messaging", messaging_settings)
    assert other.lease([(spec.name, message_id)]) == {(spec.name, message_id): True}

    processor = DeliveryProcessor(spec, cache=DuplicateCache("messaging", messaging_settings))
    outcome = processor.process(delivery_for(spec, message_id))

    assert isinstance(outcome, ScheduleRetry) and outcome.deferred
    assert outcome.next_attempt == 1  # nothing failed: no attempt spent
    # The copy is published to the delay exchange of that delay: it must be one the topology
    # declares for this consumer, or the broker would refuse the copy.
    assert outcome.delay in all_delays([spec])
    assert not Effect.objects.filter(message_id=message_id).exists()


def test_an_expired_lease_given_back_late_leaves_the_new_holders_lease(
    with_cache: Callable[..., None],
) -> None:
    key = ("leases.expired", f"ex-{uuid.uuid4()}")
    redis = get_redis_connection("messaging")
    slow = DuplicateCache("messaging", messaging_settings)
    other = DuplicateCache("messaging", messaging_settings)
    third = DuplicateCache("messaging", messaging_settings)
    lease_key = slow.lease_key(*key)

    with_cache(DEDUP_LEASE_SECONDS=0.05)
    assert slow.lease([key]) == {key: True}
    wait_until(lambda: not redis.exists(lease_key), timeout=5, message="the lease to expire")
    with_cache(DEDUP_LEASE_SECONDS=60.0)
    assert other.lease([key]) == {key: True}

    slow.remember([key], [key])  # the slow consumer finishes and gives back "its" lease

    assert redis.exists(lease_key), "the other consumer's lease was deleted"
    assert third.lease([key]) == {key: False}
    assert third.processed([key]) == {key}  # the done key is written all the same
    other.remember([], [key])
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
            # This handler ran past DEDUP_LEASE_SECONDS: its lease is gone (as on expiry) and
            # another consumer, receiving a copy, takes the lease.
            redis.delete(cache.lease_key(spec.name, taken_over))
            assert other.lease([(spec.name, taken_over)]) == {(spec.name, taken_over): True}

    spec = spec_of("leases.outlived", slow_handler)
    processor = DeliveryProcessor(spec, cache=cache)
    jobs = [Job(processor, delivery_for(spec, message_id)) for message_id in ids]

    assert process_batch(jobs, cache=cache) == [Acknowledge("processed")] * 3

    assert redis.exists(cache.lease_key(spec.name, taken_over)), "the other's lease was deleted"
    for message_id in (ids[0], ids[2]):
        assert not redis.exists(cache.lease_key(spec.name, message_id))
    assert cache.processed([(spec.name, m) for m in ids]) == {(spec.name, m) for m in ids}
    other.remember([], [(spec.name, taken_over)])
    assert not redis.exists(cache.lease_key(spec.name, taken_over))


def test_a_copy_put_aside_again_and_again_waits_longer_each_time(
    with_cache: Callable[..., None],
) -> None:
    """Each deferral of the same copy takes the next of the consumer's delays (the last one
    after that), so a message held elsewhere for long costs a few deferrals, not one every
    first delay; a count a producer wrote that is not one counts as none."""
    spec = spec_of("leases.again", record, retry_delays=(0.2, 0.4, 0.8))
    message_id = f"ag-{uuid.uuid4()}"
    other = DuplicateCache("messaging", messaging_settings)
    assert other.lease([(spec.name, message_id)]) == {(spec.name, message_id): True}
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
