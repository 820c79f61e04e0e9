"""Consumer benchmark: the idempotent consumer against raw pika + one psycopg transaction per
message, duplicates per second with and without the Redis fast path, and memory over 100,000
messages.

    .venv/bin/python bench/consume.py [--messages 20000] [--memory-messages 100000]

The handler (tests.testapp's alpha) writes one row. The baseline consumes the same messages
from the same queue with raw pika (prefetch as PREFETCH) and, per message, inserts that same row
with psycopg and commits, then acks: the cheapest honest at-least-once consumer, without the
inbox. The app's consumer runs in this process (ConsumerService, the engine of `manage.py
consume`) with CONN_MAX_AGE=60, as the README recommends. Messages are published beforehand,
so both sides consume a full queue.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

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
        payload = json.loads(body)
        with db.transaction(), db.cursor() as cursor:
            cursor.execute(
                "INSERT INTO testapp_effect (consumer, message_id, attempt, payload, created_at)"
                " VALUES (%s, %s, %s, %s, now())",
                ("baseline", properties.message_id, 1, json.dumps(payload)),
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
                payload = json.loads(body)
                with db.transaction(), db.cursor() as cursor:
                    cursor.execute(
                        "INSERT INTO testapp_effect"
                        " (consumer, message_id, attempt, payload, created_at)"
                        " VALUES (%s, %s, %s, %s, now())",
                        ("baseline", properties.message_id, 1, json.dumps(payload)),
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
    """Run ConsumerService until ``count`` new outcomes were settled; seconds."""
    from reliable_messaging.consumer_service import ConsumerService

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

    service = ConsumerService([queue_spec], concurrency=concurrency, on_outcome=on_outcome)
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
    args = parser.parse_args()

    namespace = setup_django()
    import logging

    from django.conf import settings as django_settings
    from django.db import connections
    from django.db.models import Count
    from django.test import override_settings

    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.testing import find_consumer
    from reliable_messaging.topology import declare_topology
    from tests.testapp.models import Effect

    # One line per message at INFO would time the terminal: log warnings only, in this process.
    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
    connections["default"].settings_dict["CONN_MAX_AGE"] = 60
    settings = {**django_settings.RELIABLE_MESSAGING, "CACHE_ALIAS": None}
    spec = find_consumer("tests.alpha")
    exchange = messaging_settings.exchange
    n = args.messages
    with override_settings(RELIABLE_MESSAGING=settings):
        connection = pika.BlockingConnection(pika.URLParameters(BROKER))
        declare_topology(connection.channel(), [spec], messaging_settings)
        connection.close()
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

    cached = {**settings, "CACHE_ALIAS": "messaging"}
    with override_settings(RELIABLE_MESSAGING=cached):
        warm = [f"warm-{uuid.uuid4()}" for _ in range(n)]
        fill(exchange, warm, {"n": 1})
        cached_s = run_service(spec, n, "app with the fast path", args.concurrency)
        fill(exchange, warm, {"n": 1})
        dup_cache_s = run_service(spec, n, "duplicates, fast path", args.concurrency)

    doubled = (
        Effect.objects.exclude(consumer="baseline")
        .values("message_id")
        .order_by()
        .annotate(c=Count("id"))
        .filter(c__gt=1)
        .count()
    )
    rss_10k, rss_end, mem_rate = memory_run(namespace, exchange, spec.queue, args.memory_messages)

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
        "app_with_fast_path_msgs_per_s": round(n / cached_s),
        "raw_two_workers_msgs_per_s": round(n / raw2_s),
        "app_two_processes_msgs_per_s": round(n / proc2_s),
        "two_processes_ratio_to_raw": round((n / proc2_s) / raw_rate, 2),
        "two_processes_ratio_to_raw_two_workers": round(raw2_s / proc2_s, 2),
        "duplicates_per_s_database": round(n / dup_db_s),
        "duplicates_per_s_fast_path": round(n / dup_cache_s),
        "doubled_effects": doubled,
        "memory_messages": args.memory_messages,
        "consumer_rss_kib_after_10k": rss_10k,
        "consumer_rss_kib_at_end": rss_end,
        "consumer_rss_growth": round(rss_end / rss_10k - 1, 3) if rss_10k else None,
        "memory_run_msgs_per_s": round(mem_rate),
    }
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
    print(f"  with the Redis fast path on: {result['app_with_fast_path_msgs_per_s']:,} msg/s")
    print(
        f"two manage.py consume processes (concurrency 1 each): "
        f"{result['app_two_processes_msgs_per_s']:,} msg/s; ratio to the raw baseline = "
        f"{result['two_processes_ratio_to_raw']}; two raw baseline workers: "
        f"{result['raw_two_workers_msgs_per_s']:,} msg/s (ratio "
        f"{result['two_processes_ratio_to_raw_two_workers']})"
    )
    print(
        f"duplicates: {result['duplicates_per_s_database']:,}/s through the database, "
        f"{result['duplicates_per_s_fast_path']:,}/s with the Redis fast path"
    )
    print(f"doubled effects: {doubled}")
    print(
        f"consumer RSS over {args.memory_messages:,} messages (manage.py consume, concurrency 2):"
        f" {rss_10k / 1024:.1f} MiB after 10,000, {rss_end / 1024:.1f} MiB at the end "
        f"({result['consumer_rss_growth']:+.1%}; target within 10%); {mem_rate:,.0f} msg/s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
