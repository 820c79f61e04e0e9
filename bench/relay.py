"""Relay benchmark: outbox relay throughput against raw pika with pipelined confirms, and
commit-to-broker latency at a steady rate with LISTEN/NOTIFY.

    .venv/bin/python bench/relay.py [--rows 20000] [--rate 500] [--seconds 10]

Both throughput runs publish the same bodies and properties to the same durable queue, on the
same machine, in the same run; the ratio is relay / raw.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    ROOT,
    declare_sink,
    describe_machine,
    drop_sink,
    percentile,
    setup_django,
    subprocess_env,
    vm_rss_kib,
)


def raw_pika_publish(exchange: str, rows: list[tuple[str, bytes]]) -> float:
    """Publish every body with confirms kept in flight, settled as they come (multiple=True):
    the fastest honest way pika can do it. Returns seconds."""
    params = pika.URLParameters("amqp://guest:guest@127.0.0.1/%2F")
    state = {"confirmed": 0, "start": 0.0, "end": 0.0}

    def on_open(connection: pika.SelectConnection) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel: pika.channel.Channel) -> None:
        outstanding: set[int] = set()

        def on_confirm(frame: pika.frame.Method) -> None:
            tag = frame.method.delivery_tag
            settled = [t for t in outstanding if t <= tag] if frame.method.multiple else [tag]
            for t in settled:
                outstanding.discard(t)
            state["confirmed"] += len(settled)
            if state["confirmed"] >= len(rows):
                state["end"] = time.perf_counter()
                channel.connection.close()

        def publish_all(_frame: object) -> None:
            state["start"] = time.perf_counter()
            for tag, (message_id, body) in enumerate(rows, start=1):
                outstanding.add(tag)
                channel.basic_publish(
                    exchange,
                    "bench.raw",
                    body,
                    pika.BasicProperties(
                        content_type="application/json",
                        delivery_mode=2,
                        message_id=message_id,
                        timestamp=int(time.time()),
                        headers={"x-rm-published-at": 0},
                    ),
                    mandatory=True,
                )

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=publish_all)

    connection = pika.SelectConnection(
        params, on_open_callback=on_open, on_close_callback=lambda c, r: c.ioloop.stop()
    )
    connection.ioloop.start()
    return state["end"] - state["start"]


def vacuum_outbox() -> None:
    """What autovacuum does on a normal server (this machine's PostgreSQL runs with it off):
    without it the outbox's dead rows pile up run after run and every claim wades through
    them."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE reliable_messaging_outboxmessage")


def relay_throughput(
    rows: int, exchange: str, lanes: int = 1
) -> tuple[float, list[tuple[str, bytes]]]:
    from django.db import transaction
    from django.test import override_settings

    from reliable_messaging import publish
    from reliable_messaging.models import OutboxMessage
    from reliable_messaging.publishing.lanes import run_lanes
    from reliable_messaging.publishing.relay import OutboxRelay

    OutboxMessage.objects.all().delete()
    with transaction.atomic():
        for i in range(rows):
            publish(
                "bench.order",
                {"order_id": i, "amount": "19.99", "customer": f"c{i % 97}"},
                exchange=exchange,
            )
    vacuum_outbox()
    bodies = [
        (m, b.encode())
        for m, b in OutboxMessage.objects.order_by("id").values_list("message_id", "body")
    ]
    with override_settings(RELIABLE_MESSAGING={**_settings(), "EXCHANGE": exchange}):
        started = time.perf_counter()
        report = run_lanes([OutboxRelay(once=True, listen=False) for _ in range(lanes)])
        elapsed = time.perf_counter() - started
    assert report.sent == rows, report.summary()
    return elapsed, bodies


def _settings() -> dict:
    from django.conf import settings

    return dict(settings.RELIABLE_MESSAGING)


def latency(
    namespace: str, exchange: str, queue: str, rate: int, seconds: float, lanes: int = 1
) -> list[float]:
    """Publish in autocommit at ``rate``/s while a `manage.py relay` process (LISTEN/NOTIFY)
    runs; measure commit→arrival on the queue from the row's created_at header."""
    from django.db import connection

    from reliable_messaging import publish

    vacuum_outbox()
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay", "--lanes", str(lanes)],
        env=subprocess_env(namespace),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    latencies: list[float] = []
    total = int(rate * seconds)
    done = threading.Event()

    def consume() -> None:
        conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1/%2F"))
        channel = conn.channel()
        for _method, properties, _body in channel.consume(
            queue, auto_ack=True, inactivity_timeout=1
        ):
            if properties is None:
                if done.is_set():
                    break
                continue
            sent_us = (properties.headers or {}).get("x-rm-committed-at")
            if sent_us is not None:
                latencies.append(time.time_ns() / 1e6 - sent_us / 1000)
            if len(latencies) >= total:
                break
        conn.close()

    consumer = threading.Thread(target=consume, daemon=True)
    time.sleep(2)  # the relay connects and starts listening
    consumer.start()
    interval = 1 / rate
    next_at = time.perf_counter()
    for i in range(total):
        # Autocommit: each publish commits at once and its NOTIFY wakes the relay. The header
        # carries the commit time (taken right after the insert returned).
        publish(
            "bench.latency",
            {"i": i},
            exchange=exchange,
            headers={"x-rm-committed-at": time.time_ns() // 1000},
        )
        next_at += interval
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    done.set()
    consumer.join(timeout=30)
    relay.terminate()
    relay.wait(timeout=30)
    connection.close()
    return latencies


def relay_memory(namespace: str, exchange: str, queue: str, total: int) -> tuple[int, int]:
    """A real `manage.py relay` process sending ``total`` rows published while it runs: its
    VmRSS (KiB) once 10,000 were sent and at the end."""
    from django.db import transaction

    from reliable_messaging import publish
    from reliable_messaging.choices import OutboxStatus
    from reliable_messaging.models import OutboxMessage

    OutboxMessage.objects.all().delete()
    vacuum_outbox()
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay", "--progress-interval", "0"],
        env=subprocess_env(namespace),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sink = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1/%2F"))
    channel = sink.channel()
    rss_10k = 0

    def sent() -> int:
        return OutboxMessage.objects.filter(status=OutboxStatus.SENT).count()

    try:
        for start in range(0, total, 2000):
            with transaction.atomic():
                for i in range(start, min(total, start + 2000)):
                    publish("bench.memory", {"order_id": i, "amount": "19.99"}, exchange=exchange)
            channel.queue_purge(queue)  # keep the broker's memory out of the picture
            if not rss_10k and sent() >= 10_000:
                rss_10k = vm_rss_kib(relay.pid) or 0
        deadline = time.monotonic() + 600
        while sent() < total and time.monotonic() < deadline:
            if not rss_10k and sent() >= 10_000:
                rss_10k = vm_rss_kib(relay.pid) or 0
            time.sleep(0.5)
        rss_end = vm_rss_kib(relay.pid) or 0
    finally:
        relay.terminate()
        relay.wait(timeout=60)
        channel.queue_purge(queue)
        sink.close()
    return rss_10k, rss_end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--memory-rows", type=int, default=100_000)
    args = parser.parse_args()

    namespace = setup_django()
    exchange = f"rmtest.{namespace}"
    queue = f"{namespace}.sink"
    declare_sink(exchange, queue)
    try:
        one_s, bodies = relay_throughput(args.rows, exchange, lanes=1)
        declare_sink(exchange, queue)  # purge
        two_s, _ = relay_throughput(args.rows, exchange, lanes=2)
        declare_sink(exchange, queue)
        raw_s = raw_pika_publish(exchange, bodies)
        declare_sink(exchange, queue)
        lat = latency(namespace, exchange, queue, args.rate, args.seconds, lanes=1)
        declare_sink(exchange, queue)
        lat2 = latency(namespace, exchange, queue, args.rate, args.seconds, lanes=2)
        rss_10k, rss_end = relay_memory(namespace, exchange, queue, args.memory_rows)
    finally:
        drop_sink(exchange, queue)
    one_rate, two_rate, raw_rate = args.rows / one_s, args.rows / two_s, args.rows / raw_s
    result = {
        "machine": describe_machine(),
        "rows": args.rows,
        "relay_1_lane_msgs_per_s": round(one_rate),
        "relay_2_lanes_msgs_per_s": round(two_rate),
        "raw_pika_confirms_msgs_per_s": round(raw_rate),
        "ratio_1_lane": round(one_rate / raw_rate, 2),
        "ratio_2_lanes": round(two_rate / raw_rate, 2),
        "latency_rate_per_s": args.rate,
        "latency_messages": len(lat),
        "latency_p50_ms": round(percentile(lat, 50), 1),
        "latency_p99_ms": round(percentile(lat, 99), 1),
        "latency_2_lanes_p50_ms": round(percentile(lat2, 50), 1),
        "latency_2_lanes_p99_ms": round(percentile(lat2, 99), 1),
        "memory_rows": args.memory_rows,
        "relay_rss_kib_after_10k": rss_10k,
        "relay_rss_kib_at_end": rss_end,
        "relay_rss_growth": round(rss_end / rss_10k - 1, 3) if rss_10k else None,
    }
    print(f"machine: {result['machine']}")
    print(f"relay, 1 lane:  {args.rows} rows in {one_s:.2f}s = {one_rate:,.0f} msg/s (default)")
    print(f"relay, 2 lanes: {args.rows} rows in {two_s:.2f}s = {two_rate:,.0f} msg/s")
    print(
        f"raw pika:       {args.rows} msgs in {raw_s:.2f}s = {raw_rate:,.0f} msg/s (pipelined "
        f"confirms, one connection)"
    )
    print(
        f"ratio relay/raw = {result['ratio_1_lane']} (1 lane), {result['ratio_2_lanes']} "
        f"(2 lanes); target >= 0.5, aim 0.7"
    )
    print(
        f"commit->broker latency at {args.rate} msg/s, LISTEN/NOTIFY, {len(lat)} messages: "
        f"1 lane p50 {result['latency_p50_ms']} ms, p99 {result['latency_p99_ms']} ms; "
        f"2 lanes p50 {result['latency_2_lanes_p50_ms']} ms, "
        f"p99 {result['latency_2_lanes_p99_ms']} ms"
    )
    if rss_10k:
        print(
            f"relay RSS over {args.memory_rows:,} rows (manage.py relay): "
            f"{rss_10k / 1024:.1f} MiB after 10,000 sent, {rss_end / 1024:.1f} MiB at the end "
            f"({rss_end / rss_10k - 1:+.1%}; target within 10%)"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
