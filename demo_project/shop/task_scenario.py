"""The demo's ``django.tasks`` part: tasks enqueued from the transactions of requests (some
rolled back), run by ``manage.py consume``; one fails then succeeds on its retry, one fails for
good and is replayed with ``manage.py replay_dead_letters``; ``get_result()`` of each printed.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from django.core.management import call_command
from django.db import transaction

from demo_project import tracing as demo_tracing
from reliable_messaging.task_runs.framework import TaskResult, TaskResultDoesNotExist, task_backends
from reliable_messaging.task_runs.naming import task_consumer_name

from .background_tasks import COURIER_OPEN, award_points, book_courier, sync_stock
from .workers import Worker, stop_all

Say = Callable[[str], None]
POLL_INTERVAL = 0.3
STOP_TIMEOUT = 40.0
FINAL = ("SUCCESSFUL", "FAILED")


class RequestCancelled(Exception):
    """Raised inside a request's transaction, after the enqueue, to roll the request back."""


@dataclass(frozen=True)
class TaskFacts:
    """What the task part saw: the results read back, the rolled-back tasks' ids, whether a
    rolled-back task could be read back (it must not), and why the part did not finish."""

    results: tuple[TaskResult, ...]
    rolled_back: tuple[str, ...]
    rolled_back_found: int
    exit_codes: dict[str, int]
    unfinished: str = ""


def _request(path: str, enqueue: Callable[[], TaskResult], *, cancel: bool = False) -> TaskResult:
    """A view's transaction that enqueues one task (rolled back when ``cancel``)."""
    with demo_tracing.web_request("POST", path):
        try:
            with transaction.atomic():
                result = enqueue()
                if cancel:
                    raise RequestCancelled
        except RequestCancelled:
            pass
    return result


def _wait(
    results: Sequence[TaskResult],
    wanted: Callable[[TaskResult], bool],
    timeout: float,
    workers: Sequence[Worker],
) -> str:
    """Refresh ``results`` until each is ``wanted``; "" then, or why not."""
    deadline = time.monotonic() + timeout
    while True:
        for result in results:
            result.refresh()
        if all(wanted(result) for result in results):
            return ""
        for worker in workers:
            if not worker.running:
                return f"manage.py {worker.name} exited before the tasks finished"
        if time.monotonic() >= deadline:
            waiting = [f"{r.task.name} {r.status}" for r in results if not wanted(r)]
            return f"tasks not finished within {timeout:g} s: {waiting}"
        time.sleep(POLL_INTERVAL)


def run_task_part(order_ids: Sequence[int], log_dir: Path, timeout: float, say: Say) -> TaskFacts:
    """Enqueue the tasks, run relay and consume until each has its outcome, replay the one that
    failed for good once its service is back, and read every result back."""
    COURIER_OPEN.unlink(missing_ok=True)  # the courier's service is down for now
    first, second = order_ids[0], order_ids[1]
    results = [
        _request(f"/orders/{order_id}/points", partial(award_points.enqueue, order_id))
        for order_id in order_ids[:3]
    ]
    rolled_back = [
        _request(
            f"/orders/{order_id}/points", partial(award_points.enqueue, order_id), cancel=True
        ).id
        for order_id in order_ids[3:5]
    ]
    results.append(_request(f"/orders/{first}/stock", partial(sync_stock.enqueue, first)))
    courier = _request(f"/orders/{second}/courier", partial(book_courier.enqueue, second))
    results.append(courier)
    say(
        f"Enqueued {len(results)} django.tasks tasks from request transactions and rolled back "
        f"{len(rolled_back)}; the courier's booking service is down"
    )
    workers = [
        Worker.manage("relay-tasks", ["relay"], log_dir),
        Worker.manage("consume-tasks", ["consume", "--concurrency", "1"], log_dir),
    ]
    try:
        unfinished = _wait(results, lambda r: str(r.status) in FINAL, timeout, workers)
        if not unfinished:
            say(f"  book_courier is {courier.status}; the service is back: replaying it")
            COURIER_OPEN.touch()
            call_command(
                "replay_dead_letters",
                "--consumer",
                task_consumer_name(courier.backend, courier.task.queue_name),
                stdout=io.StringIO(),
            )
            unfinished = _wait([courier], lambda r: str(r.status) == "SUCCESSFUL", timeout, workers)
    finally:
        exit_codes = stop_all(workers, STOP_TIMEOUT)
    backend = task_backends["default"]
    found = 0
    for task_id in rolled_back:
        try:
            backend.get_result(task_id)
            found += 1
        except TaskResultDoesNotExist:
            pass
    return TaskFacts(
        results=tuple(backend.get_result(r.id) for r in results),
        rolled_back=tuple(rolled_back),
        rolled_back_found=found,
        exit_codes=exit_codes,
        unfinished=unfinished,
    )


def result_lines(facts: TaskFacts) -> list[str]:
    """``get_result()`` of each task, one line each, then the rolled-back ones."""
    lines = ["django.tasks results (get_result() of each, read back by the backend):"]
    for result in facts.results:
        args = ", ".join(repr(a) for a in result.args)
        value: Any = result.return_value if str(result.status) == "SUCCESSFUL" else "-"
        errors = ", ".join(e.exception_class_path.rsplit(".", 1)[-1] for e in result.errors)
        lines.append(
            f"  {result.task.name}({args}): {result.status}, attempts {result.attempts}, "
            f"return value {value!r}" + (f", errors [{errors}]" if errors else "")
        )
    lines.append(
        f"  rolled back: {len(facts.rolled_back)} enqueued, "
        f"{facts.rolled_back_found} of them found by get_result() (expected 0)"
    )
    return lines


def task_problems(facts: TaskFacts) -> list[str]:
    """What the task part got wrong, in words."""
    found = [facts.unfinished] if facts.unfinished else []
    found += [
        f"task {r.task.name}({r.args}) ended {r.status}"
        for r in facts.results
        if str(r.status) != "SUCCESSFUL"
    ]
    retried = [r for r in facts.results if r.task.name == "sync_stock"]
    if any(r.attempts != 2 or len(r.errors) != 1 for r in retried):
        found.append("sync_stock did not succeed at its second attempt")
    if facts.rolled_back_found:
        found.append(f"{facts.rolled_back_found} task(s) of rolled-back requests were stored")
    found += [
        f"manage.py {name} exited with code {code}"
        for name, code in facts.exit_codes.items()
        if code
    ]
    return found
