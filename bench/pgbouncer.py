"""Commit-to-broker latency through a transaction-pooling PgBouncer, against PostgreSQL directly.

    .venv/bin/python bench/pgbouncer.py [--rows 20]

A real ``manage.py relay`` process and ``publish()`` in this process (autocommit, its wake-up as
shipped), three ways in one run, each with a relay of its own:

1. direct: both on PostgreSQL (the baseline);
2. PgBouncer (``pool_mode = transaction``, the suite's rig: ``tests/pgbouncer.py``) for both, the
   relay's LISTEN on a direct session (``RELAY_LISTEN_DSN``): goal p50 <= 50 ms;
3. PgBouncer for both and for the LISTEN too, which then hears nothing: the relay finds that out
   and polls every ``RELAY_POLL_INTERVAL`` (1 s, the default): goal p50 <= that + 50 ms.

The rows are published one at a time, 1.5 to 2.5 s apart: past the relay's trail of claims after
it sent rows (1.3 s), so each row waits for a wake-up or a poll, not for a claim already coming.
Latency is arrival on a queue minus the time taken just before ``publish()``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pika
from _common import (
    BENCH_DB,
    BROKER_URL,
    ROOT,
    declare_sink,
    describe_machine,
    drop_sink,
    percentile,
    setup_django,
    subprocess_env,
)

POLL_INTERVAL = 1.0  # RELAY_POLL_INTERVAL's default
DIRECT_LISTEN = f"host=127.0.0.1 port=5432 dbname={BENCH_DB}"


@contextmanager
def relay(namespace: str, database_url: str, overrides: dict[str, str]) -> Iterator[None]:
    env = subprocess_env(
        namespace,
        DATABASE_URL=database_url,
        DJANGO_SETTINGS_MODULE="tests.integration.publishing.relay_settings",
        RM_OUTBOX_OVERRIDES=json.dumps({"RELAY_POLL_INTERVAL": POLL_INTERVAL, **overrides}),
        RM_LOG_LEVEL="WARNING",
    )
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(8)  # it connects, LISTENs, and its probe is heard (or found missing, 5 s)
        yield
    finally:
        process.terminate()
        process.wait(60)


def latencies(exchange: str, queue: str, rows: int) -> list[float]:
    """Milliseconds from just before each publish() to its arrival on ``queue``."""
    from reliable_messaging import publish

    found: list[float] = []
    arrived = threading.Event()

    def consume() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        for _method, properties, _body in channel.consume(
            queue, auto_ack=True, inactivity_timeout=30
        ):
            if properties is None:
                break  # a row lost for 30 s: the run says so by its count
            started_us: Any = (properties.headers or {}).get("x-bench-started-at")
            found.append(time.time_ns() / 1e6 - started_us / 1000)
            arrived.set()
            if len(found) >= rows:
                break
        connection.close()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    rng = random.Random(33)
    for i in range(rows):
        time.sleep(rng.uniform(1.5, 2.5))
        arrived.clear()
        publish(
            "bench.pgbouncer",
            {"i": i},
            exchange=exchange,
            headers={"x-bench-started-at": time.time_ns() // 1000},
        )
        arrived.wait(30)
        if not consumer.is_alive():
            raise RuntimeError("the bench's consumer stopped (the broker closed it?): run again")
    consumer.join(timeout=60)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    namespace = setup_django()
    sys.path.insert(0, str(ROOT))
    from tests.pgbouncer import PgBouncer, routed

    exchange = f"rmbench.{namespace}"
    queue = f"{exchange}.pgbouncer"
    declare_sink(exchange, queue, "bench.pgbouncer")
    bouncer = PgBouncer()
    results: dict[str, list[float]] = {}
    try:
        direct_url = os.environ["DATABASE_URL"]
        pooled_url = bouncer.url(BENCH_DB)
        runs = [
            ("direct to PostgreSQL", direct_url, {}),
            ("PgBouncer, LISTEN direct", pooled_url, {"RELAY_LISTEN_DSN": DIRECT_LISTEN}),
            ("PgBouncer, LISTEN through it", pooled_url, {}),
        ]
        for name, url, overrides in runs:
            port = 5432 if url == direct_url else bouncer.port
            with routed("127.0.0.1", port, BENCH_DB), relay(namespace, url, overrides):
                results[name] = latencies(exchange, queue, args.rows)
    finally:
        bouncer.stop()
        drop_sink(exchange, queue)
    print(f"Commit-to-broker latency, {args.rows} rows each, 1.5-2.5 s apart; {describe_machine()}")
    print(f"PgBouncer 1.18 transaction pooling; RELAY_POLL_INTERVAL = {POLL_INTERVAL:g} s")
    base = percentile(results["direct to PostgreSQL"], 50)
    goals = {
        "PgBouncer, LISTEN direct": 50.0,
        "PgBouncer, LISTEN through it": POLL_INTERVAL * 1000 + 50,
    }
    for name, values in results.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        goal = goals.get(name)
        verdict = "" if goal is None else f"  goal p50 <= {goal:.0f} ms: {p50 <= goal}"
        print(
            f"  {name:30} n={len(values):3}  p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  "
            f"x{p50 / base:5.1f} of direct{verdict}"
        )


if __name__ == "__main__":
    main()
