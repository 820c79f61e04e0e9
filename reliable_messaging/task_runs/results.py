"""A ``TaskRun`` row as the framework's ``TaskResult``, and the other way round for what a row
stores of an error or a value."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import traceback
from typing import Any

from django.utils.module_loading import import_string

from ..choices import TaskRunStatus
from ..models import TaskRun
from .framework import InvalidTask, Task, TaskError, TaskResult, TaskResultStatus


class NotJSON(ValueError):
    """A value that would not come back the same from JSON."""

    def __init__(self, what: str = "the value is not JSON") -> None:
        super().__init__(what)


def json_value(value: Any) -> Any:
    """``value`` as JSON stores it: tuples become lists; anything that would not come back
    equal (a Decimal, a datetime, a set, a non-string key, NaN) raises :class:`NotJSON`. The
    framework promises JSON in and out, and a worker on another host gets only what JSON
    carries, so nothing is converted behind the caller's back."""
    if type(value) in _SCALARS or (type(value) is float and math.isfinite(value)):
        if type(value) is str and not _storable(value):
            raise NotJSON(_UNSTORABLE.format(value))
        return value  # comes back from JSON as it is
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise NotJSON(f"{value!r} is not JSON: {exc}") from exc
    back = json.loads(text)
    if back != _as_lists(value):
        raise NotJSON(f"{value!r} does not come back from JSON as it went in")
    if not _storable(back):
        raise NotJSON(_UNSTORABLE.format(value))
    return back


_SCALARS = frozenset({str, int, bool, type(None)})
_UNSTORABLE = (
    "{!r} holds a NUL character or a lone surrogate, which a database's JSON column cannot store"
)


def _storable(value: Any) -> bool:
    """Whether every string of the JSON ``value`` (keys included) is text PostgreSQL's jsonb
    takes: no NUL, no lone surrogate."""
    if type(value) is str:
        if value.isascii():
            return "\x00" not in value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return "\x00" not in value
    if type(value) is list:
        return all(_storable(item) for item in value)
    if type(value) is dict:
        return all(_storable(key) and _storable(item) for key, item in value.items())
    return True


def _as_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_as_lists(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_lists(item) for key, item in value.items()}
    return value


def error_of(exc: BaseException) -> dict[str, str]:
    """What a row keeps of a failed attempt: the framework's ``TaskError`` fields."""
    kind = type(exc)
    return {
        "exception_class_path": f"{kind.__module__}.{kind.__qualname__}",
        "traceback": "".join(traceback.format_exception(exc)),
    }


def task_at(path: str) -> Task:
    """The module-level task at ``path`` (raises ImportError, or InvalidTask for another
    object there)."""
    found = import_string(path)
    if not isinstance(found, Task):
        raise InvalidTask(f"{path} is not a task (decorate the function with @task)")
    return found


def task_of(run: TaskRun) -> Task:
    """The task of ``run``, on the queue and backend it was enqueued with."""
    task = task_at(run.task_path)
    if (task.queue_name, task.backend) != (run.queue_name, run.backend):
        task = task.using(queue_name=run.queue_name, backend=run.backend)
    if run.run_after is not None:
        task = task.using(run_after=run.run_after)
    return task


def result_of(
    run: TaskRun, task: Task | None = None, succeeded: tuple[Any, dt.datetime] | None = None
) -> TaskResult:
    """``run`` as the framework's result (``task``: its task, when the caller has it;
    ``succeeded``: the return value and finish time of a SUCCESSFUL written since ``run`` was
    read, so that the row need not be copied or read again)."""
    status, finished_at, value = run.status, run.finished_at, run.return_value
    if succeeded is not None:
        status = TaskRunStatus.SUCCESSFUL
        value, finished_at = succeeded
    result: TaskResult = TaskResult(
        task=task if task is not None else task_of(run),
        id=run.id,
        status=_STATUSES[status],
        enqueued_at=run.enqueued_at,
        started_at=run.started_at,
        finished_at=finished_at,
        last_attempted_at=run.last_attempted_at,
        args=list(run.args),
        kwargs=dict(run.kwargs),
        backend=run.backend,
        errors=[TaskError(**error) for error in run.errors],
        worker_ids=list(run.worker_ids),
    )
    if status == TaskRunStatus.SUCCESSFUL:
        # The framework's result has no public setter of its return value: its own backends
        # set the field as here.
        object.__setattr__(result, "_return_value", value)
    return result


_STATUSES = {status.value: status for status in TaskResultStatus}
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(TaskResult))


def succeeded(started: TaskResult, value: Any, at: dt.datetime) -> TaskResult:
    """``started`` (the RUNNING result of an attempt) as that attempt's SUCCESSFUL one, which
    differs only in these three fields: a copy, cheaper than building and normalizing anew."""
    result = object.__new__(type(started))
    for name in _RESULT_FIELDS:
        object.__setattr__(result, name, getattr(started, name))
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", at)
    object.__setattr__(result, "_return_value", value)
    return result
