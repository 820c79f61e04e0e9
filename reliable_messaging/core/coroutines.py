"""``async def`` handlers, run to completion on the calling thread with asgiref's
``async_to_sync``, so Django's async ORM uses that thread's connection and open transaction.
The thread then waits outside Python, where an asynchronous exception cannot land: an
interrupter calls :func:`wake`, which cancels the coroutine so the exception lands."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

# How many times (every 10 ms) an interrupted call cancels a coroutine that has not ended.
ORPHAN_CANCELS = 100

_lock = threading.Lock()
# How to wake each thread that waits on a coroutine, by thread id.
_wakers: dict[int, Callable[[], None]] = {}


def wake(thread: int) -> None:
    """Cancel the coroutine ``thread`` waits on, if any (safe to call again, or from any thread)."""
    with _lock:
        waker = _wakers.get(thread)
    if waker is not None:
        waker()


class CoroutineHandler:
    """A plain callable that runs the coroutine function ``function`` to its end and returns its
    result; its thread-sensitive sync calls run on the caller's thread."""

    def __init__(self, function: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        from asgiref.sync import async_to_sync  # Django's own dependency; core stays importable

        self.function = function
        self._run = async_to_sync(self._guarded)
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        thread = threading.get_ident()
        try:
            return self._run(thread, *args, **kwargs)
        except BaseException:
            # An interrupt can end this thread's wait while the coroutine still runs (cancelled,
            # its cleanup awaiting a sync call this thread will not run now): cancel it until
            # it ends, so that no coroutine outlives its call, for a bounded time.
            for _ in range(ORPHAN_CANCELS):
                with _lock:
                    if thread not in _wakers:
                        break
                wake(thread)
                time.sleep(0.01)
            raise

    async def _guarded(self, thread: int, *args: Any, **kwargs: Any) -> Any:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: the coroutine is over
                loop.call_soon_threadsafe(task.cancel)

        with _lock:
            _wakers[thread] = cancel
        try:
            return await self.function(*args, **kwargs)
        finally:
            with _lock:
                if _wakers.get(thread) is cancel:
                    del _wakers[thread]
