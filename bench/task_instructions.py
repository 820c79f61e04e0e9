"""Instructions per task and per handler message in the consumer (issue 47's tasks / handler),
counted by callgrind, which the load of a shared machine does not move.

    .venv/bin/python bench/task_instructions.py [--sizes 100,300] [--concurrency 2]

For each kind (one-row tasks of ``bench/_task_work.py``, and a ``@consumer`` handler writing
the same row) and each size, a child process enqueues (or publishes) that many, sends them
with the relay's engine, then runs ``ConsumerService`` (what ``manage.py consume`` runs) until
every one is settled, under ``valgrind --tool=callgrind --instr-atstart=no`` with counting on
only while the consumer runs. The difference between the two sizes over the extra messages is
the instructions per message: the consumer's start and its last idle turns cancel out. The
consumer's threads keep polling while they wait, so runs of the same code differ by a percent
or two. A third kind, tasks with no receiver connected to the framework's ``task_started`` and
``task_finished`` (so no result built or sent for them), prints what those two signals cost a
task (``docs/tasks.md#where-a-tasks-extra-cost-goes``).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_tasks")
os.environ["RM_TEST_TASKS"] = "1"  # tests/settings.py: TASKS names our backend
sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve()


def child(kind: str, count: int, concurrency: int) -> None:
    """Enqueue or publish ``count``, send them, and run the consumer over them, counted."""
    import pika
    from _common import BROKER_URL, setup_django
    from consume import run_service

    namespace = setup_django()
    from _task_work import one_row, one_row_handler
    from django.conf import settings

    from reliable_messaging import publish
    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.core.registry import ConsumerSpec
    from reliable_messaging.models import OutboxMessage, ProcessedMessage, TaskRun
    from reliable_messaging.publishing.relay import build_relay
    from reliable_messaging.task_runs.naming import TaskQueues
    from reliable_messaging.task_runs.worker import consumer_specs
    from tests.testapp.models import Effect

    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
    if kind == "unsignalled":
        from reliable_messaging.task_runs.framework import task_finished, task_started

        for signal in (task_started, task_finished):
            for entry in list(signal.receivers):
                held = entry[1]  # the receiver, or a weak reference to it
                signal.disconnect(held() if isinstance(held, weakref.ReferenceType) else held)
            assert not signal.receivers, signal.receivers
    for model in (OutboxMessage, ProcessedMessage, TaskRun, Effect):
        model.objects.all().delete()
    if kind != "handler":
        specs = consumer_specs(TaskQueues.of("default", settings.TASKS["default"]))[:1]
    else:
        specs = [
            ConsumerSpec(
                name="bench.one-row",
                queue=f"{namespace}.bench.one-row",
                handler=one_row_handler,
                bindings=("bench.one-row",),
            )
        ]
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    declare_topology(connection.channel(), specs, messaging_settings)
    connection.close()
    for n in range(count):
        if kind != "handler":
            one_row.enqueue(10_000_000 + n)
        else:
            publish("bench.one-row", {"n": 10_000_000 + n})
    build_relay(once=True).run()
    control = ["callgrind_control", "-i"]
    subprocess.run([*control, "on", str(os.getpid())], check=True, capture_output=True)
    run_service(specs, count, kind, concurrency)
    subprocess.run([*control, "off", str(os.getpid())], check=True, capture_output=True)


def counted(kind: str, count: int, concurrency: int) -> int:
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={scratch}/callgrind.out",
                sys.executable,
                str(HERE),
                "--child",
                kind,
                str(count),
                str(concurrency),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return sum(int(n) for n in re.findall(r"Collected : (\d+)", done.stderr))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100,300")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, count, concurrency = args.child
        child(kind, int(count), int(concurrency))
        return
    few, many = (int(size) for size in args.sizes.split(","))
    per_message = {}
    for kind in ("tasks", "handler", "unsignalled"):
        counts = {size: counted(kind, size, args.concurrency) for size in (few, many)}
        per_message[kind] = (counts[many] - counts[few]) / (many - few)
        print(f"{kind}: {per_message[kind] / 1e6:.3f} M instructions per message", flush=True)
    ratio = per_message["handler"] / per_message["tasks"]
    print(f"a task costs {per_message['tasks'] / per_message['handler']:.3f}x a handler's message")
    print(f"tasks / handler by instructions: {ratio:.3f} (issue 47's goal: >= 0.9 by rate)")
    signals = per_message["tasks"] - per_message["unsignalled"]
    extra = per_message["tasks"] - per_message["handler"]
    print(
        f"the framework's task_started and task_finished: {signals / 1e6:.3f} M per task, "
        f"of the {extra / 1e6:.3f} M a task costs beyond a handler's message"
    )


if __name__ == "__main__":
    main()
