"""Retention benchmark: the inbox purge while a consumer runs.

    .venv/bin/python bench/retention.py [--expired-rows 3000000] [--messages 20000] \
        [--concurrency 2] [--rounds 2] [--live-rows 1000000]

(database ``RM_BENCH_DB``, by default ``rm_bench_retention``; created and migrated if needed.)

On PostgreSQL the inbox is partitioned by UTC day and ``purge_messages()`` drops its expired
days whole, so what the purge costs should not depend on how many rows expired, and a consumer
running meanwhile should keep at least 90% of its throughput. This measures both, for
``--expired-rows`` expired rows:

- **drop**: the rows are stamped in two expired days that have their day partitions (as on a
  system whose partitions were made ahead of time); the purge drops those partitions.

The inbox is emptied first, every day of the last ``DEDUP_RETENTION`` + 3 days gets its
partition and ``--live-rows`` rows not yet expired are spread over those days, so the consumer
works against a realistic inbox. Before each purge the expired rows are loaded again with
``INSERT ... SELECT`` from ``generate_series``, then the inbox is ``VACUUM ANALYZE``d (as
autovacuum would after a bulk load) and checkpointed (so that writing out the load's dirty
pages does not land in a measurement).

The baseline is the same consumer in the same run over the same inbox without a purge: for
each method and round, ``--messages`` fresh messages (UUIDv7 ids, as ``publish()`` mints) are
consumed with no purge running, then as many again while ``purge_messages()`` runs in a thread
of its own (with its own database connection) started when the consumer starts. The consumer
is tests.testapp's alpha (one row per message) run by ConsumerService, the engine of
`manage.py consume`, in this process, with CONN_MAX_AGE=60 and without the Redis fast path.
Rounds alternate the order of the methods so that drift hits both; the summary shows medians
over the rounds. Figures and ratios are printed, never asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_retention")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import datetime as dt
import json
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pika
from _common import BENCH_DB, describe_machine, setup_django
from consume import BROKER, FILL_CHUNK, UUID7_SQL, fill, new_ids, run_service

# The tables have no default partition: expired rows always sit in day partitions, dropped whole.
METHODS: tuple[str, ...] = ("drop",)
DAY = dt.timedelta(days=1)


def retention_days() -> int:
    from reliable_messaging.conf import messaging_settings

    return math.ceil(messaging_settings.dedup_retention / DAY)


def ensure_days(now: dt.datetime) -> None:
    """A day partition for every day of the last DEDUP_RETENTION + 3 days (and the next 3)."""
    from reliable_messaging.storage import partitions

    for back in range(retention_days() + 3, -1, -1):
        partitions.ensure_partitions("default", now=now - dt.timedelta(days=back))


def vacuum_and_checkpoint(cursor: Any) -> float:
    """VACUUM ANALYZE the inbox (as autovacuum would after a bulk load or a mass delete),
    then CHECKPOINT; seconds."""
    from reliable_messaging.storage.partitions import INBOX_TABLE

    started = time.perf_counter()
    cursor.execute(f"VACUUM ANALYZE {INBOX_TABLE}")
    cursor.execute("CHECKPOINT")
    return time.perf_counter() - started


def insert_rows(
    cursor: Any,
    consumer: str,
    id_sql: str,
    start: dt.datetime,
    span: dt.timedelta,
    count: int,
    extra: dict[str, object] | None = None,
) -> None:
    """``count`` inbox rows of ``consumer`` evenly stamped over [start, start + span), chunk by
    chunk (series numbers 0..count-1)."""
    from reliable_messaging.storage.partitions import INBOX_TABLE

    step_s = span.total_seconds() / max(count, 1)
    for first in range(0, count, FILL_CHUNK):
        last = min(count, first + FILL_CHUNK) - 1
        cursor.execute(
            f"INSERT INTO {INBOX_TABLE} (consumer, message_id, processed_at) "
            f"SELECT %(consumer)s, {id_sql}, "
            "%(start)s::timestamptz + make_interval(secs => g * %(step_s)s) "
            "FROM generate_series(%(first)s, %(last)s) AS g",
            {
                "consumer": consumer,
                "start": start,
                "step_s": step_s,
                "first": first,
                "last": last,
                **(extra or {}),
            },
        )


def prepare_inbox(consumer: str, live_rows: int) -> None:
    """An empty inbox with a partition for every day of the last DEDUP_RETENTION + 3 days, and
    ``live_rows`` rows not yet expired."""
    from django.db import connection

    from reliable_messaging.storage import partitions

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {partitions.INBOX_TABLE}, testapp_effect")
        # Day partitions a run on another day left behind: start afresh.
        for partition in partitions.partitions("default"):
            cursor.execute(f'DROP TABLE "{partition.name}"')
    now = dt.datetime.now(dt.UTC)
    ensure_days(now)
    window = retention_days() * DAY - dt.timedelta(hours=1)
    base_ms = time.time_ns() // 1_000_000 - live_rows - 3_600_000
    with connection.cursor() as cursor:
        insert_rows(
            cursor,
            consumer,
            UUID7_SQL,
            now - window,
            window - dt.timedelta(minutes=1),
            live_rows,
            {"base_ms": base_ms},
        )
        vacuum_and_checkpoint(cursor)
    print(
        f"inbox: {len(partitions.partitions('default'))} partitions (day partitions for the "
        f"last {retention_days()} + 3 days and the next 3), {live_rows:,} "
        f"live rows spread over the last {window}; {time.perf_counter() - started:.0f}s",
        flush=True,
    )


def expired_days(method: str, now: dt.datetime) -> list[dt.date]:
    from reliable_messaging.conf import messaging_settings

    before = now - messaging_settings.dedup_retention
    # Two expired days that have their partitions.
    return [(before - 2 * DAY).date(), (before - 3 * DAY).date()]


def build_expired(method: str, consumer: str, rows: int) -> None:
    """Partitions for every recent day again (the drop purge took the expired ones), then
    ``rows`` expired rows where ``method`` finds them; VACUUM ANALYZE, CHECKPOINT."""
    from django.db import connection

    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.storage import partitions

    started = time.perf_counter()
    now = dt.datetime.now(dt.UTC)
    ensure_days(now)
    before = now - messaging_settings.dedup_retention
    days = expired_days(method, now)
    existing = partitions.partitions("default")
    for day in days:
        start, end = partitions.day_start(day), partitions.day_start(day + DAY)
        assert end <= before, f"{day} is not expired"
        covered = any(p.overlaps(start, end) for p in existing)
        if covered != (method == "drop"):
            state = "exists" if covered else "is missing"
            raise RuntimeError(f"{method}: the inbox partition of {day} {state}")
    with connection.cursor() as cursor:
        for index, day in enumerate(days):
            share = rows // len(days) + (1 if index < rows % len(days) else 0)
            insert_rows(
                cursor, consumer, "gen_random_uuid()::text", partitions.day_start(day), DAY, share
            )
        loaded = time.perf_counter() - started
        vacuumed = vacuum_and_checkpoint(cursor)
    print(
        f"  {rows:,} expired rows loaded into their day partitions in {loaded:.0f}s; "
        f"VACUUM ANALYZE (as autovacuum would) + CHECKPOINT {vacuumed:.0f}s",
        flush=True,
    )


class WarningLog(logging.Handler):
    """Keeps the warnings reliable_messaging logs (lock timeouts of the partition upkeep...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"[{record.threadName}] {record.name}: {record.getMessage()}")

    def take(self) -> list[str]:
        records, self.records = self.records, []
        return records


@dataclass
class PurgeRun:
    started: float = 0.0
    finished: float = 0.0
    result: Any = None
    error: BaseException | None = None
    thread: threading.Thread = field(init=False)

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="purge", daemon=True)
        self.started = time.perf_counter()
        self.thread.start()

    def _run(self) -> None:
        from django.db import connection

        from reliable_messaging.storage.retention import purge_messages

        try:
            self.result = purge_messages()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            self.error = exc
        finally:
            self.finished = time.perf_counter()
            connection.close()  # Django's connections are per thread: this one is the purge's


def measure(
    spec: Any, exchange: str, method: str, rows: int, n: int, concurrency: int, log: WarningLog
) -> dict[str, Any]:
    """Rebuild the expired state, then the consumer over ``n`` fresh messages without a purge
    (the baseline), then over ``n`` more while the purge runs."""
    build_expired(method, spec.name, rows)
    for warning in log.take():
        print(f"  logged while loading: {warning}", flush=True)
    fill(exchange, new_ids("uuid7", n), {"n": 1})
    base_s = run_service(spec, n, f"{method}: baseline", concurrency)
    fill(exchange, new_ids("uuid7", n), {"n": 1})
    purge = PurgeRun()
    purge.start()
    with_s = run_service(spec, n, f"{method}: with the purge", concurrency)
    consumer_done = time.perf_counter()
    overlapped = purge.thread.is_alive()
    purge.thread.join()
    if purge.error is not None:
        raise RuntimeError(f"{method}: the purge failed") from purge.error
    result = purge.result
    warnings = log.take()
    step = {
        "method": method,
        "baseline_msgs_per_s": round(n / base_s),
        "with_purge_msgs_per_s": round(n / with_s),
        "ratio": round(base_s / with_s, 3),
        "purge_s": round(purge.seconds, 2),
        "purge_rows": result.inbox,
        "purge_partitions_dropped": len(result.inbox_partitions),
        "purge_rows_per_s": round(result.inbox / purge.seconds) if purge.seconds else None,
        "consumer_s": round(with_s, 2),
        "purge_outlived_consumer_s": round(purge.finished - consumer_done, 2)
        if overlapped
        else 0.0,
        "warnings": warnings,
    }
    tail = (
        f"; the consumer finished first, the purge took {purge.finished - consumer_done:.1f}s more"
        if overlapped
        else f"; it ended {with_s - purge.seconds:.1f}s before the consumer"
    )
    print(
        f"  consumer without purge {step['baseline_msgs_per_s']:,} msg/s, with the purge "
        f"running {step['with_purge_msgs_per_s']:,} msg/s (ratio {step['ratio']:.2f}); purge: "
        f"{result.inbox:,} rows ({len(result.inbox_partitions)} partitions dropped) in "
        f"{purge.seconds:.2f}s{tail}",
        flush=True,
    )
    for warning in warnings:
        print(f"  logged: {warning}", flush=True)
    return step


def summarize(steps: list[dict[str, Any]], rows: int) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        mine = [step for step in steps if step["method"] == method]
        if not mine:
            continue
        med = {
            key: statistics.median(step[key] for step in mine)
            for key in (
                "baseline_msgs_per_s",
                "with_purge_msgs_per_s",
                "ratio",
                "purge_s",
                "purge_rows",
                "purge_outlived_consumer_s",
            )
        }
        summary[method] = {
            "expired_rows": rows,
            "purge_s": round(med["purge_s"], 2),
            "purge_rows": round(med["purge_rows"]),
            "purge_rows_per_s": round(med["purge_rows"] / med["purge_s"])
            if med["purge_s"]
            else None,
            "purge_outlived_consumer_s": round(med["purge_outlived_consumer_s"], 2),
            "baseline_msgs_per_s": round(med["baseline_msgs_per_s"]),
            "with_purge_msgs_per_s": round(med["with_purge_msgs_per_s"]),
            "ratio": round(med["ratio"], 3),
            "kept_90_percent": med["ratio"] >= 0.9,
            "warnings": sum(len(step["warnings"]) for step in mine),
            "rounds": [
                {
                    k: step[k]
                    for k in (
                        "baseline_msgs_per_s",
                        "with_purge_msgs_per_s",
                        "ratio",
                        "purge_s",
                        "purge_rows",
                    )
                }
                for step in mine
            ],
        }
    return summary


def print_summary(summary: dict[str, dict[str, Any]], rounds: int) -> None:
    label = f"median of {rounds} rounds" if rounds > 1 else "1 round"
    print()
    print(f"Purge while the consumer runs ({label}; ratio = with / without, paired per round):")
    print()
    print(
        "| purge method | expired rows | purge time | consumer msg/s without purge "
        "| with purge running | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for method, row in summary.items():
        print(
            f"| {method} | {row['expired_rows']:,} | {row['purge_s']:.2f} s | "
            f"{row['baseline_msgs_per_s']:,} | {row['with_purge_msgs_per_s']:,} | "
            f"{row['ratio']:.2f} |"
        )
    print()
    for method, row in summary.items():
        kept = "kept" if row["kept_90_percent"] else "did NOT keep"
        rate = f"{row['purge_rows_per_s']:,}" if row["purge_rows_per_s"] is not None else "?"
        longer = (
            f"; it outlasted the consumer's run by {row['purge_outlived_consumer_s']:.1f}s"
            if row["purge_outlived_consumer_s"]
            else ""
        )
        print(
            f"{method}: the consumer {kept} >= 90% of its throughput while the purge ran "
            f"({row['ratio']:.0%}); the purge removed {row['purge_rows']:,} rows in "
            f"{row['purge_s']:.2f}s = {rate} rows/s{longer}; {row['warnings']} warnings logged"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--expired-rows", type=int, default=3_000_000)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--live-rows",
        type=int,
        default=1_000_000,
        help="inbox rows not yet expired, spread over the retention window",
    )
    args = parser.parse_args()

    setup_django()
    from django.conf import settings as django_settings
    from django.db import connections
    from django.test import override_settings

    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.testing import find_consumer

    # One line per message at INFO would time the terminal: log warnings only, in this process.
    logger = logging.getLogger("reliable_messaging")
    logger.setLevel(logging.WARNING)
    log = WarningLog()
    logger.addHandler(log)
    connections["default"].settings_dict["CONN_MAX_AGE"] = 60
    # The default retention (the test settings shorten it), so the inbox has its 14 days of
    # partitions, as in production.
    settings = {
        **django_settings.RELIABLE_MESSAGING,
        "CACHE_ALIAS": None,
        "DEDUP_RETENTION": dt.timedelta(days=14),
    }
    spec = find_consumer("tests.alpha")
    n = args.messages
    with override_settings(RELIABLE_MESSAGING=settings):
        exchange = messaging_settings.exchange
        connection = pika.BlockingConnection(pika.URLParameters(BROKER))
        declare_topology(connection.channel(), [spec], messaging_settings)
        connection.close()
        machine = describe_machine()
        print(f"machine: {machine}")
        print(
            f"database {BENCH_DB}; DEDUP_RETENTION {messaging_settings.dedup_retention}; "
            f"consumer {spec.name}, concurrency {args.concurrency}; {n:,} messages per "
            f"measurement; purge_messages() with its defaults (batches of 5,000)",
            flush=True,
        )
        prepare_inbox(spec.name, args.live_rows)
        steps: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            order = METHODS if round_ % 2 == 0 else tuple(reversed(METHODS))
            for method in order:
                print(f"round {round_ + 1}, {method}:", flush=True)
                steps.append(
                    measure(spec, exchange, method, args.expired_rows, n, args.concurrency, log)
                )
        logger.removeHandler(log)
        days = retention_days()

    summary = summarize(steps, args.expired_rows)
    print_summary(summary, args.rounds)
    print(f"machine: {machine}")
    result = {
        "machine": machine,
        "dedup_retention_days": days,
        "expired_rows": args.expired_rows,
        "live_rows": args.live_rows,
        "messages": n,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "methods": summary,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
