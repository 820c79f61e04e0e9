"""Soak: many messages through publish() → relay → two consumer processes, with duplicate
deliveries, transient and permanent failures, and two RabbitMQ restarts in the middle.

    flock -o /tmp/rm-services.lock .venv/bin/python bench/soak.py [--messages 100000]

It stops and starts the RabbitMQ app (restored in a ``finally``), so run it alone. It uses its own
database (``rm_soak``, recreated at the start and dropped at the end unless ``--keep-db``), its own
RabbitMQ vhost (deleted at the end) and the test suite's settings and consumers (tests.settings,
tests.testapp: ``tests.alpha`` and ``tests.beta``, both bound to ``order.*``; retries after 0.2,
0.4 and 0.8 s, three attempts).

Of the messages, ``--duplicates`` (10%) are written to the outbox twice under one message_id (two
deliveries of one message), ``--transient`` (2%) fail once in both consumers and succeed on the
retry, ``--permanent`` (0.5%) are refused for good by both (two dead letters each). The relay and
two ``manage.py consume`` processes run throughout; nobody restarts them.

At the end it prints: messages, lost, doubled, dead letters (expected vs actual), throughput,
the consumers' resident memory at the start and at the end, and the wall time; and exits 1 if
anything was lost or doubled or the dead letters are not the expected ones.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    ROOT,
    describe_machine,
    drop_database,
    rabbitmqctl,
    recreate_database,
    setup_django_on,
    vm_rss_kib,
)

sys.path.insert(0, str(ROOT))
from tests.support import ManageProcess, WaitTimeout, all_queue_counts

DATABASE = "rm_soak"
ROUTING_KEY = "order.placed"
LABELS = {"alpha": "tests.alpha", "beta": "tests.beta"}


@dataclass(frozen=True)
class Planned:
    payload: dict[str, Any]
    duplicate: bool
    transient: bool
    permanent: bool


def plan(
    count: int, duplicates: float, transient: float, permanent: float, seed: int
) -> list[Planned]:
    rnd = random.Random(seed)
    planned = []
    for seq in range(count):
        payload: dict[str, Any] = {"seq": seq, "order_id": seq, "amount": "19.99"}
        is_permanent = rnd.random() < permanent
        is_transient = not is_permanent and rnd.random() < transient
        if is_permanent:
            payload["permanent"] = {"alpha": 1, "beta": 1}
        if is_transient:
            payload["fail"] = {"alpha": 1, "beta": 1}
        planned.append(Planned(payload, rnd.random() < duplicates, is_transient, is_permanent))
    return planned


# --------------------------------------------------------------------------- processes


class Process(ManageProcess):
    """A ``manage.py`` subprocess of the soak, logging to a file (the suite's helper)."""

    def __init__(self, command: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.command = command
        super().__init__(args, env, log)

    def stop(self) -> int | None:
        """SIGTERM, a minute to finish gracefully, then SIGKILL; the exit code."""
        self.send(signal.SIGTERM)
        try:
            return self.wait(60)
        except WaitTimeout:
            return None
        finally:
            self.close()

    def count(self, fragment: str) -> int:
        """Lines of the log that contain ``fragment``."""
        return sum(fragment in line for line in self.log().splitlines())


# --------------------------------------------------------------------------- traffic


@dataclass
class Publisher:
    """Commits the plan through publish(), ``per_transaction`` messages per transaction, at
    ``rate`` messages per second, on a background thread."""

    plan: list[Planned]
    exchange: str
    rate: float
    per_transaction: int
    published: int = 0
    committed: list[str] = field(default_factory=list)
    error: BaseException | None = None
    database_errors: int = 0
    finished_at: float | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="soak-publisher", daemon=True)
        thread.start()
        return thread

    def run(self) -> None:
        from django.db import DatabaseError, connections, transaction

        from reliable_messaging import publish

        interval = self.per_transaction / self.rate
        next_at = time.monotonic()
        start = 0
        try:
            while start < len(self.plan):
                chunk = self.plan[start : start + self.per_transaction]
                try:
                    ids = []
                    with transaction.atomic():
                        for item in chunk:
                            message_id = publish(ROUTING_KEY, item.payload, exchange=self.exchange)
                            if item.duplicate:
                                publish(
                                    ROUTING_KEY,
                                    item.payload,
                                    exchange=self.exchange,
                                    message_id=message_id,
                                )
                            ids.append(message_id)
                except DatabaseError:
                    self.database_errors += 1
                    connections.close_all()
                    time.sleep(0.5)
                    continue
                self.committed.extend(ids)
                start += len(chunk)
                self.published = start
                next_at += interval
                pause = next_at - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            connections.close_all()


# --------------------------------------------------------------------------- the broker


def restart_broker(down_seconds: float, publisher: Publisher) -> float:
    """stop_app, stay down ``down_seconds`` (publishing goes on into the outbox), start_app;
    returns how long the broker was unavailable."""
    started = time.monotonic()
    print(f"  stopping the broker at {publisher.published:,} messages published", flush=True)
    try:
        rabbitmqctl("stop_app")
        time.sleep(down_seconds)
    finally:
        rabbitmqctl("start_app")
        rabbitmqctl("await_startup", "--timeout", "120")
    print(f"  broker back at {publisher.published:,} messages published", flush=True)
    return time.monotonic() - started


# --------------------------------------------------------------------------- the verdict


def handled_counts(exchange: str) -> tuple[int, dict[str, int]]:
    """(outbox rows not yet sent, {label: distinct messages with an effect or dead letter})."""
    from reliable_messaging.choices import OutboxStatus
    from reliable_messaging.models import DeadLetter, OutboxMessage
    from tests.testapp.models import Effect

    unsent = OutboxMessage.objects.filter(exchange=exchange).exclude(status=OutboxStatus.SENT)
    handled = {}
    for label, name in LABELS.items():
        done = Effect.objects.filter(consumer=label).values("message_id").distinct().count()
        dead = DeadLetter.objects.filter(consumer=name).count()
        handled[label] = done + dead
    return unsent.count(), handled


def settle(exchange: str, vhost: str, total: int, timeout: float, consumers: list[Process]) -> bool:
    deadline = time.monotonic() + timeout
    last_print = 0.0
    while time.monotonic() < deadline:
        unsent, handled = handled_counts(exchange)
        if unsent == 0 and all(n >= total for n in handled.values()):
            counts = all_queue_counts(vhost)
            if counts and all(c == (0, 0) for c in counts.values()):
                return True
        if time.monotonic() - last_print >= 10:
            last_print = time.monotonic()
            alive = [p.popen.poll() is None for p in consumers]
            print(
                f"  settling: unsent {unsent:,}, handled {handled}, consumers alive {alive}",
                flush=True,
            )
        time.sleep(1.0)
    return False


@dataclass
class Verdict:
    messages: int
    lost: dict[str, int]
    doubled: dict[str, int]
    expected_dead: int
    dead: int
    unexpected_dead: Counter[str]
    missing_dead: int
    not_in_outbox: int
    inbox: dict[str, int]

    @property
    def ok(self) -> bool:
        return not (
            any(self.lost.values())
            or any(self.doubled.values())
            or self.unexpected_dead
            or self.missing_dead
            or self.not_in_outbox
        )


def verdict(exchange: str, planned: list[Planned], committed: list[str]) -> Verdict:
    import json

    from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
    from tests.testapp.models import Effect

    permanent_seqs = {seq for seq, item in enumerate(planned) if item.permanent}
    ids: set[str] = set()
    must_die: set[str] = set()
    for message_id, body in (
        OutboxMessage.objects.filter(exchange=exchange).values_list("message_id", "body").iterator()
    ):
        ids.add(message_id)
        if json.loads(body)["seq"] in permanent_seqs:
            must_die.add(message_id)
    dead_rows = list(DeadLetter.objects.values_list("consumer", "message_id", "reason"))
    dead = {(c, m) for c, m, _ in dead_rows}
    expected = {(name, m) for name in LABELS.values() for m in must_die}
    unexpected = Counter(r for c, m, r in dead_rows if (c, m) not in expected)
    lost, doubled, inbox = {}, {}, {}
    for label, name in LABELS.items():
        counts = Counter(
            Effect.objects.filter(consumer=label).values_list("message_id", flat=True).iterator()
        )
        lost[label] = sum(1 for m in ids - must_die if not counts[m])
        # Doubled: two effects of one message, or any effect of one that had to fail.
        doubled[label] = sum(1 for n in counts.values() if n > 1) + sum(
            1 for m in must_die if counts[m]
        )
        inbox[label] = ProcessedMessage.objects.filter(consumer=name).count()
    return Verdict(
        messages=len(ids),
        lost=lost,
        doubled=doubled,
        expected_dead=len(expected),
        dead=len(dead),
        unexpected_dead=unexpected,
        missing_dead=len(expected - dead),
        not_in_outbox=len(set(committed) - ids),
        inbox=inbox,
    )


# --------------------------------------------------------------------------- main


def mib(kib: int | None) -> str:
    return "?" if kib is None else f"{kib / 1024:.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="messages published per second")
    parser.add_argument("--per-transaction", type=int, default=10)
    parser.add_argument("--duplicates", type=float, default=0.10)
    parser.add_argument("--transient", type=float, default=0.02)
    parser.add_argument("--permanent", type=float, default=0.005)
    parser.add_argument("--restarts", type=int, default=2, help="RabbitMQ restarts mid-run")
    parser.add_argument("--down-seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=2, help="handler threads per consumer")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to settle")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-db", action="store_true", help=f"keep the {DATABASE} database")
    args = parser.parse_args()
    if args.messages < 1 or args.rate <= 0 or args.per_transaction < 1:
        parser.error("--messages, --rate and --per-transaction must be positive")
    timeout = args.timeout or max(600.0, args.messages / 50)

    wall_start = time.monotonic()
    namespace = f"soak{uuid.uuid4().hex[:8]}"
    vhost = namespace
    exchange = f"rmtest.{namespace}"
    logs = Path(f"/tmp/rm-soak-{namespace}")
    logs.mkdir(parents=True)
    database_url = recreate_database(DATABASE)
    setup_django_on(database_url, namespace)
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    env = {
        **os.environ,
        "RM_TEST_NAMESPACE": namespace,
        "DATABASE_URL": database_url,
        "RM_BROKER_URL": f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("RM_TEST_CACHE_ALIAS", None)

    planned = plan(args.messages, args.duplicates, args.transient, args.permanent, args.seed)
    print(f"machine: {describe_machine()}")
    print(
        f"soak: {args.messages:,} messages at {args.rate:,.0f}/s ({args.per_transaction} per "
        f"transaction): {sum(p.duplicate for p in planned):,} delivered twice, "
        f"{sum(p.transient for p in planned):,} failing once, "
        f"{sum(p.permanent for p in planned):,} refused for good; {args.restarts} broker "
        f"restart(s); logs in {logs}",
        flush=True,
    )

    processes: list[Process] = []
    consumers: list[Process] = []
    broker_down = 0.0
    try:
        for n in (1, 2):
            proc = Process(
                "consume",
                ["--concurrency", str(args.concurrency)],
                env,
                logs / f"consume-{n}.log",
            )
            processes.append(proc)
            consumers.append(proc)
        for proc in consumers:
            proc.wait_for_log("consuming ", 60)
        relay = Process("relay", [], env, logs / "relay.log")
        processes.append(relay)
        relay.wait_for_log("relay: publishing the outbox", 60)
        rss_start = [vm_rss_kib(p.pid) for p in consumers]

        publisher = Publisher(planned, exchange, args.rate, args.per_transaction)
        started = time.monotonic()
        thread = publisher.start()
        for k in range(1, args.restarts + 1):
            mark = args.messages * k // (args.restarts + 1)
            while publisher.published < mark and thread.is_alive():
                time.sleep(0.1)
            broker_down += restart_broker(args.down_seconds, publisher)
        thread.join(timeout)
        if publisher.error is not None:
            raise publisher.error
        published_in = (publisher.finished_at or time.monotonic()) - started
        print(f"  published {publisher.published:,} in {published_in:.1f}s", flush=True)
        settled = settle(exchange, vhost, args.messages, timeout, consumers)
        elapsed = time.monotonic() - started
        rss_end = [vm_rss_kib(p.pid) for p in consumers]
        result = verdict(exchange, planned, publisher.committed)
        alive = [p.popen.poll() is None for p in processes]
        duplicates = sum(p.count("outcome=duplicate") for p in consumers)
        retries = sum(p.count("outcome=retry ") for p in consumers)
        reconnects = [p.count("lost or refused") for p in consumers]
    finally:
        for proc in processes:
            proc.stop()
        try:
            rabbitmqctl("delete_vhost", vhost)
        except Exception as exc:  # noqa: BLE001 - report, the run's figures matter more
            print(f"warning: could not delete vhost {vhost}: {exc}")
        if not args.keep_db:
            from django.db import connections

            connections.close_all()
            drop_database(DATABASE)

    print()
    print(f"messages:          {result.messages:,} (settled: {settled})")
    print(f"lost:              {result.lost}")
    print(f"doubled:           {result.doubled}")
    print(
        f"dead letters:      expected {result.expected_dead:,}, actual {result.dead:,} "
        f"(unexpected {dict(result.unexpected_dead)}, missing {result.missing_dead})"
    )
    print(f"inbox rows:        {result.inbox}")
    print(f"duplicates absorbed {duplicates:,}, retries {retries:,}, reconnects {reconnects}")
    print(
        f"throughput:        {result.messages / elapsed:,.0f} msg/s end to end "
        f"({result.messages:,} messages, each handled by 2 consumers, in {elapsed:.1f}s, "
        f"broker down {broker_down:.1f}s of it)"
    )
    print(
        "consumer RSS:      "
        + ", ".join(
            f"pid {p.pid}: {mib(a)} -> {mib(b)}"
            for p, a, b in zip(consumers, rss_start, rss_end, strict=True)
        )
    )
    print(f"processes alive at the end (consume, consume, relay): {alive}")
    print(f"wall time:         {time.monotonic() - wall_start:.1f}s")
    return 0 if result.ok and settled and all(alive) else 1


if __name__ == "__main__":
    sys.exit(main())
