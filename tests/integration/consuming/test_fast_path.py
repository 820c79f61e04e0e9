"""The Redis duplicate fast path (CACHE_ALIAS): faster duplicates, never different answers.

Runs against the real Redis of this machine through django-redis (the ``messaging`` cache of
tests/settings.py, whose keys carry the session's namespace). "Redis down" is a cache pointed at
a port nobody listens on; "flushed" deletes the fast path's keys mid-run.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django_redis import get_redis_connection
from prometheus_client import REGISTRY

from reliable_messaging.conf import messaging_settings
from reliable_messaging.consuming.fastpath import DuplicateCache
from reliable_messaging.consuming.processing import DeliveryProcessor
from reliable_messaging.core.envelope import REPLAY_HEADER, Delivery, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, Outcome, ScheduleRetry
from reliable_messaging.models import ProcessedMessage
from reliable_messaging.testing import find_consumer
from tests.support import fast_path_key
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

ALPHA = "tests.alpha"


@pytest.fixture
def fast_path(settings: Any) -> Iterator[DuplicateCache]:
    settings.RELIABLE_MESSAGING = {**settings.RELIABLE_MESSAGING, "CACHE_ALIAS": "messaging"}
    yield DuplicateCache("messaging", messaging_settings)


def counter(result: str) -> float:
    value = REGISTRY.get_sample_value(
        "reliable_messaging_dedup_cache_total", {"consumer": ALPHA, "result": result}
    )
    return value or 0.0


def process(
    cache: DuplicateCache | None, message_id: str, headers: dict[str, Any] | None = None
) -> Outcome:
    spec = find_consumer(ALPHA)
    delivery = Delivery(
        body=encode_payload({"n": 1}),
        queue=spec.queue,
        exchange=messaging_settings.exchange,
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
        headers=headers or {},
    )
    return DeliveryProcessor(spec, cache=cache).process(delivery)


def test_a_processed_message_is_a_duplicate_without_touching_the_database(
    fast_path: DuplicateCache,
) -> None:
    message_id = f"fp-{uuid.uuid4()}"
    hits = counter("hit")
    assert process(fast_path, message_id) == Acknowledge("processed")
    with CaptureQueriesContext(connection) as queries:
        assert process(fast_path, message_id) == Acknowledge("duplicate")
    assert len(queries) == 0
    assert counter("hit") == hits + 1
    assert Effect.objects.filter(consumer="alpha", message_id=message_id).count() == 1


def test_a_replay_skips_the_cache_so_a_forced_replay_runs_again(
    fast_path: DuplicateCache,
) -> None:
    message_id = f"fp-{uuid.uuid4()}"
    assert process(fast_path, message_id) == Acknowledge("processed")
    # A forced replay removes the inbox row; the cache still remembers the id.
    ProcessedMessage.objects.filter(consumer=ALPHA, message_id=message_id).delete()
    outcome = process(fast_path, message_id, headers={REPLAY_HEADER: True})
    assert outcome == Acknowledge("processed")
    assert Effect.objects.filter(consumer="alpha", message_id=message_id).count() == 2


def test_a_message_leased_by_another_consumer_is_deferred_not_run(
    fast_path: DuplicateCache,
) -> None:
    message_id = f"fp-{uuid.uuid4()}"
    other = DuplicateCache("messaging", messaging_settings)
    assert other.check([(ALPHA, message_id)], {(ALPHA, message_id)})[1] == {
        (ALPHA, message_id): True
    }
    outcome = process(fast_path, message_id)
    assert isinstance(outcome, ScheduleRetry)
    assert outcome.deferred and outcome.next_attempt == 1
    assert not Effect.objects.filter(message_id=message_id).exists()
    # The other consumer finishes: its done key answers the copy when it comes back.
    other.remember([(ALPHA, message_id)], [(ALPHA, message_id)])
    other.flush()
    assert process(fast_path, message_id) == Acknowledge("duplicate")


def test_flushed_cache_changes_nothing_but_speed(fast_path: DuplicateCache) -> None:
    ids = [f"fp-{uuid.uuid4()}" for _ in range(5)]
    for message_id in ids:
        assert process(fast_path, message_id) == Acknowledge("processed")
    fast_path.flush()
    assert get_redis_connection("messaging").delete(
        *[fast_path_key(fast_path, "done", ALPHA, m) for m in ids]
    )
    for message_id in ids:
        assert process(fast_path, message_id) == Acknowledge("duplicate")  # the inbox decides
        assert Effect.objects.filter(consumer="alpha", message_id=message_id).count() == 1


def test_redis_down_warns_once_and_the_database_decides(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dead = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",  # nothing listens there
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 0.5},
    }
    with override_settings(CACHES={**settings.CACHES, "down": dead}):
        cache = DuplicateCache("down", messaging_settings)
        errors = counter_for("-", "error")
        with caplog.at_level(logging.WARNING, logger="reliable_messaging.consuming.fastpath"):
            ids = [f"fp-{uuid.uuid4()}" for _ in range(3)]
            for message_id in ids:
                assert process(cache, message_id) == Acknowledge("processed")
            for message_id in ids:
                assert process(cache, message_id) == Acknowledge("duplicate")
        warnings = [r for r in caplog.records if "duplicate fast path" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "the database decides" in warnings[0].getMessage()
        assert counter_for("-", "error") >= errors + 1
        for message_id in ids:
            assert Effect.objects.filter(consumer="alpha", message_id=message_id).count() == 1


def counter_for(consumer: str, result: str) -> float:
    value = REGISTRY.get_sample_value(
        "reliable_messaging_dedup_cache_total", {"consumer": consumer, "result": result}
    )
    return value or 0.0
