"""What migrations 0009 and 0010 cost on a populated inbox or outbox: converting it in place.

    .venv/bin/python bench/convert.py [--rows 30000000] [--table inbox|outbox]

(database ``RM_BENCH_DB``, by default ``rm_bench_convert``.) The inbox is migrated back to 0008
(one plain table) and filled with ``--rows`` rows of UUIDv7 ids stamped over the last 14 days
(``INSERT ... SELECT`` from ``generate_series``, then ``VACUUM ANALYZE`` as autovacuum would, and
a ``CHECKPOINT``). Then ``migrate reliable_messaging 0009`` runs while a writer thread inserts
inbox rows the way the consumer does, one transaction per row, and every statement of the
migration is timed. Printed: the whole migration, the scan that validates the CHECK constraint
(inserts go on meanwhile), the transaction that holds the exclusive lock on the table, and the
longest wait of one insert (the writer's own baseline, measured just before, is printed next to
it). Nothing is asserted.

With ``--table outbox`` the same is done for the outbox and migration 0010: the outbox (at 0009,
one plain table) is filled with sent rows of the last 14 days and one pending row in a thousand,
and the writer publishes with ``publish()``, one transaction per message.
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
from collections.abc import Callable
from typing import Any

from _common import describe_machine, setup_django
from consume import UUID7_SQL

TABLE = "reliable_messaging_processedmessage"
OUTBOX = "reliable_messaging_outboxmessage"
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


def writer(stop: threading.Event, waits: list[float], outbox: bool = False) -> None:
    """Insert inbox rows, one transaction each, as a consumer does (or with ``outbox``,
    publish one message per transaction); record each one's time."""
    from django.db import connection, transaction

    from reliable_messaging import publish
    from reliable_messaging.consuming.processing import insert_inbox_row
    from reliable_messaging.core.uuid7 import new_message_id

    try:
        while not stop.is_set():
            started = time.perf_counter()
            with transaction.atomic():
                if outbox:
                    publish("bench.writer", {"n": 1}, exchange="")
                else:
                    insert_inbox_row("default", "bench.writer", new_message_id())
            waits.append(time.perf_counter() - started)
    finally:
        connection.close()


def timed_writes(seconds: float, outbox: bool = False) -> list[float]:
    stop = threading.Event()
    waits: list[float] = []
    thread = threading.Thread(target=writer, args=(stop, waits, outbox))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join(30)
    return waits


def measure_migration(
    target: str, rows: int, *, outbox: bool, ends_switch: Callable[[str], bool]
) -> None:
    """Time ``migrate reliable_messaging <target>`` statement by statement while a writer
    thread writes as the app does (``outbox``: publishes), with the writer's own baseline just
    before; print the whole, the validating scan, the exclusive lock (from LOCK TABLE to the
    last statement ``ends_switch`` names) and the writes' waits."""
    from django.core.management import call_command
    from django.db import connection

    baseline = timed_writes(5.0, outbox)
    timings = Timings()
    stop = threading.Event()
    waits: list[float] = []
    thread = threading.Thread(target=writer, args=(stop, waits, outbox))
    thread.start()
    time.sleep(1.0)
    with connection.execute_wrapper(timings):
        started = time.perf_counter()
        call_command("migrate", "reliable_messaging", target, verbosity=0, stdout=io.StringIO())
        total = time.perf_counter() - started
    time.sleep(1.0)
    stop.set()
    thread.join(30)
    validate = next(end - begin for begin, end, sql in timings.statements if "VALIDATE" in sql)
    lock_start = next(begin for begin, _, sql in timings.statements if sql.startswith("LOCK TABLE"))
    switch_end = max(end for _, end, sql in timings.statements if ends_switch(sql))
    print(
        f"migrate {target} on {rows:,} rows: {total:.1f}s in all; the CHECK's validating scan "
        f"{validate:.1f}s ({'publishing goes' if outbox else 'inserts go'} on); the exclusive lock "
        f"held {1000 * (switch_end - lock_start):.0f} ms (until the last statement of its "
        "transaction; commit not included)"
    )
    writes = "publish()" if outbox else "one-row inbox inserts"
    print(
        f"{writes}, one transaction each: before the migration median "
        f"{1000 * sorted(baseline)[len(baseline) // 2]:.2f} ms, longest {1000 * max(baseline):.1f} "
        f"ms ({len(baseline):,} in 5 s); during it median "
        f"{1000 * sorted(waits)[len(waits) // 2]:.2f} ms, longest {1000 * max(waits):.1f} ms "
        f"({len(waits):,} in {total + 2:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=30_000_000)
    parser.add_argument("--table", choices=("inbox", "outbox"), default="inbox")
    args = parser.parse_args()
    setup_django()
    from django.core.management import call_command
    from django.db import connection

    print(f"machine: {describe_machine()}", flush=True)
    if args.table == "outbox":
        convert_outbox(args.rows)
        return
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
    measure_migration(
        "0009", args.rows, outbox=False, ends_switch=lambda sql: sql.endswith(" DEFAULT")
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass ORDER BY 1",
            [TABLE],
        )
        print("partitions:", ", ".join(row[0] for row in cursor.fetchall()))


def convert_outbox(rows: int) -> None:
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", "reliable_messaging", "0009", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {OUTBOX}")
        started = time.perf_counter()
        for first in range(1, rows + 1, CHUNK):
            last = min(rows, first + CHUNK - 1)
            cursor.execute(
                f"INSERT INTO {OUTBOX} (message_id, exchange, routing_key, body, headers, "
                "status, attempts, last_error, next_attempt_at, created_at, sent_at) "
                "SELECT gen_random_uuid()::text, '', 'bench.order', '{\"n\":1}', '{}', "
                "CASE WHEN g %% 1000 = 0 THEN 'pending' ELSE 'sent' END, 0, '', c, c, "
                "CASE WHEN g %% 1000 = 0 THEN NULL ELSE c END "
                "FROM (SELECT g, now() - (%(rows)s - g) * %(step)s * interval '1 millisecond' "
                "AS c FROM generate_series(%(first)s, %(last)s) AS g) AS s",
                {
                    "rows": rows,
                    "step": 14 * 86_400_000 // max(rows, 1),
                    "first": first,
                    "last": last,
                },
            )
            print(f"  {last:,} rows ({time.perf_counter() - started:.0f}s)", flush=True)
        cursor.execute(f"VACUUM ANALYZE {OUTBOX}")
        cursor.execute("CHECKPOINT")
        cursor.execute(f"SELECT pg_total_relation_size('{OUTBOX}')")
        size = cursor.fetchone()[0]
    print(
        f"plain outbox (0009) of {rows:,} rows, {size / 2**20:,.0f} MiB with its indexes; "
        "VACUUM ANALYZE (as autovacuum would) and CHECKPOINT done",
        flush=True,
    )
    measure_migration(
        "0010", rows, outbox=True, ends_switch=lambda sql: sql.startswith("CREATE TRIGGER")
    )
    call_command("migrate", "reliable_messaging", verbosity=0)


if __name__ == "__main__":
    main()
