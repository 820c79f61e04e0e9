"""``async def`` handlers as plain callables (``reliable_messaging.core.coroutines``): their
thread-sensitive sync calls run on the calling thread, and a time limit's interrupt ends them.

The time limit runs on a ``TimeLimits`` of its own, its grace far beyond any test here, as in
tests/unit/consuming/test_time_limit.py. No timing is asserted beyond generous bounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from asgiref.sync import sync_to_async

from reliable_messaging.consuming.time_limit import TimeLimits
from reliable_messaging.core.coroutines import CoroutineHandler
from reliable_messaging.core.registry import ConsumerRegistry, consumer
from reliable_messaging.exceptions import HandlerTimeout
from tests.support import wait_until

# Interrupted "in time": far below the 10 s a handler would run, far above the 0.3 s limit.
IN_TIME = 5.0


@pytest.fixture
def limits() -> Iterator[TimeLimits]:
    tl = TimeLimits()
    tl.start(grace=600.0)  # never hopeless within a test: it would end the process
    yield tl
    tl.stop()


def test_sync_calls_of_the_coroutine_run_on_the_calling_thread() -> None:
    async def handler(value: int) -> tuple[str, int]:
        name = await sync_to_async(lambda: threading.current_thread().name)()
        return name, value * 2

    call = CoroutineHandler(handler)
    seen: list[tuple[str, int]] = []
    worker = threading.Thread(target=lambda: seen.append(call(21)), name="rm-worker-test")
    worker.start()
    worker.join(10)
    assert seen == [("rm-worker-test", 42)]


def test_consumer_wraps_an_async_def_handler_and_keeps_the_function() -> None:
    consumers = ConsumerRegistry()

    async def handler(message: object) -> None:
        pass

    assert consumer("q.async", registry=consumers)(handler) is handler
    spec = consumers.get(f"{__name__}.{handler.__qualname__}")
    assert isinstance(spec.handler, CoroutineHandler)
    assert spec.function is handler
    consumer("q.async", registry=consumers)(handler)  # the same function again: no conflict


def test_the_time_limit_interrupts_a_coroutine_awaiting(limits: TimeLimits) -> None:
    async def handler() -> None:
        await asyncio.sleep(10)

    started = time.monotonic()
    with pytest.raises(HandlerTimeout), limits.limit(0.3, "tl.async", "sleep-1"):
        CoroutineHandler(handler)()
    assert time.monotonic() - started < IN_TIME
    assert limits.overdue() == []


def test_an_interrupted_coroutine_whose_cleanup_awaits_sync_code_does_not_outlive_its_call(
    limits: TimeLimits,
) -> None:
    ended = threading.Event()

    async def handler() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            try:  # the interrupt may leave the calling thread before it runs this
                await sync_to_async(time.sleep)(0.05)
            finally:
                ended.set()

    with pytest.raises(HandlerTimeout), limits.limit(0.3, "tl.async", "cleanup-1"):
        CoroutineHandler(handler)()
    wait_until(ended.is_set, timeout=IN_TIME, message="the coroutine's end")
