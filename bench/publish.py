"""publish() benchmark: what publishing costs a business transaction, and how fast the relay hears.

    .venv/bin/python bench/publish.py [--seconds 5] [--django-seconds 5] [--latency-seconds 10]

Each throughput figure is the median of ``ROUNDS`` rounds run in turn.

1. Database-bound: the statements of one small business transaction (a row of
   ``tests.testapp.Effect``, then ``publish()``), captured from Django and replayed by pgbench,
   a LISTENing session present, at 64 and 32 connections:
   - the business insert alone;
   - with the outbox row, no wake-up at all (the floor publishing can reach);
   - with the outbox row and the after-commit wake-up as shipped: beside pgbench, eight of
     the real wake-up senders (``WakeUpSender``, one per web process) are asked for a wake-up
     every ``ASK_EVERY`` the whole time, as by eight processes that always have a new commit to
     announce; they send their ``NOTIFY``s on eight connections of their own, at the pace they
     choose (the figure printed is how many they sent a second);
   - the other way, as a reference in the same run: the outbox row under a statement-level
     NOTIFY trigger (created for the run, dropped after), which wakes the relay from inside the
     publishing transaction.
   References beside them: the business transaction plus ``SELECT 1`` (any second statement's
   round trip), plus the narrowest row there is, and plus an intake row: the envelope as one
   text, what publish() could write instead of the outbox row for the relay to unpack later
   (measured, not built: docs/benchmarks.md says why).
2. Commit-to-broker latency: a real ``manage.py relay`` process, rows published in autocommit
   at a steady rate, a consumer measuring arrival minus the time taken just before
   ``publish()``; with the relay idle, then under the 64-connection loads. A publishing load
   has its eight wake-up senders beside it, as in 1: its rows are announced as real
   publishers' are, not left for the relay's poll to find.
3. The idle relay: its CPU and the transactions it makes a second (``pg_stat_database``).
4. Through Django: 8 processes x 8 threads running the business transaction with and without
   ``publish()``.

Everything runs on its own database (``RM_BENCH_DB``, ``rm_bench_publish`` by default).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "rm_bench_publish")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import (
    BENCH_DB,
    BROKER_URL,
    DATABASE_URL,
    ROOT,
    declare_sink,
    describe_machine,
    drop_sink,
    median,
    percentile,
    recreate_database,
    setup_django,
    subprocess_env,
)

WAKERS = 8
# The paced publishing load of part 2 commits this share of what the same connections commit
# flat out on this machine (part 1), a pace one relay keeps up with beside them: a fixed rate
# was beyond the relay on a slower day, and its latency then measured a backlog.
PACED_SHARE = 0.3
ROUNDS = 3
PGBENCH = ["pgbench", "-h", "127.0.0.1", "-U", "postgres", "-n"]


# --------------------------------------------------------------------------- pgbench


def captured_statements(exchange: str) -> tuple[str, str]:
    """The business insert and the outbox insert of one publishing transaction, as Django
    sent them (parameters inlined)."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from reliable_messaging import publish
    from tests.testapp.models import Effect

    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        Effect.objects.create(
            consumer="shop", message_id="order-1", attempt=1, payload={"order_id": 1}
        )
        publish("bench.load", {"order_id": 1, "amount": "9.99"}, exchange=exchange)
    statements = [query["sql"] for query in queries.captured_queries]
    business = next(s for s in statements if "testapp_effect" in s)
    outbox = next(s for s in statements if "reliable_messaging_outboxmessage" in s)
    return business, outbox


# NOTIFYs a second the wake-up senders sent beside each pgbench run that had them.
NOTIFY_RATES: dict[str, list[float]] = {}
# The share of a core (%) the process of those senders used.
SENDERS_CPU: dict[str, list[float]] = {}
# WAL bytes a transaction wrote, per run with a ``wal`` label.
WAL_BYTES: dict[str, list[float]] = {}
# The narrowest row a second statement could insert: the ceiling of any outbox row's ratio.
NARROW_TABLE = "bench_narrow"
# What publish() could write instead of the outbox row, measured and not built: an intake row
# (an identity, the envelope as one text, the time by default), which the relay would unpack
# into the outbox later.
INTAKE_TABLE = "bench_intake"


def intake_envelope(outbox: str) -> str:
    """The values of the captured outbox ``INSERT`` as one JSON text, as an intake row would
    hold them."""
    import json

    values = re.findall(r"'((?:[^']|'')*)'", outbox.split(" VALUES ", 1)[1])
    message_id, exchange, routing_key, body, headers = (v.replace("''", "'") for v in values[:5])
    return json.dumps(
        {
            "message_id": message_id,
            "exchange": exchange,
            "routing_key": routing_key,
            "body": body,
            "headers": json.loads(headers),
        }
    )


def wal_lsn() -> str:
    import psycopg

    with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
        row = connection.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    return str(row[0]) if row else "0/0"


def wal_since(start: str) -> int:
    import psycopg

    with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
        row = connection.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [start]
        ).fetchone()
    return int(row[0]) if row else 0


def pgbench(
    script: str,
    clients: int,
    seconds: float,
    wake_ups: str | None = None,
    rate: int | None = None,
    wal: str | None = None,
) -> float:
    """Commits a second of ``script`` at ``clients`` connections (at most ``rate`` a second
    when given). With ``wake_ups`` (a label), ``WAKERS`` real wake-up senders are asked for a
    wake-up every millisecond meanwhile; the NOTIFYs they sent a second go to
    ``NOTIFY_RATES[wake_ups]``. With ``wal`` (a label), the WAL bytes written per committed
    transaction go to ``WAL_BYTES[wal]`` (this run's, with only the LISTENing session beside
    it, which writes none)."""
    started_at = wal_lsn() if wal is not None else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "txn.sql"
        path.write_text(script)
        side = None
        if wake_ups is not None:
            side = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--wakers",
                    str(WAKERS),
                    "--seconds",
                    str(int(seconds) + 1),
                ],
                env=subprocess_env(os.environ["RM_TEST_NAMESPACE"]),
                stdout=subprocess.PIPE,
                text=True,
            )
            assert side.stdout is not None
            side.stdout.readline()  # "ready": Django set up, the senders connected
        result = subprocess.run(
            [
                *PGBENCH,
                "-c",
                str(clients),
                "-j",
                "2",
                "-T",
                str(int(seconds)),
                "-f",
                str(path),
                *(["-R", str(rate)] if rate else []),
                BENCH_DB,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        if side is not None and wake_ups is not None:
            out, _ = side.communicate(timeout=60)
            notifies, cpu = out.strip().splitlines()[-1].split()
            NOTIFY_RATES.setdefault(wake_ups, []).append(float(notifies))
            SENDERS_CPU.setdefault(wake_ups, []).append(float(cpu))
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", result.stdout)
    processed = re.search(r"number of transactions actually processed: (\d+)", result.stdout)
    if match is None or processed is None:
        raise RuntimeError(f"pgbench said:\n{result.stdout}\n{result.stderr}")
    if wal is not None:
        WAL_BYTES.setdefault(wal, []).append(wal_since(started_at) / int(processed.group(1)))
    return float(match.group(1))


@contextlib.contextmanager
def listening() -> Iterator[None]:
    """A LISTENing session, drained as notifications come, as a relay would."""
    import psycopg

    from reliable_messaging.publishing.listener import NOTIFY_CHANNEL

    connection = psycopg.connect(DATABASE_URL, autocommit=True)
    connection.execute(f"LISTEN {NOTIFY_CHANNEL}")
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            ready, _, _ = select.select([connection.fileno()], [], [], 0.2)
            if ready:
                connection.pgconn.consume_input()
                while connection.pgconn.notifies() is not None:
                    pass

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        connection.close()


def empty_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE testapp_effect, reliable_messaging_outboxmessage,"
            f" {NARROW_TABLE}, {INTAKE_TABLE}"
        )
        cursor.execute("CHECKPOINT")  # so every run starts with the same full-page writes
        cursor.execute("VACUUM ANALYZE testapp_effect")
        cursor.execute("VACUUM ANALYZE reliable_messaging_outboxmessage")


# A wake-up sent from inside the publishing transaction, by a trigger (NOTIFY is delivered on
# commit, folded into one per transaction): its commit takes PostgreSQL's instance-wide
# notification lock.
NOTIFY_TRIGGER = """
CREATE FUNCTION reliable_messaging_outbox_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('reliable_messaging_outbox', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER reliable_messaging_outbox_notify
    AFTER INSERT ON reliable_messaging_outboxmessage
    FOR EACH STATEMENT EXECUTE FUNCTION reliable_messaging_outbox_notify();
"""
DROP_NOTIFY_TRIGGER = """
DROP TRIGGER IF EXISTS reliable_messaging_outbox_notify ON reliable_messaging_outboxmessage;
DROP FUNCTION IF EXISTS reliable_messaging_outbox_notify();
"""


@contextlib.contextmanager
def old_trigger() -> Iterator[None]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(NOTIFY_TRIGGER)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(DROP_NOTIFY_TRIGGER)


def database_bound(exchange: str, seconds: float) -> dict[int, dict[str, float]]:
    business, outbox = captured_statements(exchange)
    alone = f"BEGIN;\n{business};\nCOMMIT;\n"
    with_row = f"BEGIN;\n{business};\n{outbox};\nCOMMIT;\n"
    # The ceiling of any second statement: a round trip that does nothing, and the narrowest
    # row there is.
    with_select = f"BEGIN;\n{business};\nSELECT 1;\nCOMMIT;\n"
    with_narrow = f"BEGIN;\n{business};\nINSERT INTO {NARROW_TABLE} (note) VALUES ('x');\nCOMMIT;\n"
    envelope = intake_envelope(outbox).replace("'", "''")
    with_intake = (
        f"BEGIN;\n{business};\nINSERT INTO {INTAKE_TABLE} (envelope) VALUES ('{envelope}');\n"
        "COMMIT;\n"
    )
    results: dict[int, dict[str, float]] = {}
    with listening():
        for clients in (64, 32):
            # All in turn, ``rounds`` times, each figure the median of its rounds: on a
            # machine shared with other work, a figure taken once moves by a third.
            rounds: dict[str, list[float]] = {}
            for _ in range(ROUNDS):
                empty_tables()
                rounds.setdefault("business", []).append(
                    pgbench(alone, clients, seconds, wal=f"business, {clients}")
                )
                empty_tables()
                rounds.setdefault("select", []).append(pgbench(with_select, clients, seconds))
                empty_tables()
                rounds.setdefault("narrow", []).append(pgbench(with_narrow, clients, seconds))
                empty_tables()
                rounds.setdefault("intake", []).append(pgbench(with_intake, clients, seconds))
                empty_tables()
                rounds.setdefault("outbox", []).append(
                    pgbench(with_row, clients, seconds, wal=f"outbox, {clients}")
                )
                empty_tables()
                rounds.setdefault("shipped", []).append(
                    pgbench(with_row, clients, seconds, wake_ups=f"shipped, {clients}")
                )
                empty_tables()
                with old_trigger():
                    rounds.setdefault("trigger", []).append(pgbench(with_row, clients, seconds))
            empty_tables()
            results[clients] = {key: median(values) for key, values in rounds.items()}
    return results


# --------------------------------------------------------------------------- latency


def start_relay(namespace: str) -> subprocess.Popen[str]:
    relay = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "relay"],
        env=subprocess_env(namespace),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    time.sleep(3)  # it connects, LISTENs and finds nothing to send
    return relay


def marking_sent(namespace: str, exchange: str, outbox: str, rows: int = 20_000) -> float:
    """WAL bytes per row that ``relay --once`` writes sending ``rows`` rows of ``outbox`` (the
    publishing transaction's INSERT) to a bound queue: what marking a row sent costs."""
    load_queue = f"{exchange}.load"
    declare_sink(exchange, load_queue, "bench.load")
    try:
        empty_tables()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "row.sql"
            path.write_text(f"{outbox};\n")
            subprocess.run(
                [*PGBENCH, "-c", "8", "-j", "2", "-t", str(rows // 8), "-f", str(path), BENCH_DB],
                capture_output=True,
                check=True,
            )
        started_at = wal_lsn()
        subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "relay", "--once"],
            env=subprocess_env(namespace),
            capture_output=True,
            check=True,
            timeout=600,
        )
        return wal_since(started_at) / rows
    finally:
        drop_sink(None, load_queue)


def latencies(exchange: str, queue: str, rate: int, seconds: float) -> list[float]:
    """Publish in autocommit at ``rate``/s; milliseconds from just before each publish() to its
    arrival on ``queue``."""
    from reliable_messaging import publish

    found: list[float] = []
    total = int(rate * seconds)
    done = threading.Event()

    def consume() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        quiet = 0
        for _method, properties, _body in channel.consume(
            queue, auto_ack=True, inactivity_timeout=1
        ):
            if properties is None:
                quiet = quiet + 1 if done.is_set() else 0
                if quiet >= 10:  # the relay may still be working through a backlog
                    break
                continue
            quiet = 0
            started_us = (properties.headers or {}).get("x-bench-started-at")
            if isinstance(started_us, int):
                found.append(time.time_ns() / 1e6 - started_us / 1000)
            if len(found) >= total:
                break
        connection.close()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    next_at = time.perf_counter()
    for i in range(total):
        publish(
            "bench.latency",
            {"i": i},
            exchange=exchange,
            headers={"x-bench-started-at": time.time_ns() // 1000},
        )
        next_at += 1 / rate
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    done.set()
    consumer.join(timeout=60)
    return found


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def transactions() -> int:
    import psycopg

    with psycopg.connect(DATABASE_URL, autocommit=True) as connection:
        connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            [BENCH_DB],
        ).fetchone()
    return int(row[0]) if row else 0


def idle_relay(relay: subprocess.Popen[str], seconds: float) -> tuple[float, float]:
    """The idle relay's share of a core (%) and the bench database's transactions a second
    meanwhile (the relay's, and the two of this measurement)."""
    time.sleep(11)  # past PostgreSQL's delay in reporting an idle session's figures
    cpu, commits, start = cpu_seconds(relay.pid), transactions(), time.monotonic()
    time.sleep(seconds)
    time.sleep(11)
    commits_end = transactions()
    elapsed = time.monotonic() - start
    cpu_share = (cpu_seconds(relay.pid) - cpu) / elapsed * 100
    return cpu_share, max(0, commits_end - commits - 1) / elapsed


# --------------------------------------------------------------------------- Django


def django_worker(publishing: bool, threads: int, start_at: float, seconds: float) -> None:
    """One process of the Django run: prints how many transactions its threads committed."""
    import django

    django.setup()
    from django.db import connection, transaction

    from reliable_messaging import publish
    from tests.testapp.models import Effect

    counts = [0] * threads

    def run(index: int) -> None:
        time.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds
        n = 0
        while time.time() < end:
            with transaction.atomic():
                Effect.objects.create(
                    consumer="shop", message_id=f"o-{index}-{n}", attempt=1, payload={"n": n}
                )
                if publishing:
                    publish("bench.django", {"order_id": n, "amount": "9.99"})
            n += 1
        counts[index] = n
        connection.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(sum(counts))


# How often each of the benchmark's wake-up senders is asked for a wake-up: as often as its
# shortest pause, so that every pause ends with a commit waiting (a process that always has a
# new commit), and no more often, since asking costs Python time a real process spends once
# per commit, not in a loop.
ASK_EVERY = 0.005


def wakers_worker(count: int, seconds: float) -> None:
    """``count`` real wake-up senders, each asked for a wake-up every ``ASK_EVERY`` for
    ``seconds``: prints the NOTIFYs they sent a second and the share of a core the process
    used meanwhile."""
    import django

    django.setup()
    from reliable_messaging.publishing.wake_after_commit import WakeUpSender

    senders = [WakeUpSender() for _ in range(count)]
    for each in senders:  # connect before the measured time
        each.request("default")
    for each in senders:
        each.flush()
    print("ready", flush=True)
    sent = sum(each.sent for each in senders)
    cpu = time.process_time()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for each in senders:
            each.request("default")
        time.sleep(ASK_EVERY)
    cpu = time.process_time() - cpu
    for each in senders:
        each.flush()
        each.close()
    print(f"{(sum(each.sent for each in senders) - sent) / seconds} {cpu / seconds * 100}")


def django_rate(namespace: str, publishing: bool, seconds: float) -> float:
    start_at = time.time() + 4
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "publish" if publishing else "plain",
                "--start-at",
                str(start_at),
                "--django-seconds",
                str(seconds),
            ],
            env=subprocess_env(namespace),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    total = 0
    for process in processes:
        out, _ = process.communicate(timeout=seconds + 120)
        total += int(out.strip().splitlines()[-1])
    return total / seconds


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--django-seconds", type=float, default=5)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument(
        "--paced-rate",
        type=int,
        default=0,
        help="commits/s of the paced publishing load (default: PACED_SHARE of the rate the"
        " shipped publishing transaction reached at 64 connections in part 1)",
    )
    parser.add_argument("--latency-seconds", type=float, default=10)
    parser.add_argument("--worker", choices=["publish", "plain"])
    parser.add_argument("--wakers", type=int, default=0)
    parser.add_argument("--start-at", type=float, default=0)
    args = parser.parse_args()
    if args.worker or args.wakers:
        sys.path.insert(0, str(ROOT))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
        if args.wakers:
            wakers_worker(args.wakers, args.seconds)
        else:
            django_worker(args.worker == "publish", 8, args.start_at, args.django_seconds)
        return

    # Fresh: a database left by an earlier version of the schema would not migrate.
    recreate_database(BENCH_DB)
    namespace = setup_django()
    from django.conf import settings

    exchange = str(settings.RELIABLE_MESSAGING["EXCHANGE"])
    queue = f"{exchange}.latency"
    print(f"publish() benchmark on {describe_machine()}")
    declare_sink(exchange, queue, "bench.latency")
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {NARROW_TABLE} (id bigserial PRIMARY KEY, note text)")
        cursor.execute(
            f"CREATE TABLE {INTAKE_TABLE} (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,"
            " envelope text NOT NULL, created_at timestamptz NOT NULL"
            " DEFAULT statement_timestamp())"
        )
    try:
        db = database_bound(exchange, args.seconds)
        business, outbox = captured_statements(exchange)
        sent_wal = marking_sent(namespace, exchange, outbox)
        empty_tables()
        relay = start_relay(namespace)
        try:
            cpu, per_second = idle_relay(relay, 10)
            idle = latencies(exchange, queue, args.rate, args.latency_seconds)
            publishing_script = f"BEGIN;\n{business};\n{outbox};\nCOMMIT;\n"
            paced = args.paced_rate or int(round(db[64]["shipped"] * PACED_SHARE, -1))
            # (script, rate limit): as fast as it goes, and publishing at a pace one relay on
            # this machine keeps up with beside the load. The publishing loads have their
            # wake-up senders beside them.
            loads: dict[str, tuple[str, int | None]] = {
                "business": (f"BEGIN;\n{business};\nCOMMIT;\n", None),
                "publishing": (publishing_script, None),
                f"publishing at {paced:,}/s": (publishing_script, paced),
            }
            loaded: dict[str, list[float]] = {}
            tps: dict[str, float] = {}
            for name, (script, limit) in loads.items():
                empty_tables()
                load = threading.Thread(
                    target=lambda n=name, s=script, r=limit: tps.update(
                        {
                            n: pgbench(
                                s,
                                64,
                                args.latency_seconds + 4,
                                wake_ups=n if "publishing" in n else None,
                                rate=r,
                            )
                        }
                    ),
                    daemon=True,
                )
                load.start()
                time.sleep(3)  # its wake-up senders started, then pgbench
                loaded[name] = latencies(exchange, queue, args.rate, args.latency_seconds)
                load.join(timeout=args.latency_seconds + 60)
        finally:
            relay.terminate()
            relay.wait(timeout=30)
        plains, publishings = [], []
        for _ in range(ROUNDS):
            empty_tables()
            plains.append(django_rate(namespace, False, args.django_seconds))
            empty_tables()
            publishings.append(django_rate(namespace, True, args.django_seconds))
        empty_tables()
        plain, publishing = median(plains), median(publishings)
    finally:
        drop_sink(exchange, queue)

    print()
    print("| the same transaction, pgbench | 64 connections | ratio | 32 connections | ratio |")
    print("|---|---|---|---|---|")
    rows = [
        ("business insert alone", "business", "business"),
        ("+ SELECT 1 (any second statement's round trip)", "select", "business"),
        ("+ the narrowest row (a bigserial and a text)", "narrow", "business"),
        ("+ an intake row (an identity, the envelope, a time; not built)", "intake", "business"),
        ("+ the outbox row, no wake-up", "outbox", "business"),
        ("+ the outbox row, after-commit wake-up (shipped)", "shipped", "outbox"),
        ("+ the outbox row, NOTIFY trigger (before)", "trigger", "outbox"),
    ]
    for label, key, base in rows:
        cells = []
        for clients in (64, 32):
            value = db[clients][key]
            cells.append(f"{value:,.0f}/s")
            cells.append(f"{value / db[clients][base]:.2f}x {base}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"(each figure the median of {ROUNDS} rounds of {args.seconds:.0f} s, in turn)")
    for what in ("business", "outbox"):
        per = WAL_BYTES.get(f"{what}, 64", []) + WAL_BYTES.get(f"{what}, 32", [])
        print(
            f"WAL per transaction, {what}: {median(per):,.0f} bytes "
            f"(median of {len(per)} runs, {min(per):,.0f} to {max(per):,.0f})"
        )
    print(f"WAL per row the relay marks sent (relay --once, 20,000 rows): {sent_wal:,.0f} bytes")
    for clients in (64, 32):
        rates = NOTIFY_RATES.get(f"shipped, {clients}", [])
        cpus = SENDERS_CPU.get(f"shipped, {clients}", [])
        print(
            f"shipped, {clients} connections: the {WAKERS} wake-up senders sent "
            f"{', '.join(f'{r:,.0f}' for r in rates)} NOTIFYs/s, their process using "
            f"{', '.join(f'{c:.1f}' for c in cpus)} % of a core"
        )
    for clients in (64, 32):
        row = db[clients]
        shipped = row["shipped"]
        print(
            f"{clients} connections: shipped / business alone {shipped / row['business']:.2f}"
            f" (goal >= 0.7), shipped / outbox row alone {row['shipped'] / row['outbox']:.2f}"
            f" (goal >= 0.9); the trigger: {row['trigger'] / row['business']:.2f} and "
            f"{row['trigger'] / row['outbox']:.2f}; the ceiling of any second statement: "
            f"{row['select'] / row['business']:.2f} (SELECT 1), "
            f"{row['narrow'] / row['business']:.2f} (the narrowest row); an intake row "
            f"{row['intake'] / row['business']:.2f}"
        )
    print()
    print(
        f"commit->broker latency, idle relay, {args.rate}/s, {len(idle)} messages: "
        f"p50 {percentile(idle, 50):.1f} ms, p99 {percentile(idle, 99):.1f} ms "
        f"(goal p50 <= 10, p99 <= 50)"
    )
    for name, found in loaded.items():
        what = ""
        if "publishing" in name:
            sent = NOTIFY_RATES.get(name, [float("nan")])[-1]
            what = (
                f"(an outbox row each, which the relay sends too; {WAKERS} wake-up senders "
                f"beside it sent {sent:,.0f} NOTIFYs/s) "
            )
        print(
            f"commit->broker latency under 64 connections of the {name} transaction {what}"
            f"({tps.get(name, float('nan')):,.0f} commits/s), {len(found)} of "
            f"{int(args.rate * args.latency_seconds)} messages: "
            f"p50 {percentile(found, 50):.1f} ms, p99 {percentile(found, 99):.1f} ms "
            "(goal p99 <= 250)"
        )
    print(
        f"idle relay: {cpu:.2f}% of a core, {per_second:.2f} transactions/s on its database "
        f"(goal < 2%)"
    )
    print(
        f"through Django, 8 processes x 8 threads: without publish() {plain:,.0f}/s, with "
        f"{publishing:,.0f}/s, ratio {publishing / plain:.2f} (goal >= 0.65); rounds: "
        f"{', '.join(f'{b:,.0f}/{a:,.0f}' for a, b in zip(plains, publishings, strict=True))}"
    )


if __name__ == "__main__":
    main()
