"""Relay at scale (issue 14): relay throughput with a big outbox beside the work, against raw
pika with pipelined confirms in the same run, the time of one claim, and the relay's memory.

    .venv/bin/python bench/scale.py
        [--states empty,not_due,blocked,scheduled,sent,sent_blocked]
        [--sent-rows 1000000] [--extra-rows 200000] [--blocked-keys 2000]
        [--scheduled-rows 1000000] [--burst-rows 100000]
        [--messages 20000] [--key-share 0] [--memory-messages 100000]
        [--relay-timeout 600] [--rounds 2] [--keep-db]

The issue's full size is ``--sent-rows 30000000``: about 15 GB in the bench database and a load
of the order of half an hour on 2 cores. The default (1,000,000 sent rows) keeps ``make bench``
to a few minutes per state.

States (each in the database ``$RM_BENCH_DB``, default ``rm_bench_scale``, dropped and created
afresh at the start and dropped at the end unless ``--keep-db``):

- ``empty``: nothing but the measured rows.
- ``not_due``: + ``--extra-rows`` pending rows waiting out a backoff (attempts 1, due in an hour).
- ``blocked``: + ``--extra-rows`` keyed rows over ``--blocked-keys`` keys: the earliest row of
  each key failed (attempts exhausted), every later one pending and due, so none can go.
- ``sent``: + ``--sent-rows`` sent rows (history nobody deleted yet).
- ``sent_blocked``: both of the last two.
- ``scheduled``: + ``--scheduled-rows`` scheduled messages (``publish(deliver_at=...)``) due
  over the next month, none of them due yet.

Then the burst (``--burst-rows``, 0 skips it): that many scheduled messages fallen due at the
same second, in an outbox holding nothing else, drained by the same relay child (which makes
them pending a chunk at a time and sends them); its rate is compared with the ``empty`` state's
relay rate of the same run.

The rows are written with ``INSERT ... SELECT ... FROM generate_series`` into the migrated table,
indexes in place as in production, shaped as ``publish()`` writes them (message ids of the kind
it mints, random or time-ordered: it is asked). Then a relay runs once over the state before
anything is measured, so whatever a relay does to rows it finds but cannot send (parking the
ones held back by their key, say) is done, as a running relay would long have done it; and
``VACUUM ANALYZE`` does what autovacuum would (this machine's PostgreSQL runs with it off).

The measured work is ``--messages`` rows published with the app's ``publish()`` in transactions
of 5,000, drained by ``build_relay(once=True, listen=False)`` in a subprocess: ``once`` stops
when nothing claimable is left, and the pre-built rows never are, so it ends when the measured
rows are sent; its time runs to the last batch recorded. The raw baseline publishes the same
message ids and bodies with pika, confirms kept in flight, right before and right after the
relay; the ratio is relay / the mean of the two. Each state is measured ``--rounds`` times
(default 2) on the same build, and the table shows every round: the spread.

"One claim" is the median time of the relay's own claim queries in that run (the queries on the
outbox table with ``FOR UPDATE``, timed with a Django ``execute_wrapper`` in the relay's
process), so it follows the relay's claim whatever shape it takes; "n/a" when none went through
Django's connection. Memory: a real ``manage.py relay`` sending ``--memory-messages`` rows
published while it runs (bench/relay.py's ``relay_memory``), on an empty outbox.

A relay run that fails or outlasts ``--relay-timeout`` fails its state (shown as failed, with
why) and the next state goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before _common reads it: the states get a database of their own, never the other benches'.
os.environ.setdefault("RM_BENCH_DB", "rm_bench_scale")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH_DB,
    ROOT,
    describe_machine,
    drop_database,
    median,
    percentile,
    recreate_database,
    setup_django,
    subprocess_env,
)

RESULT_MARK = "SCALE_RESULT "
PUBLISH_TRANSACTION = 5000
LOAD_CHUNK = 1_000_000  # rows per INSERT statement (one transaction each) while building
GOAL_EMPTY_RATIO = 0.7
GOAL_STATE_SPREAD = 0.15
GOAL_RSS_GROWTH = 0.10


@dataclass(frozen=True)
class State:
    name: str
    sent: bool = False
    not_due: bool = False
    blocked: bool = False
    scheduled: bool = False

    def label(self, sent_rows: int, extra_rows: int, scheduled_rows: int = 0) -> str:
        if self.name == "empty":
            return "empty outbox"
        parts = []
        if self.sent:
            parts.append(f"{sent_rows:,} sent rows")
        if self.not_due:
            parts.append(f"{extra_rows:,} pending rows not yet due")
        if self.blocked:
            parts.append(f"{extra_rows:,} pending rows whose keys wait behind a failed row")
        if self.scheduled:
            parts.append(f"{scheduled_rows:,} scheduled rows due over the next month")
        return ("+ " if not self.sent else "") + " + ".join(parts)


STATES = {
    s.name: s
    for s in (
        State("empty"),
        State("not_due", not_due=True),
        State("blocked", blocked=True),
        State("scheduled", scheduled=True),
        State("sent", sent=True),
        State("sent_blocked", sent=True, blocked=True),
    )
}


@dataclass(frozen=True)
class Measurement:
    """One state's figures; the rates count the measured messages only."""

    state: State
    build_s: float
    vacuum_s: float
    relay_s: float
    raw_s: float
    messages: int
    claims: list[float] = field(default_factory=list)
    claim_note: str = ""
    query_note: str = ""

    @property
    def relay_rate(self) -> float:
        return self.messages / self.relay_s

    @property
    def raw_rate(self) -> float:
        return self.messages / self.raw_s

    @property
    def ratio(self) -> float:
        return self.relay_rate / self.raw_rate

    def claim_ms(self) -> float | None:
        return median(self.claims) * 1000 if self.claims else None


# --------------------------------------------------------------------------- SQL helpers


def table() -> str:
    from reliable_messaging.models import OutboxMessage

    return OutboxMessage._meta.db_table


def execute(sql: str, params: list[Any] | None = None) -> None:
    """One statement in autocommit (each its own transaction, as a bulk load would go)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def scalar(sql: str, params: list[Any] | None = None) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


# The columns publish() writes, in the order of every INSERT below; the body is the JSON text
# encode_payload() makes of {"order_id": i, "amount": "19.99", "customer": "c<i % 97>"}.
# (%% is a literal % in a statement with parameters.) Each SELECT names the row's creation
# time ``c``.
COLUMNS = (
    "message_id, exchange, routing_key, body, headers, ordering_key, idempotency_key, status, "
    "attempts, last_error, next_attempt_at, created_at, sent_at"
)
BODY_SQL = """'{"order_id":' || i || ',"amount":"19.99","customer":"c' || (i %% 97) || '"}'"""
UUID4_SQL = "gen_random_uuid()::text"
# A UUIDv7 of the creation time: a random UUID with its first 48 bits replaced by the Unix
# time in milliseconds and its version nibble by 7.
UUID7_SQL = """overlay(overlay(overlay(gen_random_uuid()::text
    placing substr(lpad(to_hex(floor(extract(epoch FROM c) * 1000)::bigint), 12, '0'), 1, 8)
    FROM 1 FOR 8)
    placing substr(lpad(to_hex(floor(extract(epoch FROM c) * 1000)::bigint), 12, '0'), 9, 4)
    FROM 10 FOR 4) placing '7' FROM 15 FOR 1)"""


def message_id_sql() -> str:
    """SQL minting message ids of the kind publish() mints: it is asked (one row, rolled
    back), since the kind matters to the message_id index (random ids land on random pages)."""
    from django.db import transaction

    from reliable_messaging import publish

    with transaction.atomic():
        message_id = publish("bench.probe", {}, exchange="")
        transaction.set_rollback(True)
    return UUID7_SQL if len(message_id) == 36 and message_id[14] == "7" else UUID4_SQL


def load_in_chunks(what: str, total: int, insert_chunk: Any) -> None:
    """Call ``insert_chunk(first, last)`` over 0..total-1 in LOAD_CHUNK steps, with progress."""
    started = time.perf_counter()
    for first in range(0, total, LOAD_CHUNK):
        last = min(total, first + LOAD_CHUNK) - 1
        insert_chunk(first, last)
        if total > LOAD_CHUNK:
            done = last + 1
            elapsed = time.perf_counter() - started
            print(
                f"  {what}: {done:,}/{total:,} rows in {elapsed:.0f}s "
                f"({done / elapsed:,.0f} rows/s)",
                flush=True,
            )


def load_sent(rows: int, exchange: str, ids: str) -> None:
    """Sent history, oldest first, one every 50 ms up to three hours ago."""

    def chunk(first: int, last: int) -> None:
        execute(
            f"""
            INSERT INTO {table()} ({COLUMNS})
            SELECT {ids}, %s, 'bench.order', {BODY_SQL}, '{{}}'::jsonb, NULL,
                   NULL, 'sent', 0, '', c, c, c + interval '30 milliseconds'
            FROM (SELECT i, now() - interval '3 hours' - (%s - i) * interval '50 milliseconds'
                  AS c FROM generate_series(%s, %s) AS i) AS g
            """,
            [exchange, rows, first, last],
        )

    load_in_chunks("sent rows", rows, chunk)


def load_not_due(rows: int, exchange: str, ids: str) -> None:
    """Keyless pending rows that failed once and wait out their backoff: due in an hour."""

    def chunk(first: int, last: int) -> None:
        execute(
            f"""
            INSERT INTO {table()} ({COLUMNS})
            SELECT {ids}, %s, 'bench.order', {BODY_SQL}, '{{}}'::jsonb, NULL,
                   NULL, 'pending', 1, 'no confirm from the broker within 30.0s',
                   now() + interval '1 hour' + i * interval '1 millisecond', c, NULL
            FROM (SELECT i, now() - interval '10 minutes' + i * interval '1 millisecond' AS c
                  FROM generate_series(%s, %s) AS i) AS g
            """,
            [exchange, first, last],
        )

    load_in_chunks("not-due rows", rows, chunk)


def load_blocked(rows: int, keys: int, exchange: str, ids: str, max_attempts: int) -> None:
    """``rows`` keyed rows over ``keys`` keys, interleaved: the first row of each key failed for
    good, the later ones pending and due, so per-key order holds them all back."""

    def chunk(first: int, last: int) -> None:
        execute(
            f"""
            INSERT INTO {table()} ({COLUMNS})
            SELECT {ids}, %s, 'bench.order', {BODY_SQL}, '{{}}'::jsonb,
                   'acct-' || (i %% %s), NULL,
                   CASE WHEN i < %s THEN 'failed' ELSE 'pending' END,
                   CASE WHEN i < %s THEN %s ELSE 0 END,
                   CASE WHEN i < %s THEN 'no confirm from the broker within 30.0s' ELSE '' END,
                   c, c, NULL
            FROM (SELECT i, now() - interval '2 hours' + i * interval '10 milliseconds' AS c
                  FROM generate_series(%s, %s) AS i) AS g
            """,
            [exchange, keys, keys, keys, max_attempts, keys, first, last],
        )

    load_in_chunks("blocked rows", rows, chunk)


def load_scheduled(rows: int, exchange: str, ids: str, *, due_now: bool = False) -> None:
    """Scheduled rows, as publish(deliver_at=...) writes them: spread over the next month from
    an hour ahead, or (``due_now``) all due at the same second, a second ago."""
    due = (
        "date_trunc('second', now()) - interval '1 second'"
        if due_now
        else f"now() + interval '1 hour' + i * (interval '30 days' / {max(rows, 1)})"
    )

    def chunk(first: int, last: int) -> None:
        execute(
            f"""
            INSERT INTO {table()} ({COLUMNS}, deliver_at)
            SELECT {ids}, %s, 'bench.order', {BODY_SQL}, '{{}}'::jsonb, NULL,
                   NULL, 'scheduled', 0, '', d, c, NULL, d
            FROM (SELECT i, now() - interval '10 minutes' + i * interval '1 millisecond' AS c,
                         {due} AS d
                  FROM generate_series(%s, %s) AS i) AS g
            """,
            [exchange, first, last],
        )

    load_in_chunks("scheduled rows" if not due_now else "due rows", rows, chunk)


def vacuum_analyze() -> float:
    started = time.perf_counter()
    execute(f"VACUUM ANALYZE {table()}")
    return time.perf_counter() - started


class OutboxBuilder:
    """Brings the bench database's outbox to a state, reusing the sent history it already has
    (the slow part) when the next state wants it too."""

    def __init__(self, args: argparse.Namespace, exchange: str) -> None:
        self.args = args
        self.exchange = exchange
        self.sent_until: int | None = None  # highest id of the loaded sent history
        self.ids = message_id_sql()

    def build(self, state: State) -> tuple[float, str]:
        """Returns the seconds it took and what was done."""
        from reliable_messaging.conf import messaging_settings

        started = time.perf_counter()
        if state.sent and self.sent_until is not None:
            # Everything after the history goes: earlier states' rows and measured rows.
            execute(f"DELETE FROM {table()} WHERE id > %s", [self.sent_until])
            how = f"reused the {self.args.sent_rows:,} sent rows"
        else:
            execute(f"TRUNCATE {table()} RESTART IDENTITY")
            self.sent_until = None
            how = "from an empty table"
            if state.sent:
                load_sent(self.args.sent_rows, self.exchange, self.ids)
                self.sent_until = scalar(f"SELECT coalesce(max(id), 0) FROM {table()}")
                how = f"loaded {self.args.sent_rows:,} sent rows"
        if state.not_due:
            load_not_due(self.args.extra_rows, self.exchange, self.ids)
            how += f", {self.args.extra_rows:,} not-due rows"
        if state.blocked:
            load_blocked(
                self.args.extra_rows,
                self.args.blocked_keys,
                self.exchange,
                self.ids,
                messaging_settings.outbox_max_attempts,
            )
            how += f", {self.args.extra_rows:,} blocked rows over {self.args.blocked_keys:,} keys"
        if state.scheduled:
            load_scheduled(self.args.scheduled_rows, self.exchange, self.ids)
            how += f", {self.args.scheduled_rows:,} scheduled rows"
        return time.perf_counter() - started, how


# --------------------------------------------------------------------------- the measured run


def publish_measured(messages: int, exchange: str, key_share: float, keys: int) -> int:
    """Publish the measured rows with the app's publish(); returns the id they start after."""
    from django.db import transaction

    from reliable_messaging import publish

    after = scalar(f"SELECT coalesce(max(id), 0) FROM {table()}")
    for start in range(0, messages, PUBLISH_TRANSACTION):
        with transaction.atomic():
            for i in range(start, min(messages, start + PUBLISH_TRANSACTION)):
                # A share key_share of the rows keyed, spread evenly over the run.
                keyed = int((i + 1) * key_share) > int(i * key_share)
                publish(
                    "bench.order",
                    {"order_id": i, "amount": "19.99", "customer": f"c{i % 97}"},
                    exchange=exchange,
                    ordering_key=f"order-{i % keys}" if keyed else None,
                )
    return after


def run_relay_child(namespace: str, timeout: float) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--relay-child"],
        env=subprocess_env(namespace),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    for line in result.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    raise RuntimeError(
        f"the relay process ended ({result.returncode}) without a result:\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


def relay_child() -> None:
    """In the relay's own process: drain what is claimable with ``build_relay(once=True,
    listen=False)``, timing every claim query; print the result as one JSON line."""
    import django

    sys.path.insert(0, str(ROOT))  # the settings module, tests.settings
    django.setup()
    from django.db.backends.signals import connection_created

    from reliable_messaging.publishing.relay import build_relay

    outbox = table()
    claims: list[dict[str, float]] = []

    others: list[tuple[float, str]] = []

    def time_queries(run: Any, sql: str, params: Any, many: bool, context: dict[str, Any]) -> Any:
        started = time.perf_counter()
        try:
            return run(sql, params, many, context)
        finally:
            elapsed = time.perf_counter() - started
            # The claim locks the rows it takes, whatever else it looks like; the relay's other
            # reads and its updates of sent rows lock nothing, but for the statement that makes
            # due scheduled rows pending, which is not a claim.
            if outbox in sql and "FOR UPDATE" in sql.upper() and "'scheduled'" not in sql:
                rows = getattr(context.get("cursor"), "rowcount", -1)
                claims.append({"s": elapsed, "rows": rows})
            else:
                others.append((elapsed, " ".join(sql.split())[:160]))

    last_batch = [0.0]

    def on_batch(_report: Any) -> None:
        last_batch[0] = time.perf_counter()

    def install(sender: Any, connection: Any, **kwargs: Any) -> None:
        # On every connection the process opens, whichever thread it is for: the relay may
        # claim on a thread of its own, and each thread has its own connection.
        if time_queries not in connection.execute_wrappers:
            connection.execute_wrappers.append(time_queries)

    connection_created.connect(install, weak=False)
    try:
        relay = build_relay(once=True, listen=False, on_batch=on_batch)
    except TypeError:  # a relay without the hook: time the whole run
        relay = build_relay(once=True, listen=False)
    started = time.perf_counter()
    report = relay.run()
    ended = time.perf_counter()
    # Drained when the last batch was recorded; what follows (the last, empty claim and the
    # count of rows left that --once reports) is not sending.
    drained = (last_batch[0] or ended) - started
    print(
        RESULT_MARK
        + json.dumps(
            {
                "sent": report.sent,
                "batches": report.batches,
                "drain_s": drained,
                "run_s": ended - started,
                "claims": claims,
                "other_queries": len(others),
                "other_s": sum(t for t, _ in others),
                "slowest_other": sorted(others, reverse=True)[:1],
            }
        ),
        flush=True,
    )


def settle(namespace: str, timeout: float) -> float:
    """Run the relay once over the state just built, before anything is measured: whatever a
    relay does to rows it finds but cannot send (a relay that parks the rows held back by an
    earlier unsent row of their key, say) a running relay would long have done. Returns the
    seconds it took."""
    started = time.perf_counter()
    child = run_relay_child(namespace, timeout)
    elapsed = time.perf_counter() - started
    if child["sent"]:
        raise RuntimeError(f"the built state had {child['sent']} rows the relay could send")
    parked = scalar(
        f"SELECT count(*) FROM {table()} WHERE status = 'pending' AND next_attempt_at IS NULL"
    )
    print(
        f"  settled: a relay --once over it took {elapsed:.1f}s ({len(child['claims'])} claim "
        f"queries; {query_note(child)}) and left {parked:,} rows parked (next_attempt_at NULL)",
        flush=True,
    )
    return elapsed


def query_note(child: dict[str, Any]) -> str:
    """The relay's other queries in a run, in all and the slowest (where the time went when
    it was not the claim)."""
    total_ms = child["other_s"] * 1000
    note = f"{child['other_queries']} other queries of the whole run took {total_ms:,.0f} ms"
    if child["slowest_other"]:
        seconds, sql = child["slowest_other"][0]
        note += f", the slowest {seconds * 1000:,.1f} ms: {sql}"
    return note


def measure(
    state: State,
    build_s: float,
    vacuum_s: float,
    args: argparse.Namespace,
    namespace: str,
    exchange: str,
    queue: str,
) -> Measurement:
    from relay import declare_sink, raw_pika_publish

    from reliable_messaging.choices import OutboxStatus
    from reliable_messaging.models import OutboxMessage

    declare_sink(exchange, queue)  # purges
    started = time.perf_counter()
    after = publish_measured(args.messages, exchange, args.key_share, args.fresh_keys)
    published_s = time.perf_counter() - started
    analyzed_s = vacuum_analyze()  # autovacuum's analyze after a bulk insert
    fresh = OutboxMessage.objects.filter(id__gt=after)
    bodies = [(m, b.encode()) for m, b in fresh.order_by("id").values_list("message_id", "body")]
    print(
        f"  published {args.messages:,} rows with publish() in {published_s:.1f}s, "
        f"VACUUM ANALYZE {analyzed_s:.1f}s; relay draining them...",
        flush=True,
    )
    # The baseline runs twice, right before and right after the relay, and counts their mean:
    # on a shared machine one run alone swings with whatever else runs at that moment.
    declare_sink(exchange, queue)
    raw_runs = [raw_pika_publish(exchange, bodies)]
    declare_sink(exchange, queue)
    child = run_relay_child(namespace, args.relay_timeout)
    sent_rows = fresh.filter(status=OutboxStatus.SENT).count()
    if child["sent"] != args.messages or sent_rows != args.messages:
        raise RuntimeError(
            f"{state.name}: the relay sent {child['sent']} and the outbox shows {sent_rows} of "
            f"the {args.messages} measured rows sent"
        )
    declare_sink(exchange, queue)
    raw_runs.append(raw_pika_publish(exchange, bodies))
    declare_sink(exchange, queue)
    raw_s = sum(raw_runs) / len(raw_runs)
    claims = [c["s"] for c in child["claims"]]
    measurement = Measurement(
        state=state,
        build_s=build_s,
        vacuum_s=vacuum_s,
        relay_s=child["drain_s"],
        raw_s=raw_s,
        messages=args.messages,
        claims=claims,
        claim_note=(
            f"{len(claims)} claims, median {median(claims) * 1000:.1f} ms, "
            f"p95 {percentile(claims, 95) * 1000:.1f} ms, max {max(claims) * 1000:.1f} ms"
            if claims
            else "n/a: no claim query (FOR UPDATE on the outbox) went through Django's "
            "connection in the relay's process"
        ),
        query_note=query_note(child),
    )
    raw_each = " and ".join(f"{args.messages / t:,.0f}" for t in raw_runs)
    print(
        f"  relay {measurement.relay_rate:,.0f} msg/s ({child['batches']} batches, "
        f"{child['drain_s']:.2f}s; the whole --once run {child['run_s']:.2f}s), raw pika "
        f"{measurement.raw_rate:,.0f} msg/s (mean of {raw_each}), ratio "
        f"{measurement.ratio:.2f}; {measurement.claim_note}; {measurement.query_note}",
        flush=True,
    )
    return measurement


@dataclass(frozen=True)
class Burst:
    rows: int
    drain_s: float
    batches: int

    @property
    def rate(self) -> float:
        return self.rows / self.drain_s if self.drain_s else 0.0


def measure_burst(args: argparse.Namespace, namespace: str, exchange: str, queue: str) -> Burst:
    """``--burst-rows`` scheduled rows due at the same second, alone in the outbox, drained by
    the relay child."""
    from relay import declare_sink

    from reliable_messaging.choices import OutboxStatus
    from reliable_messaging.models import OutboxMessage

    execute(f"TRUNCATE {table()} RESTART IDENTITY")
    load_scheduled(args.burst_rows, exchange, message_id_sql(), due_now=True)
    vacuum_analyze()
    declare_sink(exchange, queue)
    print(f"burst: {args.burst_rows:,} scheduled rows due at one second; relay...", flush=True)
    child = run_relay_child(namespace, args.relay_timeout)
    sent = OutboxMessage.objects.filter(status=OutboxStatus.SENT).count()
    if child["sent"] != args.burst_rows or sent != args.burst_rows:
        raise RuntimeError(
            f"burst: the relay sent {child['sent']} and the outbox shows {sent} of the "
            f"{args.burst_rows} rows sent"
        )
    declare_sink(exchange, queue)
    burst = Burst(args.burst_rows, child["drain_s"], child["batches"])
    print(
        f"  relay {burst.rate:,.0f} msg/s ({burst.batches} batches, {burst.drain_s:.2f}s); "
        f"{query_note(child)}",
        flush=True,
    )
    return burst


# --------------------------------------------------------------------------- report


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f} ms" if value < 10 else f"{value:,.0f} ms"


def report(
    args: argparse.Namespace,
    results: list[Measurement],
    failures: dict[str, str],
    memory: tuple[int, int] | None,
    burst: Burst | None = None,
) -> None:
    print()
    print(f"machine: {describe_machine()}")
    print(
        f"{args.messages:,} messages per state ({args.key_share:.0%} keyed), baselines in the "
        f"same run; sent rows {args.sent_rows:,}, extra rows {args.extra_rows:,} "
        f"(blocked over {args.blocked_keys:,} keys), scheduled rows {args.scheduled_rows:,}"
    )
    print()
    print(
        "| state | relay msg/s | raw pika msg/s | ratio to raw pipelined-confirm pika | one claim |"
    )
    print("|---|---|---|---|---|")
    by_state: dict[str, list[Measurement]] = {}
    for r in results:
        by_state.setdefault(r.state.name, []).append(r)
    for rounds in by_state.values():
        label = rounds[0].state.label(args.sent_rows, args.extra_rows, args.scheduled_rows)
        print(
            f"| {label} | {' / '.join(f'{r.relay_rate:,.0f}' for r in rounds)} | "
            f"{' / '.join(f'{r.raw_rate:,.0f}' for r in rounds)} | "
            f"{' / '.join(f'{r.ratio:.2f}' for r in rounds)} | "
            f"{' / '.join(fmt_ms(r.claim_ms()) for r in rounds)} |"
        )
    for name in failures:
        if name in STATES:
            label = STATES[name].label(args.sent_rows, args.extra_rows, args.scheduled_rows)
            print(f"| {label} | failed | | | |")
    print()
    for name, why in failures.items():
        print(f"{name} failed: {why}")
    for r in (rounds[0] for rounds in by_state.values()):
        print(
            f"built {r.state.name} in {r.build_s:.1f}s (with a first relay pass over it), then "
            f"VACUUM ANALYZE of the outbox (autovacuum's work, done by hand) in "
            f"{r.vacuum_s:.1f}s; claims: {r.claim_note}; {r.query_note}"
        )
    mean_ratio = {
        name: sum(r.ratio for r in rounds) / len(rounds) for name, rounds in by_state.items()
    }
    empty_ratio = mean_ratio.get("empty")
    if empty_ratio is not None:
        verdict = "meets" if empty_ratio >= GOAL_EMPTY_RATIO else "misses"
        others = [
            f"{name} {ratio / empty_ratio:.0%} of it "
            f"({'ok' if ratio >= (1 - GOAL_STATE_SPREAD) * empty_ratio else 'MISS'})"
            for name, ratio in mean_ratio.items()
            if name != "empty"
        ]
        line = (
            f"goal (mean ratio of the rounds): empty outbox {empty_ratio:.2f} {verdict} "
            f">= {GOAL_EMPTY_RATIO}"
        )
        if others:
            line += f"; {'; '.join(others)} (within {GOAL_STATE_SPREAD:.0%} of it wanted)"
        print(line)
    if burst is not None:
        line = (
            f"burst: {burst.rows:,} scheduled rows due at one second sent at "
            f"{burst.rate:,.0f} msg/s"
        )
        if empty_ratio is not None:
            empty_rate = sum(r.relay_rate for r in by_state["empty"]) / len(by_state["empty"])
            line += (
                f", {burst.rate / empty_rate:.2f} of the empty outbox's relay rate "
                f"({empty_rate:,.0f} msg/s; publish()ed rows, the same relay)"
            )
        print(line)
    if memory is not None:
        rss_10k, rss_end = memory
        if rss_10k:
            growth = rss_end / rss_10k - 1
            print(
                f"relay RSS (manage.py relay, empty outbox): {rss_10k / 1024:.1f} MiB after "
                f"10,000 sent, {rss_end / 1024:.1f} MiB after {args.memory_messages:,} "
                f"({growth:+.1%}; {'ok' if growth <= GOAL_RSS_GROWTH else 'MISS'}, "
                f"within {GOAL_RSS_GROWTH:.0%} wanted)"
            )
        else:
            print("relay RSS: n/a (the relay did not reach 10,000 sent rows)")
    print(
        json.dumps(
            {
                "sent_rows": args.sent_rows,
                "extra_rows": args.extra_rows,
                "blocked_keys": args.blocked_keys,
                "messages": args.messages,
                "key_share": args.key_share,
                "states": {
                    name: [
                        {
                            "relay_msgs_per_s": round(r.relay_rate),
                            "raw_pika_msgs_per_s": round(r.raw_rate),
                            "ratio": round(r.ratio, 3),
                            "claim_ms_median": None
                            if r.claim_ms() is None
                            else round(r.claim_ms() or 0.0, 2),
                            "build_s": round(r.build_s, 1),
                            "vacuum_s": round(r.vacuum_s, 1),
                        }
                        for r in rounds
                    ]
                    for name, rounds in by_state.items()
                },
                "failed": failures,
                "burst_msgs_per_s": round(burst.rate) if burst else None,
                "relay_rss_kib_after_10k": memory[0] if memory else None,
                "relay_rss_kib_at_end": memory[1] if memory else None,
            }
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--states", default=",".join(STATES), help="comma-separated, in order")
    parser.add_argument("--sent-rows", type=int, default=1_000_000)
    parser.add_argument("--extra-rows", type=int, default=200_000)
    parser.add_argument("--blocked-keys", type=int, default=2000)
    parser.add_argument("--scheduled-rows", type=int, default=1_000_000)
    parser.add_argument(
        "--burst-rows", type=int, default=100_000, help="scheduled rows due at once; 0: skip"
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument(
        "--key-share", type=float, default=0.0, help="share of measured rows with an ordering key"
    )
    parser.add_argument("--fresh-keys", type=int, default=1000, help="keys of the keyed share")
    parser.add_argument("--memory-messages", type=int, default=100_000, help="0: skip")
    parser.add_argument(
        "--relay-timeout",
        type=float,
        default=600.0,
        help="seconds a relay run may take before it counts as stuck (the state fails)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="measurements of each state (for the spread)"
    )
    parser.add_argument("--keep-db", action="store_true", help="leave the bench database")
    parser.add_argument("--relay-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay_child:
        return args
    names = [s.strip() for s in args.states.split(",") if s.strip()]
    unknown = [n for n in names if n not in STATES]
    if unknown or not names:
        parser.error(f"unknown state(s) {unknown}; choose from {', '.join(STATES)}")
    args.state_list = [STATES[n] for n in names]
    if not 0 <= args.key_share <= 1:
        parser.error("--key-share is a share between 0 and 1")
    if (
        args.blocked_keys < 1
        or min(args.extra_rows, args.sent_rows, args.scheduled_rows, args.burst_rows) < 0
    ):
        parser.error("--blocked-keys must be at least 1, row counts not negative")
    if args.messages < 1:
        parser.error("--messages must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.relay_child:
        relay_child()
        return
    recreate_database(BENCH_DB)
    namespace = setup_django()
    exchange = f"rmtest.{namespace}"
    queue = f"{namespace}.sink"
    from relay import declare_sink, drop_sink, relay_memory

    declare_sink(exchange, queue)
    results: list[Measurement] = []
    failures: dict[str, str] = {}
    memory = None
    burst = None
    try:
        if args.memory_messages:
            print(f"relay memory over {args.memory_messages:,} messages...", flush=True)
            memory = relay_memory(namespace, exchange, queue, args.memory_messages)
        builder = OutboxBuilder(args, exchange)
        for state in args.state_list:
            print(f"{state.name}: building...", flush=True)
            try:
                build_s, how = builder.build(state)
                print(f"  built in {build_s:.1f}s ({how})", flush=True)
                # Autovacuum's work after the bulk load (without statistics the relay's first
                # pass plans for an empty table), and again after that pass's updates.
                vacuum_s = vacuum_analyze()
                settle_s = settle(namespace, args.relay_timeout)
                vacuum_s += vacuum_analyze()
                print(
                    f"  VACUUM ANALYZE of the outbox, as autovacuum would, before and after: "
                    f"{vacuum_s:.1f}s",
                    flush=True,
                )
                build_s += settle_s
                for _ in range(args.rounds):  # the spread, without building the state again
                    results.append(
                        measure(state, build_s, vacuum_s, args, namespace, exchange, queue)
                    )
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # A relay that fails or hangs in one state says nothing of the others.
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                print(f"  {state.name} FAILED: {exc}", flush=True)
                failures[state.name] = why
        if args.burst_rows:
            try:
                burst = measure_burst(args, namespace, exchange, queue)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"  burst FAILED: {exc}", flush=True)
                failures["burst"] = str(exc).strip().splitlines()[0]
    finally:
        drop_sink(exchange, queue)
        from django.db import connections

        connections.close_all()
        if not args.keep_db:
            drop_database(BENCH_DB)
    report(args, results, failures, memory, burst)


if __name__ == "__main__":
    main()
