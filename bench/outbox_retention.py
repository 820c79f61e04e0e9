"""Retention benchmark for the outbox: the purge of expired sent rows while the relay runs.

    .venv/bin/python bench/outbox_retention.py [--expired-rows 2000000] [--messages 20000]
        [--rounds 2] [--keep-db]

(database ``RM_BENCH_DB``, by default ``rm_bench_outbox_retention``, created afresh and dropped
at the end unless ``--keep-db``.)

On PostgreSQL the outbox keeps its sent rows in one partition per UTC day of ``sent_at`` and
``purge_messages()`` drops the expired days whole, so what the purge costs should not depend
on how many rows expired, and a relay running meanwhile should keep at least 90% of its
throughput. This measures both, for ``--expired-rows``
expired sent rows:

- **drop**: the rows were sent on two expired days that have their day partitions (as on a
  system whose partitions were made ahead of time); the purge drops those partitions.

Before each purge the expired rows are loaded with ``INSERT ... SELECT`` from
``generate_series``, then the outbox is ``VACUUM ANALYZE``d (as autovacuum would after a bulk
load) and checkpointed (so that writing out the load's dirty pages does not land in a
measurement).

The baseline is the same relay in the same run: for each method and round, ``--messages`` rows
are published with ``publish()`` and drained with no purge running, then as many again while
``purge_messages()`` runs in a thread of its own (with its own database connection) started
as the relay starts. The relay is ``build_relay(once=True, listen=False)`` in a subprocess
(bench/scale.py's), and its rate counts from its start to its last recorded batch. Rounds
alternate the order of the methods so that drift hits both; the summary shows medians over the
rounds. Figures and ratios are printed, never asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_outbox_retention")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse
import datetime as dt
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from _common import BENCH_DB, describe_machine, drop_database, recreate_database, setup_django
from scale import BODY_SQL, COLUMNS, execute, publish_measured, run_relay_child, table

# The tables have no default partition: expired rows always sit in day partitions, dropped whole.
METHODS: tuple[str, ...] = ("drop",)
DAY = dt.timedelta(days=1)
LOAD_CHUNK = 500_000
GOAL_RATIO = 0.9


@dataclass(frozen=True)
class Round:
    method: str
    expired: int
    purge_s: float
    purged: int
    dropped: int
    baseline: float  # relay msg/s without a purge
    during: float  # relay msg/s while the purge runs

    @property
    def ratio(self) -> float:
        return self.during / self.baseline


def expired_days(method: str, now: dt.datetime) -> list[dt.date]:
    from reliable_messaging.conf import messaging_settings

    before = now - messaging_settings.outbox_retention
    # Two expired days that have their partitions.
    return [(before - 2 * DAY).date(), (before - 3 * DAY).date()]


def build_expired(method: str, rows: int, exchange: str) -> None:
    """Partitions for the recent days (and, for drop, the two expired days), then ``rows``
    sent rows on those days; VACUUM ANALYZE, CHECKPOINT."""
    from django.db import connection

    from reliable_messaging.storage import partitions
    from reliable_messaging.storage.partitions import OUTBOX

    started = time.perf_counter()
    now = dt.datetime.now(dt.UTC)
    days = expired_days(method, now)
    if method == "drop":
        for day in days:
            partitions.ensure_partitions(
                "default", now=partitions.day_start(day) + DAY, ahead=0, spec=OUTBOX
            )
    partitions.ensure_partitions("default", spec=OUTBOX)
    existing = partitions.partitions("default", OUTBOX)
    for day in days:
        start, end = partitions.day_start(day), partitions.day_start(day + DAY)
        covered = any(p.overlaps(start, end) for p in existing)
        if covered != (method == "drop"):
            state = "exists" if covered else "is missing"
            raise RuntimeError(f"{method}: the outbox partition of {day} {state}")
    step_ms = DAY.total_seconds() * 1000 / max(rows // len(days), 1)
    for index, day in enumerate(days):
        share = rows // len(days) + (1 if index < rows % len(days) else 0)
        for first in range(0, share, LOAD_CHUNK):
            last = min(share, first + LOAD_CHUNK) - 1
            execute(
                f"""
                INSERT INTO {table()} ({COLUMNS})
                SELECT gen_random_uuid()::text, %s, 'bench.order', {BODY_SQL}, '{{}}'::jsonb,
                       NULL, NULL, 'sent', 0, '', NULL, c, c + interval '30 milliseconds'
                FROM (SELECT i, %s::timestamptz + i * %s * interval '1 millisecond' AS c
                      FROM generate_series(%s, %s) AS i) AS g
                """,
                [exchange, partitions.day_start(day), step_ms, first, last],
            )
    loaded = time.perf_counter() - started
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {table()}")
        cursor.execute("CHECKPOINT")
    print(
        f"  {method}: {rows:,} expired sent rows in their day partitions, loaded in {loaded:.0f}s, "
        f"VACUUM ANALYZE + CHECKPOINT {time.perf_counter() - started - loaded:.0f}s",
        flush=True,
    )


def relay_rate(namespace: str, messages: int, exchange: str) -> float:
    child = run_relay_child(namespace, 600)
    if child["sent"] != messages:
        raise RuntimeError(f"the relay sent {child['sent']} of {messages}")
    return messages / child["drain_s"]


def one_round(
    method: str, args: argparse.Namespace, namespace: str, exchange: str, queue: str
) -> Round:
    from django.db import connections
    from relay import declare_sink

    from reliable_messaging.storage.retention import purge_messages

    build_expired(method, args.expired_rows, exchange)
    declare_sink(exchange, queue)
    publish_measured(args.messages, exchange, 0, 1)
    baseline = relay_rate(namespace, args.messages, exchange)
    declare_sink(exchange, queue)
    publish_measured(args.messages, exchange, 0, 1)
    outcome: dict[str, Any] = {}

    def purge() -> None:
        started = time.perf_counter()
        try:
            outcome["result"] = purge_messages(batch_size=5000)
        except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
            outcome["error"] = exc
        finally:
            outcome["s"] = time.perf_counter() - started
            connections.close_all()

    thread = threading.Thread(target=purge)
    thread.start()
    during = relay_rate(namespace, args.messages, exchange)
    thread.join()
    declare_sink(exchange, queue)
    if "error" in outcome:
        raise RuntimeError(f"the purge failed: {outcome['error']!r}")
    result = outcome["result"]
    measured = Round(
        method=method,
        expired=args.expired_rows,
        purge_s=outcome["s"],
        purged=result.outbox,
        dropped=len(result.outbox_partitions),
        baseline=baseline,
        during=during,
    )
    print(
        f"  {method}: purge {measured.purge_s:.2f}s ({measured.purged:,} rows, "
        f"{measured.dropped} partitions dropped); relay {baseline:,.0f} msg/s without, "
        f"{during:,.0f} msg/s during the purge: ratio {measured.ratio:.2f}",
        flush=True,
    )
    return measured


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expired-rows", type=int, default=2_000_000)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep-db", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    recreate_database(BENCH_DB)
    namespace = setup_django()
    exchange = f"rmtest.{namespace}"
    queue = f"{namespace}.sink"
    from relay import declare_sink, drop_sink

    declare_sink(exchange, queue)
    print(describe_machine(), flush=True)
    rounds: list[Round] = []
    try:
        for number in range(args.rounds):
            order = METHODS if number % 2 == 0 else METHODS[::-1]
            print(f"round {number + 1}:", flush=True)
            for method in order:
                rounds.append(one_round(method, args, namespace, exchange, queue))
    finally:
        drop_sink(exchange, queue)
        from django.db import connections

        connections.close_all()
        if not args.keep_db:
            drop_database(BENCH_DB)
    print()
    print(
        f"## Outbox purge of {args.expired_rows:,} expired sent rows while the relay sends "
        f"{args.messages:,} messages (medians of {args.rounds} rounds; each round's figures "
        "in brackets)"
    )
    print()
    print("| method | purge time | rows purged | relay msg/s without | during | ratio |")
    print("|---|---|---|---|---|---|")
    for method in METHODS:
        mine = [r for r in rounds if r.method == method]
        if not mine:
            continue

        def med(values: list[float]) -> float:
            return statistics.median(values)

        purge = ", ".join(f"{r.purge_s:.2f}" for r in mine)
        ratio = ", ".join(f"{r.ratio:.2f}" for r in mine)
        print(
            f"| {method} | {med([r.purge_s for r in mine]):.2f} s [{purge}] | "
            f"{mine[0].purged:,} | {med([r.baseline for r in mine]):,.0f} | "
            f"{med([r.during for r in mine]):,.0f} | {med([r.ratio for r in mine]):.2f} "
            f"[{ratio}] |"
        )
    drops = [r.ratio for r in rounds if r.method == "drop"]
    if drops:
        verdict = "met" if statistics.median(drops) >= GOAL_RATIO else "NOT met"
        print()
        print(
            f"goal: the relay keeps >= {GOAL_RATIO:.0%} of its throughput while the purge "
            f"drops expired days: {verdict} (median ratio {statistics.median(drops):.2f})"
        )


if __name__ == "__main__":
    main()
