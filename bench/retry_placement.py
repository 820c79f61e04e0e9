"""Where a retry waits: the retry copy as ``consume`` writes it (a scheduled outbox row with the
original's bytes and its AMQP properties encoded by pika, ``schedule_copy``) against a
``publish(deliver_at=...)`` row (JSON text and headers), both sent by a real ``manage.py relay``
when due. The second is the row the retry was weighed with against the broker's delay queues
(docs/benchmarks.md keeps those figures), so this says what building it cost beyond them.

    .venv/bin/python bench/retry_placement.py [--retries 200] [--rounds 6] [--delay 1]

Each round places ``--retries`` retries one after the other, as a failing worker does, one way
then the other, the order swapped every round. Per retry it prints the worker's wait for the
placement; the CPU of the placing process and its PostgreSQL backend, of the relay and its
backends, and of the broker (a shared node: noisy); and the time from due to arrival in the
queue, read by a consumer process of its own. Medians and same-run ratios close. Each row's
insert and commit is an upper bound: in ``consume`` the failing delivery's transaction commits
anyway, and a batch shares its commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    BROKER_URL,
    ROOT,
    backend_pids,
    cpu_seconds,
    describe_machine,
    median,
    percentile,
    setup_django,
    subprocess_env,
)

RELAY_APP = "rm-bench-retry-relay"


def broker_pid() -> int | None:
    """The beam.smp of the node on 5672 (run by the rabbitmq user), for its CPU time."""
    found = subprocess.run(["pgrep", "-u", "rabbitmq", "beam.smp"], capture_output=True, text=True)
    pids = found.stdout.split()
    return int(pids[0]) if pids else None


class Sink:
    """A consumer of ``queue`` in a process of its own: the arrival time of each message_id."""

    def __init__(self, queue: str) -> None:
        self.arrived: dict[str, float] = {}
        self._lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--sink", queue],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline() if self.process.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the sink did not start: {line!r}")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message_id, at = line.split()
            with self._lock:
                self.arrived[message_id] = float(at)

    def wait_for(self, ids: list[str], timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(i in self.arrived for i in ids):
                    break
            time.sleep(0.05)
        with self._lock:
            return {i: self.arrived[i] for i in ids if i in self.arrived}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def run_sink(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=500)
    print("ready", flush=True)
    for method, properties, _body in channel.consume(queue, inactivity_timeout=1):
        if method is None or properties is None or method.delivery_tag is None:
            continue
        print(properties.message_id, time.time(), flush=True)
        channel.basic_ack(method.delivery_tag)


Placement = tuple[dict[str, float], list[float], float]


def placed_one_by_one(count: int, place: Callable[[str], float]) -> Placement:
    """``place(message_id)`` ``count`` times, each returning its retry's due time (epoch
    seconds) once placed; returns the due times, each placement's wait and the CPU in all."""
    due: dict[str, float] = {}
    waits: list[float] = []
    cpu = 0.0
    for _ in range(count):
        message_id = str(uuid.uuid4())
        cpu_before = time.process_time()
        started = time.perf_counter()
        due[message_id] = place(message_id)
        waits.append(time.perf_counter() - started)
        cpu += time.process_time() - cpu_before
    return due, waits, cpu


def place_as_copies(queue: str, count: int, delay: float) -> Placement:
    """Retry copies as the consumer's retry stage writes them, each in a transaction of its own
    as the failing delivery's outcome would be."""
    from django.db import transaction
    from pika.spec import BasicProperties

    from reliable_messaging.broker.stored_properties import retry_properties
    from reliable_messaging.models import OutboxMessage

    def place(message_id: str) -> float:
        original = BasicProperties(
            message_id=message_id,
            delivery_mode=2,
            content_type="application/json",
            timestamp=int(time.time()),
        )
        due = time.time() + delay
        with transaction.atomic():
            OutboxMessage.objects.schedule_copy(
                message_id=message_id,
                queue=queue,
                body=b'{"order": 1}',
                properties=retry_properties(original, {"x-rm-attempt": 2}),
                delay=delay,
                idempotency_key=f"rm-retry:{message_id}",
            )
        return due

    return placed_one_by_one(count, place)


def place_as_rows(queue: str, count: int, delay: float) -> Placement:
    """Scheduled outbox rows to the default exchange, routing key the consumer's queue (the
    copy reaches that queue only), each in a transaction of its own as the failing delivery's
    outcome would be."""
    from django.db import transaction

    from reliable_messaging import publish

    def place(message_id: str) -> float:
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
        with transaction.atomic():
            publish(
                queue,
                {"order": 1},
                exchange="",
                message_id=message_id,
                headers={"x-rm-attempt": 2},
                deliver_at=at,
            )
        return at.timestamp()

    return placed_one_by_one(count, place)


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--sink", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:
        run_sink(args.sink)
        return

    namespace = setup_django()
    from django.db import connection

    queue = f"bench.retries.{namespace}"
    channel_connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = channel_connection.channel()
    channel.queue_declare(queue, durable=True)

    print(describe_machine())
    print(f"load average at start: {os.getloadavg()}")
    sink = Sink(queue)
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay", "--progress-interval", "0"],
        env=subprocess_env(namespace, PGAPPNAME=RELAY_APP),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    beam = broker_pid()
    results: dict[str, dict[str, list[float]]] = {
        way: {"wait": [], "cpu": [], "relay": [], "broker": [], "late": []}
        for way in ("retry copy", "publish row")
    }
    try:
        time.sleep(3)  # the relay connects and listens
        with connection.cursor() as cursor:
            relay_backends = backend_pids(cursor, RELAY_APP)
            cursor.execute("SELECT pg_backend_pid()")
            own_backend = cursor.fetchone()[0]
        watched = [relay.pid, *relay_backends]
        for round_no in range(args.rounds):
            ways = ["retry copy", "publish row"]
            if round_no % 2:
                ways.reverse()
            for way in ways:
                relay_before, beam_before = cpu_of(watched), cpu_of([beam] if beam else [])
                own_before = cpu_of([own_backend])
                if way == "retry copy":
                    due, waits, cpu = place_as_copies(queue, args.retries, args.delay)
                else:
                    due, waits, cpu = place_as_rows(queue, args.retries, args.delay)
                cpu += cpu_of([own_backend]) - own_before  # the insert's backend
                arrived = sink.wait_for(list(due), timeout=args.delay + 60)
                relay_cpu = cpu_of(watched) - relay_before
                beam_cpu = cpu_of([beam] if beam else []) - beam_before
                if len(arrived) < len(due):
                    raise RuntimeError(f"{way}: {len(due) - len(arrived)} retries never arrived")
                late = [arrived[i] - due[i] for i in due]
                figures = results[way]
                figures["wait"].append(median(waits) * 1000)
                figures["cpu"].append(cpu / args.retries * 1e6)
                figures["relay"].append(relay_cpu / args.retries * 1e6)
                figures["broker"].append(beam_cpu / args.retries * 1e6)
                figures["late"].append(median(late) * 1000)
                print(
                    f"round {round_no + 1} {way:11}: placement wait median "
                    f"{median(waits) * 1000:6.2f} ms; CPU per retry: placing "
                    f"{cpu / args.retries * 1e6:5.0f} us, relay+its backends "
                    f"{relay_cpu / args.retries * 1e6:5.0f} us, broker "
                    f"{beam_cpu / args.retries * 1e6:5.0f} us; due to arrival median "
                    f"{median(late) * 1000:6.1f} ms, p95 {percentile(late, 95) * 1000:6.1f} ms, "
                    f"max {max(late) * 1000:6.1f} ms"
                )
    finally:
        relay.terminate()
        relay.wait(timeout=30)
        sink.stop()
        channel.queue_delete(queue)
        channel_connection.close()

    print(f"load average at end: {os.getloadavg()}")
    copies, rows = results["retry copy"], results["publish row"]
    for key, what in (
        ("wait", "failing worker waits for the placement (ms)"),
        ("cpu", "CPU of the placing process per retry (us)"),
        ("relay", "CPU of the relay and its backends per retry (us)"),
        ("broker", "CPU of the broker per retry (us, shared node)"),
        ("late", "due time to arrival (ms)"),
    ):
        c, r = median(copies[key]), median(rows[key])
        ratio = f"{c / r:5.2f}x" if r else "  n/a"
        print(f"{what:50}: retry copy {c:8.2f}, publish row {r:8.2f}, copy/row {ratio}")
    total_c = median(
        [c + r + k for c, r, k in zip(copies["cpu"], copies["relay"], copies["broker"])]
    )
    total_r = median([c + r + k for c, r, k in zip(rows["cpu"], rows["relay"], rows["broker"])])
    print(
        f"{'all CPU per retry (us)':50}: retry copy {total_c:8.0f}, publish row {total_r:8.0f}, "
        f"copy/row {total_c / total_r:5.2f}x"
    )


if __name__ == "__main__":
    main()
