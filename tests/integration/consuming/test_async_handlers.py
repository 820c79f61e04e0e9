"""``async def`` handlers and ``apublish()`` (issue 47), against PostgreSQL and, for the
consumer, real ``manage.py consume`` processes.

The handler (tests/testapp/async_handling.py) writes through ``sync_to_async`` and through the
async ORM, and records what the async ORM saw inside the delivery's transaction: its
uncommitted inbox row and the sync part's uncommitted row, which no other session could see.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection, connections, transaction

from reliable_messaging import Message, apublish, consumer
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.models import OutboxMessage, ProcessedMessage
from reliable_messaging.testing import deliver, find_consumer
from tests.support import ConsumeProcess, Publisher, wait_until
from tests.testapp.async_handling import ASYNC_CONSUMER, handle
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def effects(label: str, message_id: str) -> list[Effect]:
    return list(Effect.objects.filter(consumer=label, message_id=message_id).order_by("id"))


def outbox_count(message_id: str) -> int:
    """Rows of ``message_id`` in the outbox, read on a session of another thread: committed
    rows only."""
    found: list[int] = []

    def count() -> None:
        try:
            found.append(OutboxMessage.objects.filter(message_id=message_id).count())
        finally:
            connections.close_all()

    reader = threading.Thread(target=count)
    reader.start()
    reader.join(30)
    return found[0]


def my_backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


# --------------------------------------------------------------------------- in process


async def in_process_handler(message: Message) -> None:
    await handle(message, consumer_name="tests.async_in_process")


@pytest.fixture
def async_spec(ns: str) -> Iterator[ConsumerSpec]:
    with registry.isolated():
        consumer(f"{ns}.async", bindings=["async.*"], name="tests.async_in_process")(
            in_process_handler
        )
        yield registry.get("tests.async_in_process")


def test_deliver_runs_an_async_handler_in_the_delivery_transaction(
    async_spec: ConsumerSpec,
) -> None:
    assert find_consumer(in_process_handler) is async_spec
    failed = deliver(async_spec, {"fail": 1}, message_id="a-1")
    assert isinstance(failed, ScheduleRetry)
    # Both writes and the apublish() rolled back with the failed attempt's inbox row.
    assert not effects("async-orm", "a-1") and not effects("async-sync", "a-1")
    assert outbox_count("a-1.done") == 0
    assert deliver(async_spec, {"fail": 1}, message_id="a-1", attempt=2) == Acknowledge("processed")
    assert deliver(async_spec, {"fail": 1}, message_id="a-1", attempt=2) == Acknowledge("duplicate")
    [orm] = effects("async-orm", "a-1")
    assert [e.attempt for e in effects("async-sync", "a-1")] == [2]
    assert orm.attempt == 2
    seen: dict[str, Any] = orm.payload or {}
    assert seen["saw_inbox_row"] and seen["saw_sync_row"]
    assert seen["in_atomic_block"]
    # The sync part ran on this thread's connection: deliver()'s own.
    assert seen["pid"] == my_backend_pid()
    assert seen["thread"] == threading.current_thread().name
    assert outbox_count("a-1.done") == 1


# --------------------------------------------------------------------------- apublish()


def test_apublish_in_an_async_view_commits_at_once() -> None:
    async def view() -> str:
        return await apublish("order.placed", {"order_id": 7}, message_id="view-1")

    async def served() -> str:
        try:
            return await view()
        finally:  # the thread-sensitive thread of this loop keeps its session otherwise
            await sync_to_async(connections.close_all, thread_sensitive=True)()

    # As an ASGI server runs a view: an event loop with no sync caller above it.
    assert asyncio.run(served()) == "view-1"
    assert outbox_count("view-1") == 1


def test_apublish_joins_a_transaction_reached_through_sync_to_async() -> None:
    def place_order(message_id: str, fail: bool) -> None:
        with transaction.atomic():
            async_to_sync(apublish)("order.placed", {"order_id": 8}, message_id=message_id)
            # Written on this thread's connection, in this transaction: not visible elsewhere.
            assert OutboxMessage.objects.filter(message_id=message_id).exists()
            assert outbox_count(message_id) == 0
            if fail:
                raise RuntimeError("the order is refused")

    async def view(message_id: str, fail: bool) -> None:
        await sync_to_async(place_order, thread_sensitive=True)(message_id, fail)

    async_to_sync(view)("tx-committed", False)
    with pytest.raises(RuntimeError, match="refused"):
        async_to_sync(view)("tx-rolled-back", True)
    assert outbox_count("tx-committed") == 1
    assert outbox_count("tx-rolled-back") == 0


def test_apublish_checks_its_arguments_as_publish_does() -> None:
    with pytest.raises(ValueError, match="routing_key"):
        async_to_sync(apublish)("", {})
    with pytest.raises(TypeError):
        async_to_sync(apublish)("order.placed", {"x": object()})


# --------------------------------------------------------------------------- manage.py consume


@pytest.fixture
def async_consume(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., ConsumeProcess]:
    """``consume`` for processes that register the async handler (``<ns>.async``)."""
    monkeypatch.setenv("RM_TEST_ASYNC_CONSUMERS", "1")
    start: Callable[..., ConsumeProcess] = request.getfixturevalue("consume")
    return start


def async_effects_of(message_ids: list[str]) -> dict[str, list[Effect]]:
    return {m: effects("async-orm", m) for m in message_ids}


def wait_processed(message_ids: list[str], proc: ConsumeProcess, timeout: float = 60) -> None:
    def done() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"consume exited with {proc.returncode}:\n{proc.log()}")
        return ProcessedMessage.objects.filter(
            consumer=ASYNC_CONSUMER, message_id__in=message_ids
        ).count() == len(message_ids)

    wait_until(done, timeout=timeout, interval=0.1, message="the async handler's messages")


def check_one_effect_each(message_ids: list[str], attempt: int = 1) -> list[dict[str, Any]]:
    """Each message took effect once, on ``attempt``, having seen its own transaction."""
    seen = []
    for message_id in message_ids:
        [orm] = effects("async-orm", message_id)
        [sync] = effects("async-sync", message_id)
        assert (orm.attempt, sync.attempt) == (attempt, attempt), message_id
        payload: dict[str, Any] = orm.payload or {}
        assert payload["saw_inbox_row"] and payload["saw_sync_row"], payload
        assert payload["in_atomic_block"], payload
        assert payload["thread"].startswith("rm-worker-"), payload
        assert outbox_count(f"{message_id}.done") == 1
        seen.append(payload)
    return seen


@pytest.mark.slow
def test_consume_runs_async_handlers_in_their_transactions(
    async_consume: Callable[..., ConsumeProcess], ns: str, publisher: Publisher
) -> None:
    proc = async_consume("--queue", f"{ns}.async").wait_consuming()
    publisher.publish(f"rmtest.{ns}", "async.ok", {}, message_id="c-ok")
    publisher.publish(f"rmtest.{ns}", "async.fails", {"fail": 2}, message_id="c-fail")
    wait_processed(["c-ok", "c-fail"], proc)
    check_one_effect_each(["c-ok"])
    # The two failed attempts' writes and apublish() rolled back with them.
    check_one_effect_each(["c-fail"], attempt=3)


@pytest.mark.slow
def test_async_handlers_on_two_worker_threads_each_see_their_own_transaction(
    async_consume: Callable[..., ConsumeProcess], ns: str, publisher: Publisher
) -> None:
    proc = async_consume("--queue", f"{ns}.async", "--concurrency", "2").wait_consuming()
    ids = [f"w-{n}" for n in range(8)]
    for message_id in ids:
        publisher.publish(f"rmtest.{ns}", "async.pair", {"pause": 0.3}, message_id=message_id)
    wait_processed(ids, proc)
    seen = check_one_effect_each(ids)
    # Both worker threads ran async handlers, each on its own session.
    by_thread = {s["thread"]: s["pid"] for s in seen}
    assert len(by_thread) == 2, seen
    assert len(set(by_thread.values())) == 2, seen


@pytest.mark.slow
def test_the_time_limit_interrupts_an_async_handler(
    async_consume: Callable[..., ConsumeProcess], ns: str, publisher: Publisher
) -> None:
    proc = async_consume("--queue", f"{ns}.async").wait_consuming()
    publisher.publish(f"rmtest.{ns}", "async.slow", {"sleep": {"1": 30}}, message_id="slow-1")
    proc.wait_for_log("outcome=timeout", timeout=30)
    wait_processed(["slow-1"], proc)
    # Attempt 1 was interrupted after 1 s of its 30 s sleep and rolled back; attempt 2 ran.
    check_one_effect_each(["slow-1"], attempt=2)
    assert proc.returncode is None, proc.log()  # interrupted, not a process given up on
