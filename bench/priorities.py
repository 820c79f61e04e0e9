"""What a queue that honours priorities costs against a plain one (docs/tasks.md#priorities).

    .venv/bin/python bench/priorities.py [--url amqp://guest:guest@127.0.0.1:5783/%2F]
        [--messages 20000] [--rounds 4] [--prefetch 100]

Four kinds of queue, alternated round by round on the same broker (RabbitMQ 4.3.6 by default,
``scripts/rabbitmq4.sh --release 4.3 start``): a classic queue, a classic queue declared with
``x-max-priority`` as the task queues are, a quorum queue sent messages without a priority,
and a quorum queue sent the same messages with the tasks' priorities (the quorum queue has no
argument for it: from 4.3 it orders by every priority, strictly). Each round publishes
``--messages`` messages of 200 bytes, persistent (timed until the queue holds them all),
then consumes them all with ``--prefetch`` and manual acks (multiple=False). The priority
messages take the ten levels the tasks use (0 to 9) in turn.

Printed: publish and consume rates (median of the rounds, messages per second), the broker's
CPU per message when its process can be read (``--broker-pid``, else found by its port), and
the same-run ratios priority / plain for each queue type, and quorum-with-priorities / classic
``x-max-priority``. The load average is printed first and last: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import uuid
from dataclasses import dataclass, field

import pika

KINDS = ("classic", "classic x-max-priority", "quorum", "quorum priorities")
BODY = b"x" * 200
WINDOW = 500
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Figures:
    publish: list[float] = field(default_factory=list)
    consume: list[float] = field(default_factory=list)
    broker_cpu_us: list[float] = field(default_factory=list)


def broker_pid(url: str) -> int | None:
    """The beam process listening on the URL's port (None when it cannot be read)."""
    port = pika.URLParameters(url).port
    try:
        out = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return None
    marker = "pid="
    if marker not in out:
        return None
    return int(out.split(marker, 1)[1].split(",", 1)[0])


def cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def declare(channel: pika.adapters.blocking_connection.BlockingChannel, kind: str) -> str:
    name = f"bench.priorities.{uuid.uuid4().hex[:8]}"
    arguments: dict[str, object] = {"x-queue-type": "quorum" if "quorum" in kind else "classic"}
    if kind == "classic x-max-priority":
        arguments["x-max-priority"] = 9
    channel.queue_declare(name, durable=True, arguments=arguments)
    return name


def publish(
    channel: pika.adapters.blocking_connection.BlockingChannel, queue: str, kind: str, count: int
) -> float:
    """Seconds from the first publish until the queue holds all ``count`` messages."""
    with_priority = kind in ("classic x-max-priority", "quorum priorities")
    start = time.perf_counter()
    for index in range(count):
        properties = pika.BasicProperties(
            delivery_mode=2, priority=index % 10 if with_priority else None
        )
        channel.basic_publish("", queue, BODY, properties)
        if index % WINDOW == WINDOW - 1:
            channel.connection.process_data_events(time_limit=0)
    while channel.queue_declare(queue, passive=True).method.message_count < count:
        time.sleep(0.01)
    return time.perf_counter() - start


def consume(
    channel: pika.adapters.blocking_connection.BlockingChannel,
    queue: str,
    count: int,
    prefetch: int,
) -> float:
    channel.basic_qos(prefetch_count=prefetch)
    start = time.perf_counter()
    for got, (method, _, _) in enumerate(channel.consume(queue, inactivity_timeout=30), 1):
        if method is None or method.delivery_tag is None:
            raise RuntimeError(f"{queue}: nothing delivered for 30 s after {got - 1} messages")
        channel.basic_ack(method.delivery_tag)
        if got == count:
            break
    elapsed = time.perf_counter() - start
    channel.cancel()
    return elapsed


def round_of(
    url: str, kind: str, count: int, prefetch: int, pid: int | None, into: Figures
) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        queue = declare(channel, kind)
        cpu0 = cpu_seconds(pid)
        published = publish(channel, queue, kind, count)
        consumed = consume(channel, queue, count, prefetch)
        cpu1 = cpu_seconds(pid)
        channel.queue_delete(queue)
    finally:
        connection.close()
    into.publish.append(count / published)
    into.consume.append(count / consumed)
    if cpu0 is not None and cpu1 is not None:
        into.broker_cpu_us.append((cpu1 - cpu0) / count * 1e6)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5783/%2F")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=100)
    parser.add_argument("--broker-pid", type=int, default=None)
    args = parser.parse_args()
    pid = args.broker_pid or broker_pid(args.url)
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    version = connection._impl.server_properties.get("version")  # type: ignore[attr-defined]
    connection.close()
    version = version.decode() if isinstance(version, bytes) else version
    print(f"RabbitMQ {version}; broker pid {pid}; load average {load()}")
    figures = {kind: Figures() for kind in KINDS}
    for number in range(args.rounds):
        # Alternated, and the order turned each round, so drift of the machine falls on all.
        order = KINDS if number % 2 == 0 else tuple(reversed(KINDS))
        for kind in order:
            round_of(args.url, kind, args.messages, args.prefetch, pid, figures[kind])
        print(f"round {number + 1} done; load average {load()}")
    median = statistics.median
    print(f"\n{args.messages} messages a round, {args.rounds} rounds, prefetch {args.prefetch}")
    print(f"{'queue':<26}{'publish/s':>11}{'consume/s':>11}{'broker µs/msg':>15}")
    for kind in KINDS:
        f = figures[kind]
        cpu = f"{median(f.broker_cpu_us):.1f}" if f.broker_cpu_us else "n/a"
        print(f"{kind:<26}{median(f.publish):>11,.0f}{median(f.consume):>11,.0f}{cpu:>15}")

    def ratio(a: str, b: str, what: str) -> str:
        values = [x / y for x, y in zip(getattr(figures[a], what), getattr(figures[b], what))]
        return f"{median(values):.2f} ({min(values):.2f} to {max(values):.2f} by round)"

    for what in ("publish", "consume", "broker_cpu_us"):
        if what == "broker_cpu_us" and not figures["classic"].broker_cpu_us:
            continue
        print(f"\n{what}: same-run ratios (median of the rounds' ratios)")
        classic = ratio("classic x-max-priority", "classic", what)
        print(f"  classic x-max-priority / classic  {classic}")
        print(f"  quorum priorities / quorum        {ratio('quorum priorities', 'quorum', what)}")
        print(
            "  quorum priorities / classic x-max-priority  "
            f"{ratio('quorum priorities', 'classic x-max-priority', what)}"
        )
    print(f"\nload average at the end {load()}")


if __name__ == "__main__":
    main()
