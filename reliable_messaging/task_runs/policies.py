"""A task's own retry policy, from ``@task(max_attempts=3, retry_delays=[1, 5])`` or
``OPTIONS["TASK_RETRIES"]``, looked up for each failed delivery
(``docs/tasks.md#a-tasks-own-retries``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.envelope import Message
from ..core.registry import RetryPolicy
from .framework import InvalidTask, Task
from .naming import TaskQueues, delays_of, policy_problems
from .results import task_at


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliableTask(Task):  # type: ignore[type-arg]  # generic in the backport only
    """The backend's tasks: the framework's, with the retry policy of ``@consumer``
    (``max_attempts``, ``retry_delays``; None: the backend's ``MAX_ATTEMPTS`` and
    ``RETRY_DELAYS``). The backend's ``validate_task`` refuses values that cannot work."""

    max_attempts: int | None = None
    retry_delays: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.retry_delays, list):  # hashable, as the frozen task must be
            object.__setattr__(self, "retry_delays", tuple(self.retry_delays))
        # The framework's check, through the backend (slots: no zero-argument super()).
        Task.__post_init__(self)

    @property
    def module_path(self) -> str:
        """The framework's, worked out once per function (the log receivers of a task's two
        signals ask for it at each run)."""
        path = _MODULE_PATHS.get(self.func)
        if path is None:
            path = _MODULE_PATHS[self.func] = Task.module_path.__get__(self)
        return path


_MODULE_PATHS: dict[Any, str] = {}


def task_policy_problems(task: Task[Any, Any]) -> list[str]:
    """What is wrong with the retry policy ``task`` was decorated with."""
    max_attempts = getattr(task, "max_attempts", None)
    delays = getattr(task, "retry_delays", None)
    if max_attempts is None and delays is None:
        return []  # the backend's policy (every enqueue passes here)
    return policy_problems(
        f"@task({{}}=...) of {task.module_path}",
        max_attempts,
        delays,
        names=("max_attempts", "retry_delays"),
    )


def named_task_problems(alias: str, queues: TaskQueues) -> list[str]:
    """``OPTIONS["TASK_RETRIES"]`` naming what is not a task of the backend ``alias``."""
    found = []
    for path, _ in queues.task_retries:
        where = f"TASKS[{alias!r}]['OPTIONS']['TASK_RETRIES'] names {path!r}"
        try:
            task = task_at(path)
        except (ImportError, InvalidTask, ValueError) as exc:
            found.append(f"{where}, which is not a task: {exc}")
            continue
        if task.backend != alias:
            found.append(f"{where}, a task of the backend {task.backend!r}, not of this one.")
    return found


@dataclass(frozen=True)
class TaskRetryPolicies:
    """The retry policy of each failed delivery of a backend's task queue: the task's entry in
    ``OPTIONS["TASK_RETRIES"]``, key by key over its decorator's ``max_attempts`` and
    ``retry_delays``; None (the backend's) for a task with neither, or one not found."""

    queues: TaskQueues

    def __call__(self, message: Message) -> RetryPolicy | None:
        payload = message.payload
        path = payload.get("task") if isinstance(payload, Mapping) else None
        if not isinstance(path, str):
            return None
        # Never imported here: the path is the message's, which a foreign producer may write
        # (an import runs a module's code). A task whose attempt just ran is imported already.
        module, _, name = path.rpartition(".")
        task = getattr(sys.modules.get(module), name, None) if module else None
        if not isinstance(task, Task):
            return None
        named = dict(self.queues.task_retries).get(path, RetryPolicy())
        max_attempts = named.max_attempts or getattr(task, "max_attempts", None)
        delays = named.retry_delays
        if delays is None:
            delays = getattr(task, "retry_delays", None)
        if max_attempts is None and delays is None:
            return None
        return RetryPolicy(max_attempts, delays_of(delays))
