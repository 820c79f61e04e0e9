"""Relay benchmark: what a second lane and coalesced writes buy, throughput against raw pika
with pipelined confirms, and commit-to-broker latency at a steady rate with LISTEN/NOTIFY.

    .venv/bin/python bench/relay.py [--rows 20000] [--rounds 5] [--rate 500] [--seconds 10]

Each round sends ``--rows`` rows four ways, in an order that rotates from round to round so
that drift hits all alike: the relay with one lane (the default), with two lanes (``relay
--lanes 2``), with one lane and pika's writes left as pika makes them (``coalesce_writes``
replaced by a no-op: one ``send()`` per frame), and raw pika publishing the same bodies and
properties to the same durable queue. Each round prints its figures and ratios; then the
median ratio of each comparison and its spread. ``--seconds 0`` skips the latency runs,
``--memory-rows 0`` the memory run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

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


def fill_outbox(rows: int, exchange: str) -> list[tuple[str, bytes]]:
    """``rows`` rows published in one transaction, vacuumed; their ids and bodies."""
    from django.db import transaction

    from reliable_messaging import publish
    from reliable_messaging.models import OutboxMessage

    OutboxMessage.objects.all().delete()
    with transaction.atomic():
        for i in range(rows):
            publish(
                "bench.order",
                {"order_id": i, "amount": "19.99", "customer": f"c{i % 97}"},
                exchange=exchange,
            )
    vacuum_outbox()
    return [
        (m, b.encode())
        for m, b in OutboxMessage.objects.order_by("id").values_list("message_id", "body")
    ]


def relay_throughput(rows: int, exchange: str, lanes: int = 1, coalesce: bool = True) -> float:
    """Seconds for ``manage.py relay --once``'s engine to send ``rows`` fresh rows."""
    from unittest import mock

    from django.test import override_settings

    from reliable_messaging.broker import publisher
    from reliable_messaging.publishing.lanes import run_lanes
    from reliable_messaging.publishing.relay import build_relay

    fill_outbox(rows, exchange)
    writes = publisher.coalesce_writes if coalesce else (lambda connection: 0)
    with (
        override_settings(RELIABLE_MESSAGING={**_settings(), "EXCHANGE": exchange}),
        mock.patch.object(publisher, "coalesce_writes", writes),
    ):
        started = time.perf_counter()
        report = run_lanes([build_relay(once=True, listen=False) for _ in range(lanes)])
        elapsed = time.perf_counter() - started
    assert report.sent == rows, report.summary()
    return elapsed


# What each round measures: (lanes, coalesced writes), or None for raw pika.
VARIANTS: dict[str, tuple[int, bool] | None] = {
    "1 lane": (1, True),
    "2 lanes": (2, True),
    "1 lane, writes not coalesced": (1, False),
    "raw pika": None,
}
# The ratios each round prints: (name, numerator, denominator).
RATIOS = [
    ("2 lanes / 1 lane", "2 lanes", "1 lane"),
    ("coalesced / not coalesced", "1 lane", "1 lane, writes not coalesced"),
    ("1 lane / raw pika", "1 lane", "raw pika"),
    ("2 lanes / raw pika", "2 lanes", "raw pika"),
]


def throughput_rounds(
    rows: int, exchange: str, queue: str, rounds: int
) -> tuple[list[dict[str, float]], dict[str, list[float]]]:
    """``rounds`` rounds of the four variants, rotating their order; per round the msg/s of
    each, and the ratios of RATIOS."""
    bodies = fill_outbox(rows, exchange)  # raw pika's messages, the relay's own
    relay_throughput(rows // 4, exchange)  # a warm-up, not counted
    declare_sink(exchange, queue)
    names = list(VARIANTS)
    rates: list[dict[str, float]] = []
    ratios: dict[str, list[float]] = {name: [] for name, _, _ in RATIOS}
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        rate: dict[str, float] = {}
        for name in order:
            variant = VARIANTS[name]
            if variant is None:
                seconds = raw_pika_publish(exchange, bodies)
            else:
                seconds = relay_throughput(rows, exchange, *variant)
            rate[name] = rows / seconds
            declare_sink(exchange, queue)  # purge
        rates.append(rate)
        line = ", ".join(f"{name} {rate[name]:,.0f}" for name in order)
        shown = []
        for label, top, bottom in RATIOS:
            ratios[label].append(round(rate[top] / rate[bottom], 3))
            shown.append(f"{label} {ratios[label][-1]}")
        print(f"round {round_ + 1} msg/s: {line}; {'; '.join(shown)}", flush=True)
    return rates, ratios


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
            sent_us: Any = (properties.headers or {}).get("x-rm-committed-at")
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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--memory-rows", type=int, default=100_000)
    args = parser.parse_args()

    namespace = setup_django()
    exchange = f"rmtest.{namespace}"
    queue = f"{namespace}.sink"
    declare_sink(exchange, queue)
    lat: list[float] = []
    lat2: list[float] = []
    rss_10k = rss_end = 0
    print(f"machine: {describe_machine()}")
    print(f"{args.rows:,} rows per run, {args.rounds} rounds")
    try:
        rates, ratios = throughput_rounds(args.rows, exchange, queue, args.rounds)
        if args.seconds:
            declare_sink(exchange, queue)
            lat = latency(namespace, exchange, queue, args.rate, args.seconds, lanes=1)
            declare_sink(exchange, queue)
            lat2 = latency(namespace, exchange, queue, args.rate, args.seconds, lanes=2)
        if args.memory_rows:
            rss_10k, rss_end = relay_memory(namespace, exchange, queue, args.memory_rows)
    finally:
        drop_sink(exchange, queue)
    result: dict[str, object] = {
        "machine": describe_machine(),
        "rows": args.rows,
        "rounds": [{name: round(rate) for name, rate in row.items()} for row in rates],
        "median_msgs_per_s": {
            name: round(statistics.median(row[name] for row in rates)) for name in VARIANTS
        },
        "ratios": ratios,
        "median_ratios": {
            label: round(statistics.median(values), 3) for label, values in ratios.items()
        },
    }
    for label, values in ratios.items():
        print(
            f"{label}: median {round(statistics.median(values), 3)} "
            f"(rounds {min(values)} to {max(values)})"
        )
    medians = result["median_msgs_per_s"]
    assert isinstance(medians, dict)
    print("median msg/s: " + ", ".join(f"{name} {rate:,}" for name, rate in medians.items()))
    if lat:
        result.update(
            latency_rate_per_s=args.rate,
            latency_messages=len(lat),
            latency_p50_ms=round(percentile(lat, 50), 1),
            latency_p99_ms=round(percentile(lat, 99), 1),
            latency_2_lanes_p50_ms=round(percentile(lat2, 50), 1),
            latency_2_lanes_p99_ms=round(percentile(lat2, 99), 1),
        )
        print(
            f"commit->broker latency at {args.rate} msg/s, LISTEN/NOTIFY, {len(lat)} messages: "
            f"1 lane p50 {result['latency_p50_ms']} ms, p99 {result['latency_p99_ms']} ms; "
            f"2 lanes p50 {result['latency_2_lanes_p50_ms']} ms, "
            f"p99 {result['latency_2_lanes_p99_ms']} ms"
        )
    if rss_10k:
        result.update(relay_rss_kib_after_10k=rss_10k, relay_rss_kib_at_end=rss_end)
        print(
            f"relay RSS over {args.memory_rows:,} rows (manage.py relay): "
            f"{rss_10k / 1024:.1f} MiB after 10,000 sent, {rss_end / 1024:.1f} MiB at the end "
            f"({rss_end / rss_10k - 1:+.1%}; target within 10%)"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
