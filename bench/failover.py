"""A managed database failover under load (issue 33): what the consumers charge for it.

    .venv/bin/python bench/failover.py [--messages 300] [--read-only 20] [--processes 2]

Two ``manage.py consume`` processes (tests.testapp's ``tests.alpha``, 20 ms a message) take
``--messages`` messages from the raw publisher. A baseline round first: the same number of
messages, no failover, timed from publishing to an empty queue. Then the failover round: the
messages are published, and once the consumers are at work the bench database turns read-only
(``default_transaction_read_only``, SQLSTATE 25006 on the first write) with every session
terminated, for ``--read-only`` seconds; then it is writable again and its sessions are
terminated once more, as after a promotion. Only the bench database (``RM_BENCH_DB``, default
``rm_bench_failover``) is touched; PostgreSQL keeps running for everyone else.

Printed: retries charged (retry lines in the logs, and effects committed at an attempt > 1),
dead letters (rows and log lines), messages whose effect committed exactly once (and any lost
or doubled), traceback / ERROR / WARNING lines in the consumers' logs, and the time to drain
after the reset against the baseline's whole drain.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_failover")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DB, describe_machine, setup_django, subprocess_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--read-only", type=float, default=20.0, help="seconds read-only")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()

    namespace = setup_django()
    from django.db import connections

    from reliable_messaging.models import DeadLetter
    from tests.support import (
        ConsumeProcess,
        Publisher,
        drained,
        read_only_failover,
        wait_until,
    )
    from tests.testapp.models import Effect

    print(describe_machine())
    Effect.objects.all().delete()
    DeadLetter.objects.all().delete()
    queue = f"{namespace}.alpha"
    exchange = f"rmtest.{namespace}"
    payload = {"sleep": {"alpha": 0.02}}
    logs = Path(tempfile.mkdtemp(prefix="rm-bench-failover-"))
    env = subprocess_env(namespace)
    procs = [
        ConsumeProcess(["--queue", queue], env, logs / f"consume-{n}.log")
        for n in range(args.processes)
    ]
    publisher = Publisher()
    try:
        for proc in procs:
            proc.wait_consuming(timeout=90)

        def publish(ids: list[str]) -> None:
            for message_id in ids:
                publisher.publish(exchange, "order.placed", payload, message_id=message_id)

        def wait_drained(timeout: float) -> float:
            started = time.monotonic()
            wait_until(lambda: drained(queue), timeout=timeout, interval=0.2)
            return time.monotonic() - started

        baseline_ids = [f"base-{uuid.uuid4().hex[:8]}-{n}" for n in range(args.messages)]
        started = time.monotonic()
        publish(baseline_ids)
        wait_drained(600)
        baseline = time.monotonic() - started
        lines_before = {proc.pid: len(proc.log().splitlines()) for proc in procs}

        ids = [f"failover-{uuid.uuid4().hex[:8]}-{n}" for n in range(args.messages)]
        publish(ids)
        wait_until(lambda: Effect.objects.filter(message_id__in=ids[:50]).exists(), timeout=60)
        in_flight = args.messages - Effect.objects.filter(message_id__in=ids).count()
        connections.close_all()
        with read_only_failover(BENCH_DB):
            time.sleep(args.read_only)
        connections.close_all()
        drain = wait_drained(900)

        effects = list(
            Effect.objects.filter(consumer="alpha", message_id__in=ids).values_list(
                "message_id", "attempt"
            )
        )
        counts = Counter(message_id for message_id, _ in effects)
        once = sum(1 for message_id in ids if counts[message_id] == 1)
        doubled = sum(1 for n in counts.values() if n > 1)
        lost = sum(1 for message_id in ids if counts[message_id] == 0)
        late = sum(1 for _, attempt in effects if attempt > 1)
        text = "\n".join(
            line for proc in procs for line in proc.log().splitlines()[lines_before[proc.pid] :]
        )
        retry_lines = len(re.findall(r"outcome=retry", text))
        dead_lines = len(re.findall(r"outcome=dead_lettered", text))
        tracebacks = text.count("Traceback (most recent call last)")
        errors = len(re.findall(r" ERROR ", text))
        warnings = len(re.findall(r" WARNING ", text))
        print(
            f"failover: {args.messages} messages, {in_flight} not yet processed when the "
            f"database turned read-only for {args.read_only:g}s; {args.processes} consume "
            f"processes"
        )
        print(
            f"  retries charged:          {retry_lines} retry lines, {late} effects at attempt > 1"
        )
        print(f"  dead letters:             {DeadLetter.objects.count()} rows, {dead_lines} lines")
        print(f"  processed once:  {once} of {args.messages} (lost {lost}, doubled {doubled})")
        print(f"  log lines:  {tracebacks} tracebacks, {errors} ERROR, {warnings} WARNING")
        print(
            f"  drain after the reset:    {drain:.1f}s (baseline: {args.messages} messages "
            f"drained in {baseline:.1f}s with no failover; ratio {drain / baseline:.2f})"
        )
        print(f"  logs: {logs}")
        for line in text.splitlines():
            if re.search(r" (WARNING|ERROR) ", line):
                print(f"    {line[:200]}")
    finally:
        publisher.close()
        for proc in procs:
            proc.close()


if __name__ == "__main__":
    main()
