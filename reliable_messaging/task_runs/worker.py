"""Running tasks in the consumer: the handler of the task queues' consumers, and what the
consumer's stage of tasks (:mod:`reliable_messaging.consuming.task_runs`) writes and signals
around each batch of attempts, in one statement each (``docs/tasks.md#what-it-costs``)."""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import logging
import os
import socket
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from django.db import DatabaseError, router
from django.utils import timezone

from ..core.coroutines import CoroutineHandler
from ..core.envelope import Message
from ..core.registry import ConsumerSpec
from ..exceptions import DatabaseUnavailable, PermanentError
from ..models import TaskRun
from .framework import (
    Task,
    TaskContext,
    TaskResult,
    TaskResultStatus,
    task_backends,
    task_finished,
    task_started,
)
from .naming import MAX_TASK_ID_LENGTH, TaskQueues, task_id_of
from .policies import TaskRetryPolicies
from .results import NotJSON, error_of, json_value, result_of, succeeded, task_of

logger = logging.getLogger(__name__)


class TaskRunMissing(PermanentError):
    """The message names a task whose row is not in the database (deleted, or another
    database): nothing to run, so a dead letter at once."""

    def __init__(self, task_id: str = "") -> None:
        super().__init__(f"no TaskRun {task_id!r}: the task's row is gone")


class ReturnValueNotJSON(PermanentError):
    """The task returned what JSON cannot hold: it would fail the same way again."""

    def __init__(self, detail: str = "the task's return value is not JSON") -> None:
        super().__init__(detail)


def worker_id() -> str:
    """This process, as the results' ``worker_ids`` name it (its pid read at each call: a
    forked child is another worker)."""
    return f"{_hostname()}:{os.getpid()}"[:64]


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


@dataclass(eq=False)
class Attempts:
    """The attempts of one batch on this worker thread, between the stage's ``open`` and
    ``close``: the rows marked RUNNING (``runs``), the values the tasks returned in the current
    transaction (``returned``), and those whose delivery was decided processed, to be written
    SUCCESSFUL before the transaction commits (``succeeded``)."""

    using: str
    runs: dict[str, TaskRun]
    returned: dict[str, Any] = field(default_factory=dict)
    succeeded: dict[str, Any] = field(default_factory=dict)
    # The return value and finish time of each SUCCESSFUL written in the current transaction
    # (for the signal).
    written: dict[str, tuple[Any, dt.datetime]] = field(default_factory=dict)
    # The results ``task_started`` was sent, from which ``task_finished``'s are copied.
    started: dict[str, TaskResult] = field(default_factory=dict)
    _tasks: dict[tuple[Any, ...], Task] = field(default_factory=dict)
    _calls: dict[Callable[..., Any], Callable[..., Any]] = field(default_factory=dict)

    def task_of(self, run: TaskRun) -> Task:
        """The task ``run`` runs (found once per batch for each task and queue)."""
        key = (run.task_path, run.queue_name, run.backend, run.run_after)
        if key not in self._tasks:
            self._tasks[key] = task_of(run)
        return self._tasks[key]

    def call_of(self, task: Task) -> Callable[..., Any]:
        """What runs ``task`` (:func:`call_of`, once per batch for each task)."""
        if task.func not in self._calls:
            self._calls[task.func] = call_of(task)
        return self._calls[task.func]

    def processed(self, task_id: str) -> None:
        """The delivery of ``task_id`` was decided processed: its return value is to be written."""
        if task_id in self.returned:
            self.succeeded[task_id] = self.returned.pop(task_id)

    def write_successes(self) -> None:
        """SUCCESSFUL and the return values of the tasks processed so far, in one statement of
        the caller's transaction."""
        # Taken before the UPDATE: a failed one fails the transaction, and with it these.
        succeeded, self.succeeded = self.succeeded, {}
        if not succeeded:
            return
        at = timezone.now()
        TaskRun.objects.using(self.using).succeed_all(succeeded, at)
        for task_id, value in succeeded.items():
            self.written[task_id] = (value, at)

    def forget(self) -> None:
        """The transaction was rolled back (its batch is decided again): nothing it ran holds."""
        self.returned.clear()
        self.succeeded.clear()
        self.written.clear()


_MESSAGE_FIELDS = tuple(f.name for f in fields(Message))


@dataclass(frozen=True)
class TaskMessage(Message):
    """A task's message as the consumer's stage of tasks hands it to :func:`run_task`
    (``Job.for_handler``): with the :class:`Attempts` of its batch, where its row is."""

    attempts: Attempts | None = None

    @classmethod
    def of(cls, message: Message, attempts: Attempts) -> TaskMessage:
        if type(message) is not Message:
            fields_of = {name: getattr(message, name) for name in _MESSAGE_FIELDS}
            return cls(**fields_of, attempts=attempts)
        # The message's fields taken at once: a frozen dataclass's __init__ sets each through
        # object.__setattr__.
        copy = object.__new__(cls)
        copy.__dict__.update(message.__dict__, attempts=attempts)
        return copy


def run_task(message: Message) -> None:
    """The handler of every task queue: run the task, in the delivery's transaction with its
    inbox row, and write SUCCESSFUL and its return value in that transaction (with the batch's
    others, when the stage of tasks marked it RUNNING and handed it a :class:`TaskMessage`)."""
    task_id = task_id_of(message)
    if task_id is None:
        raise PermanentError(
            f"message_id={message.message_id} names no task_id a task could have (printable "
            f"ASCII, up to {MAX_TASK_ID_LENGTH} characters)"
        )
    if message.message_id != task_id:
        # Every message of a task (its retries and replays too) carries the task's id as its
        # message_id, which the inbox keeps once: another would run the task once more.
        raise PermanentError(
            f"message_id={message.message_id} is not the id of the task it names ({task_id}): "
            "a task's message is published under its task's id"
        )
    attempts = message.attempts if isinstance(message, TaskMessage) else None
    run = None if attempts is None else attempts.runs.get(task_id)
    using = router.db_for_write(TaskRun) if attempts is None else attempts.using
    if run is None:  # not started by the stage (a duplicate it skipped, a row gone): read it
        run = TaskRun.objects.using(using).filter(pk=task_id).first()
        if run is None:
            raise TaskRunMissing(task_id)
    if (named := message.payload.get("task")) != run.task_path:
        # What the message says it runs is not what its row runs: neither is trusted.
        raise PermanentError(
            f"message_id={message.message_id} names task {named!r}, but the row of task "
            f"{task_id} is of {run.task_path}"
        )
    if attempts is None:
        task = task_of(run)
        call = call_of(task)
    else:
        task = attempts.task_of(run)
        call = attempts.call_of(task)
    if task.takes_context:
        value = call(TaskContext(task_result=result_of(run, task)), *run.args, **run.kwargs)
    else:
        value = call(*run.args, **run.kwargs)
    try:
        stored = json_value(value)
    except NotJSON as exc:
        raise ReturnValueNotJSON(str(exc)) from exc
    if attempts is not None and task_id in attempts.runs:
        attempts.returned[task_id] = stored  # written once its delivery is decided processed
    else:
        TaskRun.objects.using(using).succeed_all({task_id: stored}, timezone.now())


def call_of(task: Task) -> Callable[..., Any]:
    """What runs ``task``: its function, or an async def one's through CoroutineHandler, not the
    framework's ``Task.call``, whose wait blocks the thread where the time limit's interrupt
    cannot land."""
    return CoroutineHandler(task.func) if inspect.iscoroutinefunction(task.func) else task.func


def consumer_specs(queues: TaskQueues) -> list[ConsumerSpec]:
    """One consumer per task queue of a backend, bound by the queue's own name."""
    return [
        ConsumerSpec(
            name=queues.consumer_name(queue_name),
            queue=queues.amqp_queue(queue_name),
            handler=run_task,
            bindings=(queues.amqp_queue(queue_name),),
            max_attempts=queues.max_attempts,
            retry_delays=queues.retry_delays,
            retry_policy=TaskRetryPolicies(queues),
            priorities=True,
        )
        for queue_name in queues.queues
    ]


def start_attempts(using: str, paths: Mapping[str, Collection[str]]) -> Attempts:
    """Before the attempts' transaction: RUNNING, committed (so visible while the tasks run),
    then ``task_started``; the batch's :class:`Attempts`, which the stage of tasks keeps as its
    state until :func:`end_attempts`. ``paths``: the task paths its messages name, by task id
    (a row whose task none names is not started). A database that cannot take the write holds
    the deliveries."""
    try:
        runs = TaskRun.objects.using(using).start_attempts(
            paths, worker_id(), timezone.now(), paths=paths
        )
    except DatabaseError as exc:
        raise DatabaseUnavailable(f"could not mark tasks RUNNING: {exc}") from exc
    attempts = Attempts(using, {run.pk: run for run in runs})
    if task_started.receivers:  # else no result to build
        results = _results(runs, attempts)
        attempts.started.update((result.id, result) for result in results)
        _send(task_started, results)
    return attempts


def end_attempts(attempts: Attempts, processed: Iterable[str]) -> None:
    """After the batch: a task of ``processed`` (decided so, committed) whose SUCCESSFUL was
    not written in its transaction (none should be) is written now rather than left RUNNING."""
    left = {
        task_id: attempts.succeeded[task_id]
        for task_id in processed
        if task_id in attempts.succeeded
    }
    if left:
        logger.error(
            "tasks %s: their SUCCESSFUL was not written in their transaction; writing it now",
            ", ".join(left),
        )
        attempts.succeeded = left
        attempts.write_successes()


def record_retry(using: str, task_id: str, error: BaseException | None) -> None:
    """In the attempt's transaction: the attempt's error, and READY for the next one. FAILED
    is written with the dead letter (``dead_letters.record.record_dead_letter``), whichever path
    records it."""
    TaskRun.objects.using(using).fail_attempt(task_id, None if error is None else error_of(error))


def take_back_attempt(using: str, task_id: str) -> None:
    """In the attempt's transaction: the delivery was put aside before the task ran (another
    worker holds it), so this worker's attempt is not one."""
    TaskRun.objects.using(using).take_back_attempt(task_id, worker_id())


def send_finished(attempts: Attempts, task_ids: Iterable[str]) -> None:
    """After the commit: ``task_finished`` for the tasks of ``task_ids`` that the batch
    processed (their rows as the batch wrote them, or read back when the handler wrote its own).
    A FAILED one is signalled by its dead letter (:func:`send_failed`)."""
    if not task_finished.receivers:
        return  # nobody listens: no need to read the rows back
    results: list[TaskResult] = []
    unknown = []
    for task_id in task_ids:
        if task_id not in attempts.written:
            unknown.append(task_id)
        elif task_id in attempts.started:
            results.append(succeeded(attempts.started[task_id], *attempts.written[task_id]))
        else:  # with the SUCCESSFUL written since it was read
            results.extend(_results([attempts.runs[task_id]], attempts, attempts.written))
    if unknown:
        rows = TaskRun.objects.using(attempts.using).filter(
            pk__in=unknown, status=TaskResultStatus.SUCCESSFUL
        )
        results.extend(_results(rows, attempts))
    _send(task_finished, results)


def send_failed(using: str, task_id: str) -> None:
    """After the commit of the dead letter that made ``task_id`` FAILED
    (:func:`~.failures.fail_task_of`): ``task_finished`` with its row as committed. A database
    that cannot be read then is logged: the dead letter and the FAILED row stand."""
    if not task_finished.receivers:
        return
    try:
        run = TaskRun.objects.using(using).filter(pk=task_id).first()
    except DatabaseError:
        logger.exception("task %s: could not read its FAILED row to signal it", task_id)
        return
    if run is not None and run.status == TaskResultStatus.FAILED:
        _send(task_finished, _results([run], None))


def _results(
    runs: Iterable[TaskRun],
    attempts: Attempts | None,
    written: dict[str, tuple[Any, dt.datetime]] | None = None,
) -> list[TaskResult]:
    """The framework's results of ``runs`` (as ``written``, the SUCCESSFUL written since a run
    was read, leaves it); a run whose result cannot be built is logged and left out."""
    results = []
    for run in runs:
        try:
            task = task_of(run) if attempts is None else attempts.task_of(run)
            results.append(result_of(run, task, None if written is None else written.get(run.pk)))
        except Exception:
            logger.exception("task %s: could not signal its state %s", run.id, run.status)
    return results


def _send(signal: Any, results: Iterable[TaskResult]) -> None:
    """Send ``signal`` for each result; a receiver's failure is logged, never a delivery's."""
    senders: dict[str, type] = {}  # the backend's class, found once per backend
    for result in results:
        try:
            if result.backend not in senders:
                senders[result.backend] = type(task_backends[result.backend])
            replies = signal.send_robust(senders[result.backend], task_result=result)
        except Exception:
            logger.exception("task %s: could not signal its state %s", result.id, result.status)
            continue
        for receiver, reply in replies:
            if isinstance(reply, Exception):
                logger.error(
                    "task %s: the receiver %r of its state %s failed: %r",
                    result.id,
                    receiver,
                    result.status,
                    reply,
                    exc_info=reply,
                )
