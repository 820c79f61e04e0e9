"""Consumer benchmark: the idempotent consumer against raw pika + one psycopg transaction per
message, duplicates per second, and memory over 100,000 messages (the Redis fast path has its
own benchmark, bench/fast_path.py).

    .venv/bin/python bench/consume.py [--messages 20000] [--memory-messages 100000]

With ``--inbox-rows``, it measures instead how the consumer holds up as its inbox grows
(issue 14): for each kind of id in ``--ids`` and each size, the consumer's inbox is filled to
that many rows with ``INSERT ... SELECT`` from ``generate_series`` (time-ordered UUIDv7 ids, as
``publish()`` makes, or random UUIDv4 ids, as some foreign producers send), ``VACUUM ANALYZE``d
as autovacuum would after a bulk load, then the raw baseline and the app consume ``--messages``
fresh messages of that kind: msg/s, the ratio to the raw baseline of the same step, and WAL
bytes per message (``pg_current_wal_lsn()`` before and after; the WAL is the whole server's, so
another benchmark running at the same time inflates it). Then the memory run.

    RM_BENCH_DB=rm_bench_consume .venv/bin/python bench/consume.py \
        --inbox-rows 0,5000000,30000000 --ids uuid7,uuid4

The handler (tests.testapp's alpha) writes one row, through the ORM; with ``--handler sql`` (with
``--inbox-rows``) it runs the baseline's own INSERT instead, so that only the consumer's
machinery differs from the baseline. The baseline consumes the same messages
from the same queue with raw pika (prefetch as PREFETCH) and, per message, inserts that same row
with psycopg and commits, then acks: the cheapest honest at-least-once consumer, without the
inbox. The app's consumer runs in this process (ConsumerService, the engine of `manage.py
consume`) with CONN_MAX_AGE=60, as the docs recommend. Messages are published beforehand,
so both sides consume a full queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    DATABASE_URL,
    ROOT,
    describe_machine,
    setup_django,
    subprocess_env,
    vm_rss_kib,
)

BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"


def fill(exchange: str, ids: list[str], payload: dict[str, object]) -> None:
    """Publish one message per id to ``exchange`` (routing key order.placed), confirmed."""
    connection = pika.BlockingConnection(pika.URLParameters(BROKER))
    channel = connection.channel()
    channel.confirm_delivery()
    body = json.dumps(payload).encode()
    for message_id in ids:
        channel.basic_publish(
            exchange,
            "order.placed",
            body,
            pika.BasicProperties(
                content_type="application/json",
                delivery_mode=2,
                message_id=message_id,
                timestamp=int(time.time()),
            ),
        )
    connection.close()


EFFECT_INSERT = (
    "INSERT INTO testapp_effect (consumer, message_id, attempt, payload, created_at)"
    " VALUES (%s, %s, %s, %s, now())"
)


def insert_effect_sql(message: Any) -> None:
    """The handler of ``--handler sql``: the baseline's insert, run by the app's consumer."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            EFFECT_INSERT,
            ("tests.alpha", message.message_id, message.attempt, json.dumps(message.payload)),
        )


def raw_baseline(queue: str, count: int, prefetch: int) -> float:
    """pika + one psycopg transaction (INSERT + COMMIT) per message, then ack. Seconds."""
    import psycopg

    db = psycopg.connect(DATABASE_URL)
    connection = pika.BlockingConnection(pika.URLParameters(BROKER))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    done = 0
    started = time.perf_counter()
    for method, properties, body in channel.consume(queue, inactivity_timeout=10):
        if method is None:
            raise RuntimeError(f"baseline: the queue ran dry after {done} messages")
        assert properties is not None and body is not None and method.delivery_tag is not None
        payload = json.loads(body)
        with db.transaction(), db.cursor() as cursor:
            cursor.execute(
                EFFECT_INSERT, ("baseline", properties.message_id, 1, json.dumps(payload))
            )
        channel.basic_ack(method.delivery_tag)
        done += 1  # noqa: SIM113 - counts acked messages, not loop turns
        if done == count:
            break
    elapsed = time.perf_counter() - started
    channel.cancel()
    connection.close()
    db.close()
    return elapsed


def raw_baseline_parallel(queue: str, count: int, prefetch: int, workers: int) -> float:
    """:func:`raw_baseline` on ``workers`` threads at once, each with its own broker and
    database connection (psycopg and pika release the GIL while they wait). Seconds."""
    import psycopg

    done = 0
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        nonlocal done
        try:
            db = psycopg.connect(DATABASE_URL)
            connection = pika.BlockingConnection(pika.URLParameters(BROKER))
            channel = connection.channel()
            channel.basic_qos(prefetch_count=prefetch)
            for method, properties, body in channel.consume(queue, inactivity_timeout=0.5):
                with lock:
                    if done >= count:
                        break
                if method is None:
                    continue
                assert properties is not None and body is not None
                assert method.delivery_tag is not None
                payload = json.loads(body)
                with db.transaction(), db.cursor() as cursor:
                    cursor.execute(
                        EFFECT_INSERT, ("baseline", properties.message_id, 1, json.dumps(payload))
                    )
                channel.basic_ack(method.delivery_tag)
                with lock:
                    done += 1
            channel.cancel()  # unacked prefetched messages go back to the queue
            connection.close()
            db.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def processes_run(namespace: str, queue: str, count: int, processes: int) -> float:
    """``processes`` real `manage.py consume` processes (concurrency 1, WARNING logs) over
    ``count`` messages already in the queue. Timed from the first effect to the last, so the
    start-up of Django is not counted. Seconds."""
    from tests.testapp.models import Effect

    env = subprocess_env(namespace, RM_LOG_LEVEL="WARNING")
    base = Effect.objects.filter(consumer="alpha").count()
    command = [sys.executable, str(ROOT / "manage.py"), "consume", "--queue", queue]
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        deadline = time.monotonic() + 600
        started = None
        while time.monotonic() < deadline:
            done = Effect.objects.filter(consumer="alpha").count() - base
            if started is None and done > 0:
                started = time.perf_counter()
            if done >= count:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"{processes} processes: only {done}/{count} after 600 s")
        assert started is not None
        return time.perf_counter() - started
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def run_service(queue_spec: object, count: int, label: str, concurrency: int) -> float:
    """Run ConsumerService (on one spec, or a list of them) until ``count`` new outcomes were
    settled; seconds."""
    from reliable_messaging.consuming.service import ConsumerService

    settled = 0
    finished = threading.Event()
    lock = threading.Lock()
    started = 0.0

    def on_outcome(spec: object, delivery: object, outcome: object) -> None:
        nonlocal settled
        with lock:
            settled += 1
            if settled == count:
                finished.set()

    specs = queue_spec if isinstance(queue_spec, list) else [queue_spec]
    service = ConsumerService(specs, concurrency=concurrency, on_outcome=on_outcome)
    thread = threading.Thread(target=service.run, daemon=True)
    started = time.perf_counter()
    thread.start()
    if not finished.wait(600):
        raise RuntimeError(f"{label}: only {settled}/{count} settled after 600 s")
    elapsed = time.perf_counter() - started
    service.request_stop()
    thread.join(60)
    return elapsed


def memory_run(namespace: str, exchange: str, queue: str, total: int) -> tuple[int, int, float]:
    """A real `manage.py consume` process over ``total`` messages: VmRSS (KiB) after 10,000 and
    after all, and its rate."""
    from tests.testapp.models import Effect

    env = subprocess_env(namespace)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "consume",
            "--queue",
            queue,
            "--concurrency",
            "2",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = Effect.objects.filter(consumer="alpha").count()
        ids = [f"mem-{uuid.uuid4()}" for _ in range(total)]
        publisher = threading.Thread(target=fill, args=(exchange, ids, {"n": 1}))
        started = time.perf_counter()
        publisher.start()
        rss_10k = None
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline:
            done = Effect.objects.filter(consumer="alpha").count() - base
            if rss_10k is None and done >= 10_000:
                rss_10k = vm_rss_kib(proc.pid)
            if done >= total:
                break
            time.sleep(0.5)
        elapsed = time.perf_counter() - started
        publisher.join()
        rss_end = vm_rss_kib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    return rss_10k or 0, rss_end or 0, total / elapsed


# A time-ordered id in SQL, like reliable_messaging.core.uuid7 mints: 48 bits of milliseconds
# (:base_ms + the series number, so older than any id minted during the run), version 7,
# the variant, pseudo-random bits from md5.
UUID7_SQL = (
    "substr(lpad(to_hex(%(base_ms)s + g), 12, '0'), 1, 8) || '-' "
    "|| substr(lpad(to_hex(%(base_ms)s + g), 12, '0'), 9, 4) || '-7' "
    "|| substr(md5(g::text), 1, 3) || '-' || substr('89ab', g %% 4 + 1, 1) "
    "|| substr(md5(g::text), 4, 3) || '-' || substr(md5(g::text), 7, 12)"
)
ID_SQL = {"uuid7": UUID7_SQL, "uuid4": "gen_random_uuid()::text"}
FILL_CHUNK = 1_000_000


def new_ids(kind: str, count: int) -> list[str]:
    from reliable_messaging.core.uuid7 import new_message_id

    if kind == "uuid7":
        return [new_message_id() for _ in range(count)]
    return [str(uuid.uuid4()) for _ in range(count)]


def prepare_inbox() -> None:
    """An empty inbox with a day partition for every day of DEDUP_RETENTION (as a system that
    has run that long has)."""
    from django.db import connection

    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.storage import partitions

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {partitions.INBOX_TABLE}, testapp_effect")
    now = dt.datetime.now(dt.UTC)
    days = messaging_settings.dedup_retention.days + 1
    for back in range(days, -1, -1):
        partitions.ensure_partitions("default", now=now - dt.timedelta(days=back))


def fill_inbox(consumer: str, kind: str, have: int, upto: int, base_ms: int, span: int) -> None:
    """Grow ``consumer``'s inbox from ``have`` to ``upto`` filler rows (series numbers
    have+1..upto), chunk by chunk, then VACUUM ANALYZE it as autovacuum would after a bulk
    load. Row g is stamped as processed g/span of DEDUP_RETENTION after its start, so a full
    inbox of ``span`` rows fills every day's partition of that window."""
    from django.db import connection

    from reliable_messaging.conf import messaging_settings

    # Inside the window by a minute at each end: a day wholly older than the retention is
    # dropped by the partition upkeep of any consumer run before (here, the last step's).
    window = messaging_settings.dedup_retention.total_seconds() - 120
    start_s = time.time() - window - 60
    step_s = window / max(span, 1)
    table = "reliable_messaging_processedmessage"
    with connection.cursor() as cursor:
        started = time.perf_counter()
        for first in range(have + 1, upto + 1, FILL_CHUNK):
            last = min(upto, first + FILL_CHUNK - 1)
            cursor.execute(
                f"INSERT INTO {table} (consumer, message_id, processed_at) "
                f"SELECT %(consumer)s, {ID_SQL[kind]}, "
                "to_timestamp(%(start_s)s + g * %(step_s)s) "
                "FROM generate_series(%(first)s, %(last)s) AS g",
                {
                    "consumer": consumer,
                    "base_ms": base_ms,
                    "start_s": start_s,
                    "step_s": step_s,
                    "first": first,
                    "last": last,
                },
            )
            print(
                f"  inbox of {consumer}: {last:,} {kind} rows "
                f"({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
        vacuum_started = time.perf_counter()
        cursor.execute(f"VACUUM ANALYZE {table}")
        vacuumed = time.perf_counter() - vacuum_started
        # The load and the vacuum leave gigabytes of dirty pages: written out during the
        # measurement they would slow whichever side runs then. A live system has written
        # its old rows long ago.
        cursor.execute("CHECKPOINT")
        cursor.execute(
            "SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
            "WHERE inhparent = %s::regclass",
            [table],
        )
        size = cursor.fetchone()[0]
    print(
        f"  VACUUM ANALYZE {table} done in {vacuumed:.1f}s (as autovacuum would after the "
        f"bulk load), then CHECKPOINT; table + indexes {size / 2**20:,.0f} MiB",
        flush=True,
    )


class StatementProfile:
    """With ``--profile``: wall time per kind of SQL statement the app sends (its first words),
    from every connection Django opens in this process, including the consumer's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals: dict[str, list[float]] = {}

    def install(self) -> None:
        from django.db.backends.signals import connection_created

        connection_created.connect(self.on_connection_created, weak=False)

    def on_connection_created(self, sender: object, connection: Any, **kwargs: object) -> None:
        connection.execute_wrappers.append(self)

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            elapsed = time.perf_counter() - started
            kind = " ".join(sql.split()[:6])[:70]
            with self.lock:
                entry = self.totals.setdefault(kind, [0, 0.0])
                entry[0] += 1
                entry[1] += elapsed

    def report(self, messages: int) -> None:
        with self.lock:
            totals, self.totals = self.totals, {}
        for kind, (count, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"    {seconds * 1e6 / messages:8.1f} us/msg {count:7d}x  {kind}", flush=True)


PROFILE: StatementProfile | None = None


def inbox_insert_wal(consumer: str, kind: str, batches: int = 20, size: int = 50) -> float:
    """WAL bytes per inbox row of the batch claim's insert alone, as EXPLAIN (ANALYZE, WAL)
    counts them for this backend: immune to what other databases of the server write."""
    from django.db import connection, transaction

    table = "reliable_messaging_processedmessage"
    total = 0
    with connection.cursor() as cursor:
        for _ in range(batches):
            ids = new_ids(kind, size)
            rows = ", ".join(["(%s, %s, now())"] * size)
            params = [value for message_id in ids for value in (consumer, message_id)]
            with transaction.atomic():
                cursor.execute(
                    f"EXPLAIN (ANALYZE, WAL, FORMAT JSON) INSERT INTO {table} "
                    f"(consumer, message_id, processed_at) VALUES {rows} "
                    "ON CONFLICT DO NOTHING",
                    params,
                )
                plan = cursor.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            total += int(plan[0]["Plan"].get("WAL Bytes", 0))
    return total / (batches * size)


def wal_lsn() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        return int(cursor.fetchone()[0])


def inbox_scale(
    spec: Any,
    exchange: str,
    sizes: list[int],
    kinds: list[str],
    n: int,
    concurrency: int,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Consume ``n`` messages with the consumer's inbox at each of ``sizes`` rows, per id
    kind, ``rounds`` times (each with the raw baseline just before); the medians go in the
    summary, since a shared machine's noise is larger than the effect looked for."""
    rows: list[dict[str, Any]] = []
    base_ms = time.time_ns() // 1_000_000 - max(sizes) - 3_600_000
    for kind in kinds:
        prepare_inbox()
        have = 0
        for size in sorted(sizes):
            print(f"{kind} ids, inbox at {size:,} rows:", flush=True)
            fill_inbox(spec.name, kind, have, size, base_ms, max(sizes))
            have = size
            measured = [
                measure_step(spec, exchange, kind, size, n, concurrency) for _ in range(rounds)
            ]
            row = dict(measured[0])
            for key, value in measured[0].items():
                if isinstance(value, int | float) and key != "inbox_rows":
                    row[key] = statistics.median(m[key] for m in measured)
            row["rounds"] = [{k: m[k] for k in ("app_msgs_per_s", "ratio")} for m in measured]
            rows.append(row)
    label = "median of " + str(rounds) + " rounds, " if rounds > 1 else ""
    print(
        f"| ids | inbox rows | app msg/s ({label}each) | ratio to raw | app WAL/msg "
        "| raw WAL/msg | inbox insert WAL/row |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        each = ", ".join(f"{r['app_msgs_per_s']:,}" for r in row["rounds"])
        print(
            f"| {row['ids']} | {row['inbox_rows']:,} | {row['app_msgs_per_s']:,.0f} ({each}) | "
            f"{row['ratio']:.2f}x | {row['app_wal_bytes_per_msg'] / 1024:.2f} KiB | "
            f"{row['raw_wal_bytes_per_msg'] / 1024:.2f} KiB | "
            f"{row['inbox_insert_wal_bytes_per_row'] / 1024:.2f} KiB |"
        )
    for kind in kinds:
        mine = [row for row in rows if row["ids"] == kind]
        if len(mine) > 1:
            first, last = mine[0], mine[-1]
            print(
                f"{kind}: at {last['inbox_rows']:,} rows the app keeps "
                f"{last['app_msgs_per_s'] / first['app_msgs_per_s']:.0%} of its throughput at "
                f"{first['inbox_rows']:,} rows, {last['ratio'] / first['ratio']:.0%} of its "
                f"ratio to the raw baseline (target >= 90% for uuid7)"
            )
    return rows


def measure_step(
    spec: Any, exchange: str, kind: str, size: int, n: int, concurrency: int
) -> dict[str, Any]:
    """The raw baseline, then the app, over ``n`` fresh messages of ``kind`` each."""
    from reliable_messaging.conf import messaging_settings

    fill(exchange, new_ids(kind, n), {"n": 1})
    wal = wal_lsn()
    raw_s = raw_baseline(spec.queue, n, messaging_settings.prefetch)
    raw_wal = (wal_lsn() - wal) / n
    fill(exchange, new_ids(kind, n), {"n": 1})
    wal = wal_lsn()
    if PROFILE is not None:
        PROFILE.report(1)  # forget the statements of the set-up
    app_s = run_service(spec, n, f"{kind} at {size}", concurrency)
    app_wal = (wal_lsn() - wal) / n
    if PROFILE is not None:
        print("  SQL time per message (both worker threads, summed):")
        PROFILE.report(n)
    insert_wal = inbox_insert_wal(spec.name, kind)
    row: dict[str, Any] = {
        "ids": kind,
        "inbox_rows": size,
        "app_msgs_per_s": round(n / app_s),
        "raw_msgs_per_s": round(n / raw_s),
        "ratio": round(raw_s / app_s, 2),
        "app_wal_bytes_per_msg": round(app_wal),
        "raw_wal_bytes_per_msg": round(raw_wal),
        "inbox_insert_wal_bytes_per_row": round(insert_wal),
    }
    print(
        f"  app {row['app_msgs_per_s']:,} msg/s ({row['ratio']}x raw "
        f"{row['raw_msgs_per_s']:,} msg/s); WAL per message: app "
        f"{app_wal / 1024:.2f} KiB, raw {raw_wal / 1024:.2f} KiB (the server's, all "
        f"databases); the inbox insert alone {insert_wal / 1024:.2f} KiB per row",
        flush=True,
    )
    return row


def print_memory(total: int, rss_10k: int, rss_end: int, rate: float) -> None:
    growth = rss_end / rss_10k - 1 if rss_10k else float("nan")
    print(
        f"consumer RSS (manage.py consume, concurrency 2): {rss_10k / 1024:.1f} MiB after "
        f"10,000 messages vs {rss_end / 1024:.1f} MiB after {total:,} ({growth:+.1%}; target "
        f"within 10%); {rate:,.0f} msg/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--memory-messages", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--guard-cost",
        action="store_true",
        help="only measure what the handler time limit costs the happy path (on vs off)",
    )
    parser.add_argument(
        "--inbox-rows",
        help="comma-separated inbox sizes (e.g. 0,5000000,30000000): measure the consumer "
        "against an inbox of each size instead of the default runs (then the memory run, "
        "unless --memory-messages 0)",
    )
    parser.add_argument(
        "--ids",
        default="uuid7,uuid4",
        help="with --inbox-rows: kinds of message id, uuid7 (time-ordered) and/or uuid4",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --inbox-rows: measurements per step (the summary shows their medians)",
    )
    parser.add_argument(
        "--handler",
        choices=("orm", "sql"),
        default="orm",
        help="with --inbox-rows: the handler's insert through the ORM (Effect.objects.create, "
        "as a Django handler writes) or as the baseline's own SQL statement, which leaves the "
        "consumer's machinery as the only difference from the baseline",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="with --inbox-rows: print the app's SQL time per message by kind of statement",
    )
    args = parser.parse_args()
    if args.profile:
        global PROFILE
        PROFILE = StatementProfile()
        PROFILE.install()

    namespace = setup_django()
    import logging

    from django.conf import settings as django_settings
    from django.db import connections
    from django.db.models import Count
    from django.test import override_settings

    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.testing import find_consumer
    from tests.testapp.models import Effect

    # One line per message at INFO would time the terminal: log warnings only, in this process.
    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
    connections["default"].settings_dict["CONN_MAX_AGE"] = 60
    # The default retention (the test settings shorten it), so the inbox has its 14 days of
    # partitions, as in production.
    settings = {
        **django_settings.RELIABLE_MESSAGING,
        "CACHE_ALIAS": None,
        "DEDUP_RETENTION": dt.timedelta(days=14),
    }
    spec = find_consumer("tests.alpha")
    if args.handler == "sql":
        if args.inbox_rows is None:
            # The default runs also time subprocesses (manage.py consume), which run the
            # registered handler whatever this process says.
            parser.error("--handler sql goes with --inbox-rows")
        spec = dataclasses.replace(spec, handler=insert_effect_sql)
    exchange = messaging_settings.exchange
    n = args.messages
    with override_settings(RELIABLE_MESSAGING=settings):
        connection = pika.BlockingConnection(pika.URLParameters(BROKER))
        declare_topology(connection.channel(), [spec], messaging_settings)
        connection.close()
        if args.inbox_rows is not None:
            print(f"machine: {describe_machine()}")
            sizes = [int(size) for size in args.inbox_rows.split(",")]
            kinds = [kind.strip() for kind in args.ids.split(",")]
            if unknown := set(kinds) - set(ID_SQL):
                parser.error(f"unknown --ids {sorted(unknown)}; use uuid7 and/or uuid4")
            rows = inbox_scale(
                spec, exchange, sizes, kinds, n, args.concurrency, rounds=args.rounds
            )
            result_scale: dict[str, object] = {"messages": n, "inbox_scale": rows}
            if args.memory_messages:
                rss_10k, rss_end, mem_rate = memory_run(
                    namespace, exchange, spec.queue, args.memory_messages
                )
                print_memory(args.memory_messages, rss_10k, rss_end, mem_rate)
                result_scale.update(
                    consumer_rss_kib_after_10k=rss_10k, consumer_rss_kib_at_end=rss_end
                )
            print(json.dumps(result_scale))
            return
        Effect.objects.all().delete()
        prefetch = messaging_settings.prefetch

        fill(exchange, [f"raw-{uuid.uuid4()}" for _ in range(n)], {"n": 1})
        raw_s = raw_baseline(spec.queue, n, prefetch)

        # The happy path with the handler time limit (a watchdog entry per handler call) and
        # without it (HANDLER_TIMEOUT 0), alternated so that drift hits both alike. The crash
        # guard costs the happy path nothing: it only acts on redelivered deliveries.
        guard = {"on": 0.0, "off": 0.0}
        for round_ in range(2):
            for state, timeout in (("on", 600.0), ("off", 0.0)):
                limited = {**settings, "HANDLER_TIMEOUT": timeout}
                with override_settings(RELIABLE_MESSAGING=limited):
                    fill(exchange, [f"g{state}{round_}-{uuid.uuid4()}" for _ in range(n)], {"n": 1})
                    guard[state] += run_service(spec, n, f"time limit {state}", args.concurrency)
        guard_ratio = round(guard["off"] / guard["on"], 3)
        print(
            f"happy path, time limit on: {2 * n / guard['on']:,.0f} msg/s; off: "
            f"{2 * n / guard['off']:,.0f} msg/s; on/off = {guard_ratio} (target >= 0.95); "
            f"raw baseline {n / raw_s:,.0f} msg/s"
        )
        if args.guard_cost:
            return

        ids = [f"app-{uuid.uuid4()}" for _ in range(n)]
        fill(exchange, ids, {"n": 1})
        app_s = run_service(spec, n, "app", args.concurrency)

        fresh = [f"one-{uuid.uuid4()}" for _ in range(n // 2)]
        fill(exchange, fresh, {"n": 1})
        single_s = run_service(spec, n // 2, "app, concurrency 1", 1)

        fill(exchange, ids, {"n": 1})
        dup_db_s = run_service(spec, n, "duplicates, database", args.concurrency)

        # Scaling out: two baseline workers against two consume processes.
        fill(exchange, [f"raw2-{uuid.uuid4()}" for _ in range(n)], {"n": 1})
        raw2_s = raw_baseline_parallel(spec.queue, n, prefetch, 2)
        fill(exchange, [f"proc2-{uuid.uuid4()}" for _ in range(n)], {"n": 1})
        proc2_s = processes_run(namespace, spec.queue, n, 2)

    doubled = (
        Effect.objects.exclude(consumer="baseline")
        .values("message_id")
        .order_by()
        .annotate(c=Count("id"))
        .filter(c__gt=1)
        .count()
    )
    # --memory-messages 0 skips the memory run: its figures are left out, not printed as zeros.
    rss_10k, rss_end, mem_rate = (
        memory_run(namespace, exchange, spec.queue, args.memory_messages)
        if args.memory_messages
        else (0, 0, 0.0)
    )

    raw_rate, app_rate = n / raw_s, n / app_s
    result = {
        "machine": describe_machine(),
        "messages": n,
        "raw_pika_psycopg_msgs_per_s": round(raw_rate),
        "app_msgs_per_s": round(app_rate),
        "app_concurrency": args.concurrency,
        "ratio": round(app_rate / raw_rate, 2),
        "time_limit_on_msgs_per_s": round(2 * n / guard["on"]),
        "time_limit_off_msgs_per_s": round(2 * n / guard["off"]),
        "time_limit_on_off_ratio": guard_ratio,
        "app_concurrency_1_msgs_per_s": round((n // 2) / single_s),
        "raw_two_workers_msgs_per_s": round(n / raw2_s),
        "app_two_processes_msgs_per_s": round(n / proc2_s),
        "two_processes_ratio_to_raw": round((n / proc2_s) / raw_rate, 2),
        "two_processes_ratio_to_raw_two_workers": round(raw2_s / proc2_s, 2),
        "duplicates_per_s_database": round(n / dup_db_s),
        "doubled_effects": doubled,
    }
    if args.memory_messages:
        result.update(
            memory_messages=args.memory_messages,
            consumer_rss_kib_after_10k=rss_10k,
            consumer_rss_kib_at_end=rss_end,
            consumer_rss_growth=round(rss_end / rss_10k - 1, 3) if rss_10k else None,
            memory_run_msgs_per_s=round(mem_rate),
        )
    print(f"machine: {result['machine']}")
    print(
        f"raw pika + psycopg (one transaction per message): {n} in {raw_s:.2f}s = "
        f"{raw_rate:,.0f} msg/s"
    )
    print(
        f"reliable_messaging consumer, concurrency {args.concurrency}: {n} in {app_s:.2f}s = "
        f"{app_rate:,.0f} msg/s; ratio app/raw = {result['ratio']} (target >= 1.0, aim 2.0)"
    )
    print(f"  concurrency 1: {result['app_concurrency_1_msgs_per_s']:,} msg/s")
    print(
        f"two manage.py consume processes (concurrency 1 each): "
        f"{result['app_two_processes_msgs_per_s']:,} msg/s; ratio to the raw baseline = "
        f"{result['two_processes_ratio_to_raw']}; two raw baseline workers: "
        f"{result['raw_two_workers_msgs_per_s']:,} msg/s (ratio "
        f"{result['two_processes_ratio_to_raw_two_workers']})"
    )
    print(f"duplicates: {result['duplicates_per_s_database']:,}/s through the database")
    print(f"doubled effects: {doubled}")
    if args.memory_messages:
        print_memory(args.memory_messages, rss_10k, rss_end, mem_rate)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
