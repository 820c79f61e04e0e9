"""Partition upkeep benchmark: inbox claims while the upkeep makes and drops day partitions.

    .venv/bin/python bench/partition_upkeep.py [--workers 6] [--batch-seconds 3] \
        [--batch-size 8] [--seconds 60]

(database ``RM_BENCH_DB``, by default ``rm_bench_partition_upkeep``; created afresh and
dropped at the end.)

``--workers`` threads claim inbox rows as a consumer's batches do: each opens a transaction,
claims ``--batch-size`` fresh keys with the real claim (``exactly_once.claim_inbox_rows``),
holds the transaction ``--batch-seconds`` (the handlers' work), commits, and starts again at
once, so some batch transaction is always open on every partition. Each claim's time is
recorded. Three phases of ``--seconds`` each, in one run:

- **baseline**: no upkeep;
- **upkeep**: the upkeep (``PartitionUpkeep.run_once``, as the consume process runs it) runs
  back to back with a clock that moves a day per run (20 days at most), so each run makes a
  day ahead and drops an expired one (weeks of old days are made first);
- **upkeep, default partition**: the same, after a DEFAULT partition is attached to the inbox:
  the layout that made every attach lock it ACCESS EXCLUSIVE and every detach impossible,
  shown for comparison.

Printed: claim time percentiles and the longest, each against the baseline, and the upkeep's
runs (how many succeeded, how long they took). Figures are printed, never asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_partition_upkeep")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import datetime as dt
import threading
import time
import uuid
from dataclasses import dataclass, field

from _common import BENCH_DB, describe_machine, drop_database, percentile, setup_django

DAY = dt.timedelta(days=1)
# Expired days are those before the moving clock minus this; the old days made first lie
# before it, today's never does within a run.
RETENTION = 30 * DAY
# Days the clock moves in a phase at most: it never reaches the days the claims write in.
MAX_DAYS = 20


@dataclass
class Phase:
    name: str
    claims: list[float] = field(default_factory=list)
    runs: list[tuple[bool, float]] = field(default_factory=list)

    def line(self, baseline: Phase | None) -> str:
        figures = []
        for label, value in (
            ("p50", percentile(self.claims, 50)),
            ("p99", percentile(self.claims, 99)),
            ("max", max(self.claims, default=float("nan"))),
        ):
            text = f"{label} {value * 1000:7.1f} ms"
            if baseline is not None:
                base = {
                    "p50": percentile(baseline.claims, 50),
                    "p99": percentile(baseline.claims, 99),
                    "max": max(baseline.claims, default=float("nan")),
                }[label]
                text += f" (x{value / base:5.1f})"
            figures.append(text)
        upkeep = ""
        if self.runs:
            ok = sum(1 for good, _ in self.runs if good)
            seconds = [s for _, s in self.runs]
            upkeep = (
                f"; upkeep runs {ok}/{len(self.runs)} succeeded, "
                f"p50 {percentile(seconds, 50):.1f}s max {max(seconds):.1f}s"
            )
        return f"{self.name:<28} {len(self.claims):6,} claims: " + ", ".join(figures) + upkeep


def claim_loop(stop: threading.Event, phase: list[Phase], batch: int, hold: float) -> None:
    from django.db import connection, transaction

    from reliable_messaging.storage.inbox import claim_inbox_rows

    try:
        while not stop.is_set():
            keys = [("bench.consumer", str(uuid.uuid4())) for _ in range(batch)]
            with transaction.atomic():
                began = time.perf_counter()
                claim_inbox_rows("default", keys, lock_wait=0)
                phase[0].claims.append(time.perf_counter() - began)
                stop.wait(hold)
    finally:
        connection.close()


def upkeep_loop(stop: threading.Event, phase: Phase, start: dt.datetime) -> None:
    from django.db import connection

    from reliable_messaging.storage import partitions

    upkeep = partitions.PartitionUpkeep("default", retention=RETENTION)
    day = 0
    try:
        while not stop.is_set() and day < MAX_DAYS:
            day += 1
            upkeep.clock = lambda day=day: start + day * DAY  # type: ignore[misc]
            began = time.perf_counter()
            ok = upkeep.run_once()
            phase.runs.append((ok, time.perf_counter() - began))
    finally:
        connection.close()


def run_phase(
    name: str, args: argparse.Namespace, start: dt.datetime | None, current: list[Phase]
) -> Phase:
    phase = Phase(name)
    current[0] = phase
    stop = threading.Event()
    workers = [
        threading.Thread(target=claim_loop, args=(stop, current, args.batch_size, args.hold))
        for _ in range(args.workers)
    ]
    for worker in workers:
        worker.start()
    upkeep = None
    if start is not None:
        time.sleep(args.batch_seconds)  # every worker in a batch first
        upkeep = threading.Thread(target=upkeep_loop, args=(stop, phase, start))
        upkeep.start()
    time.sleep(args.seconds)
    stop.set()
    for thread in [*workers, *([upkeep] if upkeep else [])]:
        thread.join(600)
    print(f"  {phase.line(None)}", flush=True)
    return phase


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--batch-seconds", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    args.hold = args.batch_seconds
    drop_database(BENCH_DB)
    setup_django()
    from django.db import connection

    from reliable_messaging.storage import partitions

    print(describe_machine())
    print(
        f"{args.workers} workers, batches of {args.batch_size} claims held "
        f"{args.batch_seconds:g}s, {args.seconds:g}s per phase",
        flush=True,
    )
    try:
        now = dt.datetime.now(dt.UTC)
        for back in (30, 22, 14):  # weeks of old days, from the first to expire: one a run
            partitions.ensure_partitions("default", now=now - back * DAY)
        current: list[Phase] = [Phase("")]
        baseline = run_phase("baseline (no upkeep)", args, None, current)
        upkeep = run_phase("upkeep", args, now, current)
        with connection.cursor() as cursor:
            table = partitions.INBOX_TABLE
            cursor.execute(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT')
        later = now + 2 * MAX_DAYS * DAY  # days nobody made yet
        with_default = run_phase("upkeep, default partition", args, later, current)
        print("\nsummary (ratios against the baseline of this run):")
        for phase in (baseline, upkeep, with_default):
            print(f"  {phase.line(baseline)}")
    finally:
        connection.close()
        drop_database(BENCH_DB)


if __name__ == "__main__":
    main()
