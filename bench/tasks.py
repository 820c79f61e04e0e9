"""django.tasks benchmark (issue 47): what enqueueing a task costs a business transaction, how
fast the consumer runs tasks against the same work as a plain ``@consumer`` handler and against
django-tasks-db's worker, and the latency from commit to a task's start.

    .venv/bin/python bench/tasks.py [--transactions 1000] [--tasks 2000] [--rounds 3]
        [--concurrency 2] [--latency-tasks 100] [--latency-pause 0.1]
        [--taskdb-python /tmp/bench-taskdb-venv/bin/python]

1. Enqueue inside a business transaction: ``--transactions`` transactions of one business row
   (``tests.testapp.Effect``) plus ``publish()`` of a message, ``.enqueue()`` of one of our
   tasks, or ``.enqueue()`` of a django-tasks-db task with the same arguments, the kinds
   alternated round by round; microseconds per transaction (median of the rounds), ratios.
2. Tasks run per second: ``--tasks`` tasks of one row (``bench/_task_work.py``) enqueued and
   relayed beforehand, then run by the consumer's engine (ConsumerService, what ``manage.py
   consume`` runs) in this process; against as many messages to a ``@consumer`` handler that
   writes the same row, relayed the same way, and as many django-tasks-db tasks run by
   ``--concurrency`` ``db_worker --batch`` processes (rate from its rows' first start to last
   finish, so without the processes' start-up); alternated round by round, the median rate of
   each and the ratios (the issue's goal: tasks / handler >= 0.9).
3. Latency from commit to task start, idle: ``--latency-tasks`` tasks, one committed every
   ``--latency-pause`` s, each writing ``time.time()`` when it starts; ours with a ``manage.py
   relay`` process (LISTEN/NOTIFY) and the consumer running, django-tasks-db with one
   ``db_worker`` at its default poll interval (1 s) and at 0.1 s; p50 and p99.

django-tasks-db runs with the interpreter ``--taskdb-python`` names (``bench/_taskdb.py``), a
virtualenv of its own, never the project's::

    python3.11 -m venv /tmp/bench-taskdb-venv
    /tmp/bench-taskdb-venv/bin/pip install django-tasks-db "django-tasks==0.12.*" \
        "django==5.2.*" "psycopg[binary]"

Without it, its parts are skipped. Everything runs on its own database (``RM_BENCH_DB``,
``rm_bench_tasks`` by default) and a fresh exchange.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RM_BENCH_DB", "rm_bench_tasks")
os.environ["RM_TEST_TASKS"] = "1"  # tests/settings.py: TASKS names our backend
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    BROKER_URL,
    DATABASE_URL,
    ROOT,
    describe_machine,
    median,
    percentile,
    setup_django,
    subprocess_env,
)
from consume import run_service

BENCH = Path(__file__).resolve().parent
TASKDB_PYTHON = os.environ.get("RM_BENCH_TASKDB_PYTHON", "/tmp/bench-taskdb-venv/bin/python")


def enqueue_round(kind: str, count: int, offset: int) -> float:
    """Seconds for ``count`` business transactions each publishing or enqueueing once."""
    from _task_work import one_row
    from django.db import transaction

    from reliable_messaging import publish
    from tests.testapp.models import Effect

    started = time.perf_counter()
    for n in range(offset, offset + count):
        with transaction.atomic():
            Effect.objects.create(consumer="bench.order", message_id=str(n), attempt=1)
            if kind == "publish":
                publish("bench.one-row", {"n": n})
            else:
                one_row.enqueue(n)
    return time.perf_counter() - started


def taskdb(python: str, *arguments: object) -> dict:
    """One command of ``bench/_taskdb.py`` under django-tasks-db's interpreter; its JSON."""
    done = subprocess.run(
        [python, str(BENCH / "_taskdb.py"), *map(str, arguments)],
        env={**os.environ, "DATABASE_URL": DATABASE_URL},
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def drain_outbox() -> int:
    from reliable_messaging.publishing.relay import build_relay

    return build_relay(once=True).run().sent


def our_latency(namespace: str, specs: list, count: int, pause: float) -> list[float]:
    """Commit to task start (ms) of ``count`` tasks committed ``pause`` s apart, with a relay
    process and the consumer idle between them."""
    import threading

    from _task_work import stamp
    from django.db import transaction

    from reliable_messaging.consuming.service import ConsumerService
    from tests.testapp.models import Effect

    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay"],
        env=subprocess_env(namespace, RM_TEST_TASKS="1", RM_LOG_LEVEL="WARNING"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    service = ConsumerService(specs, concurrency=2)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        time.sleep(3)  # the relay listens, the consumer consumes
        committed: dict[str, float] = {}
        for n in range(count):
            with transaction.atomic():
                stamp.enqueue(n)
            committed[str(n)] = time.time()
            time.sleep(pause)
        rows = Effect.objects.filter(consumer="bench.latency")
        deadline = time.monotonic() + 60
        while rows.count() < count and time.monotonic() < deadline:
            time.sleep(0.2)
        started: dict[str, Any] = dict(rows.values_list("message_id", "payload"))
    finally:
        service.request_stop()
        thread.join(60)
        relay.terminate()
        relay.wait(30)
    return [(started[n] - committed[n]) * 1000 for n in committed if n in started]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=1000)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--latency-tasks", type=int, default=100)
    parser.add_argument("--latency-pause", type=float, default=0.1)
    parser.add_argument("--taskdb-python", default=TASKDB_PYTHON)
    args = parser.parse_args()
    with_taskdb = Path(args.taskdb_python).exists()

    namespace = setup_django()
    from _task_work import one_row_handler
    from django.conf import settings
    from django.db import connections

    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.core.registry import ConsumerSpec
    from reliable_messaging.models import OutboxMessage, ProcessedMessage, TaskRun
    from reliable_messaging.task_runs.naming import TaskQueues
    from reliable_messaging.task_runs.worker import consumer_specs
    from tests.testapp.models import Effect

    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
    logging.getLogger("django_tasks").setLevel(logging.WARNING)  # as in _taskdb_settings
    # An earlier run's rows (its outbox sent to an exchange gone with its namespace) are not
    # this run's: the bench database starts empty.
    for model in (OutboxMessage, ProcessedMessage, TaskRun, Effect):
        model.objects.all().delete()
    connections["default"].settings_dict["CONN_MAX_AGE"] = 60
    task_specs = consumer_specs(TaskQueues.of("default", settings.TASKS["default"]))[:1]
    handler_spec = ConsumerSpec(
        name="bench.one-row",
        queue=f"{namespace}.bench.one-row",
        handler=one_row_handler,
        bindings=("bench.one-row",),
    )
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    declare_topology(connection.channel(), [*task_specs, handler_spec], messaging_settings)
    connection.close()
    print(f"machine: {describe_machine()}")
    if not with_taskdb:
        print(f"django-tasks-db: no interpreter at {args.taskdb_python}; its figures skipped")

    # 1. Enqueue cost, alternated; what each round put in the outbox is sent before the next.
    kinds = ["publish", "enqueue", *(["taskdb"] if with_taskdb else [])]
    spent: dict[str, list[float]] = {kind: [] for kind in kinds}
    n = args.transactions
    for round_ in range(args.rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            offset = len(spent[kind]) * n
            if kind == "taskdb":
                seconds = taskdb(args.taskdb_python, "enqueue", n, offset)["seconds"]
            else:
                seconds = enqueue_round(kind, n, offset)
            spent[kind].append(seconds / n * 1e6)
    cost = {kind: median(values) for kind, values in spent.items()}
    for kind in kinds[1:]:
        by_round = [k / p for k, p in zip(spent[kind], spent["publish"], strict=True)]
        print(f"   {kind} / publish round by round: {', '.join(f'{r:.2f}' for r in by_round)}")
    line = (
        f"1. a business transaction with publish(): {cost['publish']:,.0f} us; with our "
        f".enqueue(): {cost['enqueue']:,.0f} us; enqueue / publish = "
        f"{cost['enqueue'] / cost['publish']:.2f}"
    )
    if with_taskdb:
        line += (
            f"; with django-tasks-db's .enqueue(): {cost['taskdb']:,.0f} us; ours / theirs = "
            f"{cost['enqueue'] / cost['taskdb']:.2f}"
        )
    print(f"{line} ({n} transactions x {args.rounds} rounds, medians)")
    drain_outbox()
    # The deliveries of part 1 are not part 2's: run them off first (their count is known).
    run_service([*task_specs, handler_spec], 2 * n * args.rounds, "warm-up", args.concurrency)

    # 2. Tasks against a handler doing the same work and against django-tasks-db, alternated.
    from _task_work import one_row

    from reliable_messaging import publish

    kinds = ["tasks", "handler", *(["taskdb"] if with_taskdb else [])]
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    taskdb_wall: list[float] = []
    count = args.tasks
    for round_ in range(args.rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            if kind == "taskdb":
                ran = taskdb(args.taskdb_python, "run", count, args.concurrency)
                if ran["successful"] != count:
                    raise RuntimeError(f"django-tasks-db ran {ran['successful']} of {count}")
                rates[kind].append(count / ran["run_seconds"])
                taskdb_wall.append(count / ran["wall_seconds"])
                continue
            base = 10_000_000 + round_ * count
            for i in range(count):
                if kind == "tasks":
                    one_row.enqueue(base + i)
                else:
                    publish("bench.one-row", {"n": base + i})
            drain_outbox()
            specs = task_specs if kind == "tasks" else [handler_spec]
            rates[kind].append(count / run_service(specs, count, kind, args.concurrency))
    failed = TaskRun.objects.exclude(status="SUCCESSFUL").count()
    rate = {kind: median(values) for kind, values in rates.items()}
    line = (
        f"2. one-row tasks: {rate['tasks']:,.0f}/s; the same row by a @consumer handler: "
        f"{rate['handler']:,.0f}/s; tasks / handler = {rate['tasks'] / rate['handler']:.2f} "
        f"(goal >= 0.9)"
    )
    if with_taskdb:
        line += (
            f"; django-tasks-db's db_worker x{args.concurrency}: {rate['taskdb']:,.0f}/s "
            f"({median(taskdb_wall):,.0f}/s with its start-up); ours / theirs = "
            f"{rate['tasks'] / rate['taskdb']:.2f}"
        )
    print(
        f"{line} ({count} x {args.rounds} rounds, concurrency {args.concurrency}, medians; "
        f"our tasks not SUCCESSFUL: {failed})"
    )
    print(
        "   rounds: "
        + "; ".join(f"{kind} " + ", ".join(f"{r:,.0f}" for r in rates[kind]) for kind in kinds)
    )
    # The machine's load moves between rounds: each round's own ratio says more than the
    # ratio of the medians.
    by_round = [t / h for t, h in zip(rates["tasks"], rates["handler"], strict=True)]
    print(
        f"   tasks / handler round by round: {', '.join(f'{r:.2f}' for r in by_round)}; "
        f"median {median(by_round):.2f}"
    )

    # 3. Latency from commit to task start, idle.
    if args.latency_tasks:
        ours = our_latency(namespace, task_specs, args.latency_tasks, args.latency_pause)
        line = (
            f"3. commit to task start, idle ({len(ours)} tasks, {args.latency_pause} s apart): "
            f"ours p50 {percentile(ours, 50):.1f} ms, p99 {percentile(ours, 99):.1f} ms"
        )
        if with_taskdb:
            for interval in (1.0, 0.1):
                theirs = taskdb(
                    args.taskdb_python, "latency", args.latency_tasks, args.latency_pause, interval
                )["ms"]
                line += (
                    f"; django-tasks-db polling every {interval:g} s: p50 "
                    f"{percentile(theirs, 50):.1f} ms, p99 {percentile(theirs, 99):.1f} ms"
                )
        print(line)


if __name__ == "__main__":
    main()
