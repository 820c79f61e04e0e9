"""Whole processes, as users run them: a long-running ``manage.py relay`` and a ``manage.py
consume``, each against its raw baseline in the same run, with the CPU each spends per message.

    RM_BENCH_DB=bench_whole .venv/bin/python bench/whole_process.py [--messages 20000]
        [--rounds 2] [--only relay|consume] [--builds NAME=PATH[@DATABASE],...] [--callgrind]

Relay: ``--messages`` rows are published with ``publish()`` (1,000 per transaction) into an
emptied outbox, vacuumed; then ``manage.py relay`` (not ``--once``) starts and sends them to a
durable queue bound to the bench exchange. The baseline is a process publishing the same bodies
with raw pika, confirms kept in flight, 500 messages per turn of its I/O loop (as the relay's
batches go; one loop over all would encode every message before the first left).
Both are timed from the first to the last message at the broker: this process reads the
queue's depth every 10 ms (a passive ``queue.declare``), so start-up, topology and the probes
are outside the window, as is the process's exit.

Consume: ``--messages`` messages wait in tests.alpha's queue; ``manage.py consume --queue
<alpha>`` runs them through the handler, which writes one row with the ORM. The baseline is a
process with raw pika and one psycopg transaction (INSERT + COMMIT) per message, then the ack
(bench/consume.py's ``raw_baseline``). Both timed from the first to the last row in the
database (``count(*)`` every 20 ms).

CPU: at the first and at the last message, the process's utime + stime and those of its
PostgreSQL backends (found in ``pg_stat_activity`` by the ``application_name`` the process's
``PGAPPNAME`` gives every connection it opens) are read from /proc; the difference over the
messages in between is the CPU per message. The broker's CPU is not counted (it is shared with
everything else on the machine). Rounds alternate ours and the baseline, the order rotating.

``--callgrind``: each build's ``manage.py relay --once``, and its ``manage.py consume --queue
<alpha> --idle-timeout 5`` over a full queue, under ``valgrind --tool=callgrind`` over 1,000
messages and over 4,000; the difference over the extra 3,000 is its instructions per message,
process only (PostgreSQL's are not counted). Start-up, topology, the last claim and the last
idle turns cancel out, and the count hardly moves with the load of a shared machine, where the
rates above do (the consumer's threads poll while they wait: a percent or two).

``--builds``: several source trees (``git archive`` of a commit) run in turn with the baselines,
each round giving every build's ratio to the baseline and to the first build. A build with
``@DATABASE`` (a name starting ``bench_``, dropped and made again) runs on a database of its own,
which its own migrations make and its own code fills (bench/_build_side.py: its ``publish()``,
its inbox table, tests.alpha's queue declared by its own topology), so that a build whose schema
differs from this checkout's (the one before issues 33 to 40, say) runs beside it. Give every
build a database then: tests.alpha's queue is declared again by each build's own code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RM_BENCH_DB", "bench_whole")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    BROKER_URL,
    DATABASE_URL,
    ROOT,
    Build,
    backend_pids,
    build_side,
    cpu_seconds,
    database_url_for,
    declare_sink,
    describe_machine,
    drop_sink,
    parse_build_list,
    prepare_build_databases,
    setup_django,
    subprocess_env,
)

HERE = Path(__file__).resolve()
CALLGRIND_ROWS = (1000, 4000)
CALLGRIND_IDLE = 5  # seconds of an empty queue after which consume exits, under callgrind


@dataclass
class Run:
    """One process timed from its first to its last message."""

    label: str
    messages: int  # messages inside the window (after the first one seen)
    seconds: float
    process_cpu: float  # CPU seconds of the Python process in the window
    database_cpu: float  # CPU seconds of its PostgreSQL backends in the window

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def process_us(self) -> float:
        return self.process_cpu * 1e6 / self.messages

    @property
    def database_us(self) -> float:
        return self.database_cpu * 1e6 / self.messages

    def line(self) -> str:
        return (
            f"{self.label}: {self.rate:,.0f} msg/s; CPU per message: process "
            f"{self.process_us:.0f} us, PostgreSQL {self.database_us:.0f} us, "
            f"total {self.process_us + self.database_us:.0f} us"
        )


class CpuSample:
    """The CPU seconds of a process and of the backends named ``application_name``."""

    def __init__(self, cursor: object, pid: int, application_name: str) -> None:
        self.process = cpu_seconds(pid) or 0.0
        self.backends = {
            backend: cpu_seconds(backend) or 0.0
            for backend in backend_pids(cursor, application_name)
        }

    def since(self, earlier: CpuSample) -> tuple[float, float]:
        """Process and backend CPU seconds from ``earlier`` to this sample (a backend opened
        in between counts from zero)."""
        database = sum(
            max(0.0, spent - earlier.backends.get(backend, 0.0))
            for backend, spent in self.backends.items()
        )
        return self.process - earlier.process, database


def time_process(
    label: str,
    command: list[str],
    env: dict[str, str],
    progress: Callable[[], int],
    total: int,
    *,
    poll: float,
    timeout: float = 900,
    mark_window: bool = False,
    upkeep: Callable[[int], None] | None = None,
) -> Run:
    """Start ``command``; time it from the first to the ``total``-th message ``progress`` sees,
    with its CPU and its backends' in between; then stop it (SIGTERM). With ``mark_window``
    the process is sent SIGUSR1 at the first message and SIGUSR2 at the last (see
    bench/cpu_budget.py). ``upkeep`` is called with the count after each look."""
    import psycopg

    application_name = f"rmwp{uuid.uuid4().hex[:8]}"
    monitor = psycopg.connect(DATABASE_URL, autocommit=True)
    cursor = monitor.cursor()
    # A file, not a pipe: a process logging an error per message would fill a pipe nobody
    # reads until it ends, and stall there.
    errors = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(
        command,
        env={**env, "PGAPPNAME": application_name},
        stdout=subprocess.DEVNULL,
        stderr=errors,
        text=True,
    )

    def logged() -> str:
        errors.seek(0)
        return errors.read()[-4000:]

    try:
        deadline = time.monotonic() + timeout
        first = start = None
        done = 0
        while True:
            done = progress()
            if upkeep is not None:
                upkeep(done)
            if first is None and done > 0:
                start = time.perf_counter()
                first = (done, CpuSample(cursor, proc.pid, application_name))
                if mark_window:
                    proc.send_signal(signal.SIGUSR1)
            if done >= total:
                end = time.perf_counter()
                last = CpuSample(cursor, proc.pid, application_name)
                if mark_window:
                    proc.send_signal(signal.SIGUSR2)
                    time.sleep(0.5)  # its snapshot is taken before SIGTERM
                break
            if proc.poll() is not None:
                raise RuntimeError(f"{label}: exited {proc.returncode}: {logged()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: only {done}/{total} after {timeout:.0f}s: {logged()}")
            time.sleep(poll)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        monitor.close()
        errors.close()
    assert first is not None and start is not None
    process_cpu, database_cpu = last.since(first[1])
    return Run(label, total - first[0], end - start, process_cpu, database_cpu)


THIS_CHECKOUT = Build(ROOT)


def process_env(namespace: str, build: Build = THIS_CHECKOUT) -> dict[str, str]:
    """The environment of our processes: bench/_process_settings.py (persistent connections, as
    docs/deploy.md advises), warnings only in the log (no line per message); the package and
    the test settings from the build's source tree, on its own database if it has one."""
    return subprocess_env(
        namespace,
        DJANGO_SETTINGS_MODULE="_process_settings",
        PYTHONPATH=os.pathsep.join([str(HERE.parent), str(build.root)]),
        RM_LOG_LEVEL="WARNING",
        DATABASE_URL=database_url_for(build.database) if build.database else DATABASE_URL,
    )


# --------------------------------------------------------------------------- relay


def fill_outbox(rows: int, exchange: str) -> None:
    """An emptied outbox with ``rows`` rows from ``publish()``, 1,000 per transaction,
    vacuumed (this server runs without autovacuum): bench/_build_side.py's, in this process."""
    from _build_side import fill_outbox as fill

    fill(rows, exchange)


def queue_depth(queue: str) -> Callable[[], int]:
    """How many messages ``queue`` holds, read on a connection of its own."""
    channel = pika.BlockingConnection(pika.URLParameters(BROKER_URL)).channel()
    return lambda: channel.queue_declare(queue, passive=True).method.message_count


def relay_run(
    namespace: str,
    exchange: str,
    queue: str,
    n: int,
    wrapper: list[str] | None = None,
    build: Build = THIS_CHECKOUT,
) -> Run:
    """``manage.py relay`` (long-running, one lane, the default batch size) over ``n`` rows,
    run from the build's source tree (its outbox filled by its own ``publish()`` when it has
    a database of its own)."""
    if build.database is None:
        fill_outbox(n, exchange)
    else:
        build_side(build, namespace, "fill-outbox", str(n), exchange)
    declare_sink(exchange, queue)
    command = [*(wrapper or [sys.executable]), str(build.root / "manage.py"), "relay"]
    env = process_env(namespace, build)
    return time_process(
        "manage.py relay",
        command,
        env,
        queue_depth(queue),
        n,
        poll=0.01,
        mark_window=wrapper is not None,
    )


def instructions(command: list[str], env: dict[str, str]) -> int:
    """The instructions ``command`` executes, every thread's, under callgrind."""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={scratch}/callgrind.out",
                *command,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    return sum(int(n) for n in re.findall(r"Collected : (\d+)", done.stderr))


def per_message(count: Callable[[int], int]) -> float:
    """Instructions per message: ``count(n)`` over two sizes, the difference over the extra
    messages (start-up, topology and the last idle turns cancel out)."""
    few, many = CALLGRIND_ROWS
    return (count(many) - count(few)) / (many - few)


def relay_instructions(namespace: str, exchange: str, queue: str, build: Build) -> float:
    """Instructions per message of the build's ``manage.py relay --once`` (the outbox filled
    as for :func:`relay_run`)."""

    def count(rows: int) -> int:
        if build.database is None:
            fill_outbox(rows, exchange)
        else:
            build_side(build, namespace, "fill-outbox", str(rows), exchange)
        declare_sink(exchange, queue)
        command = [sys.executable, str(build.root / "manage.py"), "relay", "--once"]
        try:
            return instructions(command, process_env(namespace, build))
        finally:
            drop_sink(None, queue)

    return per_message(count)


def raw_publish_run(namespace: str, exchange: str, queue: str, n: int) -> Run:
    """A process publishing the outbox's bodies with raw pika, confirms in flight."""
    from reliable_messaging.models import OutboxMessage

    fill_outbox(n, exchange)  # the same bodies and ids as the relay's
    rows = list(OutboxMessage.objects.order_by("id").values_list("message_id", "body"))
    path = Path(f"/tmp/{namespace}.raw.json")
    path.write_text(json.dumps(rows))
    declare_sink(exchange, queue)
    command = [sys.executable, str(HERE), "--child", "raw-publish", str(path), exchange]
    try:
        return time_process(
            "raw pika, confirms in flight",
            command,
            subprocess_env(namespace),
            queue_depth(queue),
            n,
            poll=0.01,
        )
    finally:
        path.unlink()


RAW_BATCH = 500  # the relay's default batch size


def child_raw_publish(path: str, exchange: str) -> None:
    """Publish the rows with raw pika, confirms kept in flight and settled as they come, in
    batches of RAW_BATCH that the I/O loop writes out in turn (as the relay's do): one loop over
    every row would encode them all before the first reached the broker, outside the window."""
    rows = [(message_id, body.encode()) for message_id, body in json.loads(Path(path).read_text())]
    state = {"next": 0}

    def on_open(connection: pika.SelectConnection) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel: pika.channel.Channel) -> None:
        def on_confirm(frame: pika.frame.Method) -> None:
            """Settled as they come: the parent counts the messages on the queue."""

        def publish_batch() -> None:
            start = state["next"]
            for message_id, body in rows[start : start + RAW_BATCH]:
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
            state["next"] = start + RAW_BATCH
            if state["next"] < len(rows):
                channel.connection.ioloop.call_later(0, publish_batch)  # type: ignore[attr-defined]

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=lambda _: publish_batch())

    connection = pika.SelectConnection(pika.URLParameters(BROKER_URL), on_open_callback=on_open)
    connection.ioloop.start()  # until the parent stops it, like the relay


# --------------------------------------------------------------------------- consume


def effects_of(consumer: str, database_url: str = DATABASE_URL) -> Callable[[], int]:
    """How many rows of ``consumer`` testapp_effect holds, read on a connection of its own."""
    import psycopg

    cursor = psycopg.connect(database_url, autocommit=True).cursor()

    def count() -> int:
        cursor.execute("SELECT count(*) FROM testapp_effect WHERE consumer = %s", [consumer])
        return int(cursor.fetchone()[0])  # type: ignore[index]

    return count


class Autoanalyze:
    """What autovacuum's autoanalyze does on a normal server (this one runs without it): the
    inbox analyzed again each time it grew by 50 rows + 10 %, its threshold, so that the claim
    is planned for the inbox's real size (planned for an empty one, it hashes the whole inbox
    on every claim)."""

    def __init__(self, database_url: str = DATABASE_URL, inbox_table: str | None = None) -> None:
        import psycopg

        from reliable_messaging.storage.partitions import INBOX_TABLE

        self.cursor = psycopg.connect(database_url, autocommit=True).cursor()
        self.inbox_table = inbox_table or INBOX_TABLE
        self.next_at = 50

    def __call__(self, done: int) -> None:
        if done >= self.next_at:
            self.cursor.execute(f"ANALYZE {self.inbox_table}")
            self.next_at = int(done * 1.1) + 50


def prepare_consume(exchange: str, n: int, kind: str) -> None:
    """An empty inbox and effect table, and ``n`` fresh messages in tests.alpha's queue."""
    from consume import fill
    from django.db import connection

    from reliable_messaging.storage.partitions import INBOX_TABLE

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {INBOX_TABLE}, testapp_effect")
        cursor.execute(f"VACUUM ANALYZE {INBOX_TABLE}")
    fill(exchange, [f"{kind}-{uuid.uuid4()}" for _ in range(n)], {"n": 1})


def prepare_alpha(namespace: str, exchange: str, n: int, build: Build) -> tuple[str, str | None]:
    """``n`` fresh messages in tests.alpha's queue and the build's inbox emptied (its own
    topology and inbox table when it has a database of its own): its database URL and inbox
    table."""
    if build.database is None:
        prepare_consume(exchange, n, "app")
        return DATABASE_URL, None
    build_side(build, namespace, "declare-alpha")
    inbox_table = build_side(build, namespace, "empty-inbox")["emptied"]
    from consume import fill

    fill(exchange, [f"app-{uuid.uuid4()}" for _ in range(n)], {"n": 1})
    return database_url_for(build.database), inbox_table


def consume_run(
    namespace: str,
    exchange: str,
    queue: str,
    n: int,
    wrapper: list[str] | None = None,
    build: Build = THIS_CHECKOUT,
) -> Run:
    """``manage.py consume --queue <alpha>`` (the defaults: concurrency 1, batches on), run
    from the build's source tree (on its own database, with tests.alpha's queue declared by
    its own topology, when it has one)."""
    database_url, inbox_table = prepare_alpha(namespace, exchange, n, build)
    command = [
        *(wrapper or [sys.executable]),
        str(build.root / "manage.py"),
        "consume",
        "--queue",
        queue,
    ]
    env = process_env(namespace, build)
    return time_process(
        "manage.py consume",
        command,
        env,
        effects_of("alpha", database_url),
        n,
        poll=0.02,
        mark_window=wrapper is not None,
        upkeep=Autoanalyze(database_url, inbox_table),
    )


def consume_instructions(namespace: str, exchange: str, queue: str, build: Build) -> float:
    """Instructions per message of the build's ``manage.py consume --queue <alpha>`` over a
    full queue, until it has been idle for ``CALLGRIND_IDLE`` seconds."""

    def count(n: int) -> int:
        database_url, _ = prepare_alpha(namespace, exchange, n, build)
        command = [sys.executable, str(build.root / "manage.py"), "consume", "--queue", queue]
        command += ["--idle-timeout", str(CALLGRIND_IDLE)]
        counted = instructions(command, process_env(namespace, build))
        handled = effects_of("alpha", database_url)()
        if handled != n:
            raise RuntimeError(f"consume under callgrind handled {handled} of {n} messages")
        return counted

    return per_message(count)


def raw_consume_run(namespace: str, exchange: str, queue: str, n: int) -> Run:
    """A process with raw pika + one psycopg transaction per message, then the ack."""
    from reliable_messaging.conf import messaging_settings

    prepare_consume(exchange, n, "raw")
    prefetch = str(messaging_settings.prefetch)
    command = [sys.executable, str(HERE), "--child", "raw-consume", queue, str(n), prefetch]
    return time_process(
        "raw pika + psycopg",
        command,
        subprocess_env(namespace),
        effects_of("baseline"),
        n,
        poll=0.02,
    )


def child_raw_consume(queue: str, n: str, prefetch: str) -> None:
    """bench/consume.py's raw_baseline, keeping its connections open until stopped: the
    parent reads its backend's CPU after the last row."""
    import psycopg
    from consume import EFFECT_INSERT

    db = psycopg.connect(DATABASE_URL)
    channel = pika.BlockingConnection(pika.URLParameters(BROKER_URL)).channel()
    channel.basic_qos(prefetch_count=int(prefetch))
    for done, (method, properties, body) in enumerate(channel.consume(queue), start=1):
        assert properties is not None and body is not None and method.delivery_tag is not None
        payload = json.loads(body)
        with db.transaction(), db.cursor() as cursor:
            cursor.execute(
                EFFECT_INSERT, ("baseline", properties.message_id, 1, json.dumps(payload))
            )
        channel.basic_ack(method.delivery_tag)
        if done == int(n):
            break
    time.sleep(3600)


# --------------------------------------------------------------------------- rounds


def alternate(
    runs: dict[str, Callable[[], Run]], rounds: int, baseline: str
) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    """``rounds`` rounds of ``runs``, their order rotating; each round's rate ratios: every
    run to ``baseline`` and, with more than one other run, each to the first of them."""
    names = list(runs)
    results: dict[str, list[Run]] = {name: [] for name in names}
    ours = [name for name in names if name != baseline]
    pairs = [(name, baseline) for name in ours] + [(name, ours[0]) for name in ours[1:]]
    ratios: dict[str, list[float]] = {f"{top} / {bottom}": [] for top, bottom in pairs}
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            run = runs[name]()
            results[name].append(run)
            print(f"  round {round_ + 1} {name}: {run.line()}", flush=True)
        for top, bottom in pairs:
            value = round(results[top][-1].rate / results[bottom][-1].rate, 3)
            ratios[f"{top} / {bottom}"].append(value)
            print(f"  round {round_ + 1} {top} / {bottom} = {value}", flush=True)
    return results, ratios


def summary(
    results: dict[str, list[Run]], ratios: dict[str, list[float]], label: str
) -> dict[str, object]:
    out: dict[str, object] = {"ratios": ratios}
    for name, runs in results.items():
        out[name] = {
            "msgs_per_s": [round(r.rate) for r in runs],
            "process_us": [round(r.process_us) for r in runs],
            "database_us": [round(r.database_us) for r in runs],
        }
        print(
            f"{label} {name}: {', '.join(f'{r.rate:,.0f}' for r in runs)} msg/s; CPU/msg "
            f"process {statistics.median(r.process_us for r in runs):.0f} us, PostgreSQL "
            f"{statistics.median(r.database_us for r in runs):.0f} us (medians)"
        )
    for pair, values in ratios.items():
        print(f"{label} rate ratio {pair} per round: {values}")
    return out


def cleanup(namespace: str) -> None:
    """Delete the queues this run's processes declared (their names start with the
    namespace)."""
    from _common import rabbitmqctl

    names = [
        line.split()[0]
        for line in rabbitmqctl("list_queues", "name").splitlines()
        if line.startswith(f"{namespace}.")
    ]
    channel = pika.BlockingConnection(pika.URLParameters(BROKER_URL)).channel()
    for name in names:
        channel.queue_delete(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=("relay", "consume"))
    parser.add_argument(
        "--builds",
        help="source trees to run in turn with the raw baselines, NAME=PATH[@DATABASE],...: "
        "a build with @DATABASE (named bench_*, dropped and made again) runs on a database of "
        "its own, migrated, filled and emptied by its own code (an older build's schema); "
        "each round prints every build's ratio to the raw baseline and to the first build",
    )
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="instructions per message under callgrind (the relay's and the consumer's, or "
        "--only's), each build's, instead of the timed runs",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        children: dict[str, Callable[..., None]] = {
            "raw-publish": child_raw_publish,
            "raw-consume": child_raw_consume,
        }
        children[kind](*rest)
        return

    namespace = setup_django()
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.testing import find_consumer

    chosen = parse_build_list(args.builds) if args.builds else None
    prepare_build_databases(chosen or {}, namespace)

    def ours(kind: str) -> dict[str, Build]:
        """The builds to run, named after the process when this checkout runs alone."""
        return chosen or {kind: THIS_CHECKOUT}

    n = args.messages
    exchange = messaging_settings.exchange
    sink = f"{namespace}.sink"
    alpha = find_consumer("tests.alpha").queue
    print(f"machine: {describe_machine()}; {n:,} messages per run, {args.rounds} rounds")
    result: dict[str, Any] = {"machine": describe_machine(), "messages": n}
    try:

        def count_instructions(kind: str, per_message: Callable[[Build], float]) -> None:
            for name, build in ours(kind).items():
                count = per_message(build)
                print(f"  {name}: {kind}, {count:,.0f} instructions per message")
                result.setdefault(name, {})[f"{kind}_instructions_per_message"] = round(count)

        if args.callgrind and args.only in (None, "relay"):
            count_instructions(
                "relay", functools.partial(relay_instructions, namespace, exchange, sink)
            )
        elif args.only in (None, "relay"):
            runs: dict[str, Callable[[], Run]] = {
                name: functools.partial(relay_run, namespace, exchange, sink, n, build=build)
                for name, build in ours("relay").items()
            }
            runs["raw"] = lambda: raw_publish_run(namespace, exchange, sink, n)
            result["relay"] = summary(*alternate(runs, args.rounds, "raw"), "relay")
        if args.only in (None, "consume"):
            from reliable_messaging.broker.topology import declare_topology

            connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
            declare_topology(connection.channel(), [find_consumer("tests.alpha")])
            connection.close()
        if args.callgrind and args.only in (None, "consume"):
            count_instructions(
                "consume", functools.partial(consume_instructions, namespace, exchange, alpha)
            )
        elif args.only in (None, "consume"):
            runs = {
                name: functools.partial(consume_run, namespace, exchange, alpha, n, build=build)
                for name, build in ours("consume").items()
            }
            runs["raw"] = lambda: raw_consume_run(namespace, exchange, alpha, n)
            result["consume"] = summary(*alternate(runs, args.rounds, "raw"), "consume")
    finally:
        drop_sink(None, sink)
        cleanup(namespace)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
