"""The tasks the task backend's tests enqueue: module level, so the worker imports them by path.

Each records an ``Effect`` in the attempt's transaction, so a task run twice shows twice and a
failed attempt's effect rolls back with it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

from django.db import connection

from reliable_messaging.task_runs.framework import TaskContext, task
from tests.testapp.models import Effect


def _effect(name: str, context: TaskContext | None = None, payload: Any = None) -> None:
    result = context.task_result if context is not None else None
    Effect.objects.create(
        consumer=f"task.{name}",
        message_id=result.id if result is not None else "",
        attempt=context.attempt if context is not None else 0,
        payload=payload,
    )


@task(takes_context=True)
def add(context: TaskContext, a: int, b: int) -> int:
    _effect("add", context, [a, b])
    return a + b


@task(takes_context=True)
def greet(context: TaskContext, *, name: str) -> dict[str, str]:
    _effect("greet", context, name)
    return {"greeting": f"hello {name}"}


class Flaky(Exception):
    """A failure that goes away after a few attempts."""


@task(takes_context=True)
def fails_before(context: TaskContext, attempts: int) -> str:
    """Fails its first ``attempts - 1`` attempts, then succeeds."""
    _effect("fails_before", context, attempts)
    if context.attempt < attempts:
        raise Flaky(f"attempt {context.attempt} of {attempts}")
    return f"succeeded at attempt {context.attempt}"


@task
def not_json_back() -> Any:
    return {1, 2}


@task
def breaks_a_deferred_constraint() -> None:
    """Writes what a constraint checked at commit refuses (its table is the test's)."""
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO rm_test_deferred (k) VALUES (1), (1)")


@task
def unstorable_back(kind: str) -> Any:
    """JSON, but text no JSON column can store: a NUL, or a lone surrogate (in a key)."""
    return ["a\x00b"] if kind == "nul" else {"\udcff": 1}


# Set by a test to let ``waits`` finish (the worker runs in a thread of the test's process).
GATE = threading.Event()


@task(takes_context=True)
def waits(context: TaskContext) -> str:
    _effect("waits", context)
    if not GATE.wait(30):
        raise TimeoutError("the test never opened the gate")
    return "done"


def plain_function() -> None:
    """Not decorated: a task made of it elsewhere is not what the worker finds at its path."""


@task(takes_context=True)
async def async_fails_before(context: TaskContext, attempts: int) -> str:
    """``fails_before`` as a coroutine: its effect through the async ORM, in the attempt's
    transaction (a failed attempt's effect rolls back with it)."""
    await Effect.objects.acreate(
        consumer="task.async_fails_before",
        message_id=context.task_result.id,
        attempt=context.attempt,
        payload=attempts,
    )
    if context.attempt < attempts:
        raise Flaky(f"attempt {context.attempt} of {attempts}")
    return f"succeeded at attempt {context.attempt}"


@task(takes_context=True)
async def async_sleeps_at_first(context: TaskContext) -> str:
    """Awaits far past any short time limit on its first attempt, returns on the next."""
    if context.attempt == 1:
        await asyncio.sleep(60)
    return f"returned at attempt {context.attempt}"


@task
def kills_its_process() -> None:
    """Dies as the OOM killer or a segfault would kill it: run only by a ``manage.py consume``
    subprocess of a test, never in the test's own process."""
    os.kill(os.getpid(), signal.SIGKILL)


# While an Effect row of this name exists, ``pays_while_up`` fails (its downstream is down).
DOWNSTREAM_DOWN = "tasks-downstream-down"


@task(takes_context=True)
def pays_while_up(context: TaskContext, n: int) -> int:
    """Fails while the downstream is down, else records its effect."""
    if Effect.objects.filter(consumer="switch", message_id=DOWNSTREAM_DOWN).exists():
        raise ConnectionError("the downstream is down")
    _effect("pays_while_up", context, n)
    return n


@task
def always_fails(n: int) -> None:
    """Fails every attempt (its retry policy is given by the tests)."""
    _effect("always_fails", None, n)
    raise Flaky(f"always_fails({n})")


@task
def fails_with_own_policy(n: int) -> None:
    """Fails every attempt; the tests decorate it again with a policy of its own."""
    _effect("fails_with_own_policy", None, n)
    raise Flaky(f"fails_with_own_policy({n})")


def not_a_task(n: int) -> int:
    """Module level and undecorated: what the tests decorate with bad options."""
    return n
