"""django.tasks benchmark (issue 47): what enqueueing a task costs a business transaction, and
how fast the consumer runs tasks against the same work as a plain ``@consumer`` handler.

    .venv/bin/python bench/tasks.py [--transactions 2000] [--tasks 3000] [--rounds 3]
                                    [--concurrency 2]

1. Enqueue inside a business transaction: ``--transactions`` transactions of one business row
   (``tests.testapp.Effect``) plus either ``publish()`` of a message or ``.enqueue()`` of a task
   with the same arguments, the two kinds alternated round by round; microseconds per
   transaction (median of the rounds) and the ratio enqueue / publish.
2. Tasks run per second: ``--tasks`` tasks of one row (``bench/_task_work.py``) enqueued and
   relayed beforehand, then run by the consumer's engine (ConsumerService, what ``manage.py
   consume`` runs) in this process; against as many messages to a ``@consumer`` handler that
   writes the same row, relayed the same way; alternated round by round, the median rate of
   each and the ratio tasks / handler (the issue's goal: >= 0.9).

Not measured here: django-tasks-db's enqueue and worker (django-tasks-db is on the package
index; it is to be installed in a benchmark environment of its own, never in the project's),
and the latency from commit to a task's start.

Everything runs on its own database (``RM_BENCH_DB``, ``rm_bench_tasks`` by default) and a
fresh exchange.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_tasks")
os.environ["RM_TEST_TASKS"] = "1"  # tests/settings.py: TASKS names our backend
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import BROKER_URL, describe_machine, median, setup_django
from consume import run_service


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


def drain_outbox() -> int:
    from reliable_messaging.publishing.relay import build_relay

    return build_relay(once=True).run().sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

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

    # 1. Enqueue cost, alternated; what each round put in the outbox is sent before the next.
    spent: dict[str, list[float]] = {"publish": [], "enqueue": []}
    n = args.transactions
    for round_ in range(args.rounds):
        for kind in ("publish", "enqueue") if round_ % 2 == 0 else ("enqueue", "publish"):
            spent[kind].append(enqueue_round(kind, n, offset=len(spent[kind]) * n) / n * 1e6)
    publish_us, enqueue_us = median(spent["publish"]), median(spent["enqueue"])
    print(
        f"1. a business transaction with publish(): {publish_us:,.0f} us; with .enqueue(): "
        f"{enqueue_us:,.0f} us; enqueue / publish = {enqueue_us / publish_us:.2f} "
        f"({n} transactions x {args.rounds} rounds, medians)"
    )
    drain_outbox()
    # The deliveries of part 1 are not part 2's: run them off first (their count is known).
    run_service([*task_specs, handler_spec], 2 * n * args.rounds, "warm-up", args.concurrency)

    # 2. Tasks against a handler doing the same work, alternated.
    from _task_work import one_row

    from reliable_messaging import publish

    rates: dict[str, list[float]] = {"tasks": [], "handler": []}
    count = args.tasks
    for round_ in range(args.rounds):
        for kind in ("tasks", "handler") if round_ % 2 == 0 else ("handler", "tasks"):
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
    tasks_rate, handler_rate = median(rates["tasks"]), median(rates["handler"])
    print(
        f"2. one-row tasks: {tasks_rate:,.0f}/s; the same row by a @consumer handler: "
        f"{handler_rate:,.0f}/s; tasks / handler = {tasks_rate / handler_rate:.2f} (goal >= 0.9; "
        f"{count} x {args.rounds} rounds, concurrency {args.concurrency}, medians; "
        f"tasks not SUCCESSFUL: {failed})"
    )
    print(
        "   rounds: tasks "
        + ", ".join(f"{r:,.0f}" for r in rates["tasks"])
        + "; handler "
        + ", ".join(f"{r:,.0f}" for r in rates["handler"])
    )


if __name__ == "__main__":
    main()
