"""The django-tasks-db side of ``bench/tasks.py``, run by it with the interpreter of a
virtualenv holding django-tasks-db (``--taskdb-python``), never the project's. Each command
prints one JSON object:

    _taskdb.py enqueue COUNT OFFSET    seconds for COUNT business transactions of one row and
                                       one .enqueue()
    _taskdb.py run COUNT WORKERS       COUNT one-row tasks run by WORKERS db_worker processes
    _taskdb.py latency COUNT PAUSE INTERVAL
                                       commit to task start, one idle db_worker polling every
                                       INTERVAL s, a task committed every PAUSE s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
os.environ["DJANGO_SETTINGS_MODULE"] = "_taskdb_settings"
os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(ROOT)])
sys.path[:0] = [str(BENCH), str(ROOT)]

import django  # noqa: E402

django.setup()
from django.core.management import call_command  # noqa: E402
from django.db import transaction  # noqa: E402
from django_tasks_db.models import DBTaskResult  # noqa: E402

from tests.testapp.models import Effect  # noqa: E402

call_command("migrate", "django_tasks_database", verbosity=0)


def workers(count: int, *options: str) -> list[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "django", "db_worker", "-v", "0", "--no-startup-delay"]
    return [
        subprocess.Popen([*command, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(count)
    ]


def enqueue(count: int, offset: int) -> dict[str, float]:
    from _taskdb_work import one_row

    started = time.perf_counter()
    for n in range(offset, offset + count):
        with transaction.atomic():
            Effect.objects.create(consumer="bench.order", message_id=str(n), attempt=1)
            one_row.enqueue(n)
    return {"seconds": time.perf_counter() - started}


def run(count: int, processes: int) -> dict[str, float]:
    from _taskdb_work import one_row
    from django.db.models import Max, Min

    DBTaskResult.objects.all().delete()
    for n in range(count):
        one_row.enqueue(20_000_000 + n)
    started = time.perf_counter()
    for worker in workers(processes, "--batch", "--interval", "0.01"):
        worker.wait(600)
    wall = time.perf_counter() - started
    span = DBTaskResult.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
    done = DBTaskResult.objects.filter(status="SUCCESSFUL").count()
    return {
        "wall_seconds": wall,
        "run_seconds": (span["last"] - span["first"]).total_seconds(),
        "successful": done,
    }


def latency(count: int, pause: float, interval: float) -> dict[str, list[float]]:
    from _taskdb_work import stamp

    Effect.objects.filter(consumer="bench.taskdb-latency").delete()
    (worker,) = workers(1, "--interval", str(interval))
    try:
        time.sleep(3)  # the worker starts and polls
        committed: dict[str, float] = {}
        for n in range(count):
            with transaction.atomic():
                stamp.enqueue(n)
            committed[str(n)] = time.time()
            time.sleep(pause)
        deadline = time.monotonic() + 60
        rows = Effect.objects.filter(consumer="bench.taskdb-latency")
        while rows.count() < count and time.monotonic() < deadline:
            time.sleep(0.2)
        started: dict[str, Any] = dict(rows.values_list("message_id", "payload"))
    finally:
        worker.terminate()
        worker.wait(30)
    return {"ms": [(started[n] - committed[n]) * 1000 for n in committed if n in started]}


if __name__ == "__main__":
    command, *numbers = sys.argv[1:]
    if command == "enqueue":
        print(json.dumps(enqueue(int(numbers[0]), int(numbers[1]))))
    elif command == "run":
        print(json.dumps(run(int(numbers[0]), int(numbers[1]))))
    else:
        print(json.dumps(latency(int(numbers[0]), float(numbers[1]), float(numbers[2]))))
