"""What migration 0009 costs on a populated inbox: converting it into the day-partitioned table.

    .venv/bin/python bench/convert.py [--rows 30000000]

(database ``RM_BENCH_DB``, by default ``rm_bench_convert``.) The inbox is migrated back to 0008
(one plain table) and filled with ``--rows`` rows of UUIDv7 ids stamped over the last 14 days
(``INSERT ... SELECT`` from ``generate_series``, then ``VACUUM ANALYZE`` as autovacuum would, and
a ``CHECKPOINT``). Then ``migrate reliable_messaging 0009`` runs while a writer thread inserts
inbox rows the way the consumer does, one transaction per row, and every statement of the
migration is timed. Printed: the whole migration, the scan that validates the CHECK constraint
(inserts go on meanwhile), the transaction that holds the exclusive lock on the table, and the
longest wait of one insert (the writer's own baseline, measured just before, is printed next to
it). Nothing is asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_convert")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import io
import threading
import time
from typing import Any

from _common import describe_machine, setup_django
from consume import UUID7_SQL

TABLE = "reliable_messaging_processedmessage"
CHUNK = 2_000_000


class Timings:
    """Wall time of each statement Django sends on the migration's connection."""

    def __init__(self) -> None:
        self.statements: list[tuple[float, float, str]] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            self.statements.append((started, time.perf_counter(), " ".join(sql.split())[:90]))


def writer(stop: threading.Event, waits: list[float]) -> None:
    """Insert inbox rows, one transaction each, as a consumer does; record each one's time."""
    from django.db import connection, transaction

    from reliable_messaging.inbox import insert_inbox_row
    from reliable_messaging.uuid7 import new_message_id

    try:
        while not stop.is_set():
            started = time.perf_counter()
            with transaction.atomic():
                insert_inbox_row("default", "bench.writer", new_message_id())
            waits.append(time.perf_counter() - started)
    finally:
        connection.close()


def timed_writes(seconds: float) -> list[float]:
    stop = threading.Event()
    waits: list[float] = []
    thread = threading.Thread(target=writer, args=(stop, waits))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join(30)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=30_000_000)
    args = parser.parse_args()
    setup_django()
    from django.core.management import call_command
    from django.db import connection

    print(f"machine: {describe_machine()}", flush=True)
    call_command("migrate", "reliable_messaging", "0008", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {TABLE}")
        base_ms = time.time_ns() // 1_000_000 - 14 * 86_400_000
        step_ms = 14 * 86_400_000 // max(args.rows, 1)
        started = time.perf_counter()
        for first in range(1, args.rows + 1, CHUNK):
            last = min(args.rows, first + CHUNK - 1)
            cursor.execute(
                f"INSERT INTO {TABLE} (consumer, message_id, processed_at) "
                f"SELECT 'bench.alpha', {UUID7_SQL}, "
                "to_timestamp((%(base_ms)s + g * %(step_ms)s) / 1000.0) "
                "FROM generate_series(%(first)s, %(last)s) AS g",
                {"base_ms": base_ms, "step_ms": step_ms, "first": first, "last": last},
            )
            print(f"  {last:,} rows ({time.perf_counter() - started:.0f}s)", flush=True)
        cursor.execute(f"VACUUM ANALYZE {TABLE}")
        cursor.execute("CHECKPOINT")
        cursor.execute(f"SELECT pg_total_relation_size('{TABLE}')")
        size = cursor.fetchone()[0]
    print(
        f"plain inbox (0008) of {args.rows:,} rows, {size / 2**20:,.0f} MiB with its indexes; "
        "VACUUM ANALYZE (as autovacuum would) and CHECKPOINT done",
        flush=True,
    )
    baseline = timed_writes(5.0)

    timings = Timings()
    stop = threading.Event()
    waits: list[float] = []
    thread = threading.Thread(target=writer, args=(stop, waits))
    thread.start()
    time.sleep(1.0)
    with connection.execute_wrapper(timings):
        started = time.perf_counter()
        call_command("migrate", "reliable_messaging", "0009", verbosity=0, stdout=io.StringIO())
        total = time.perf_counter() - started
    time.sleep(1.0)
    stop.set()
    thread.join(30)

    validate = next(end - begin for begin, end, sql in timings.statements if "VALIDATE" in sql)
    lock_start = next(begin for begin, _, sql in timings.statements if sql.startswith("LOCK TABLE"))
    attach_end = next(end for _, end, sql in timings.statements if sql.endswith(" DEFAULT"))
    held_ms = 1000 * (attach_end - lock_start)
    print(
        f"migrate 0009 on {args.rows:,} rows: {total:.1f}s in all; the CHECK's validating scan "
        f"{validate:.1f}s (inserts go on); the exclusive lock held {held_ms:.0f} ms (until "
        "the last statement of its transaction; commit not included)"
    )
    print(
        f"one-row inbox inserts, one transaction each: before the migration median "
        f"{1000 * sorted(baseline)[len(baseline) // 2]:.2f} ms, longest {1000 * max(baseline):.1f} "
        f"ms ({len(baseline):,} in 5 s); during it median "
        f"{1000 * sorted(waits)[len(waits) // 2]:.2f} ms, longest {1000 * max(waits):.1f} ms "
        f"({len(waits):,} in {total + 2:.0f} s)"
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY 1",
            [TABLE],
        )
        print("partitions:", ", ".join(row[0] for row in cursor.fetchall()))


if __name__ == "__main__":
    main()
