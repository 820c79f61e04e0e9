"""The admin after an incident (issues 19 and 35): each page an operator opens, timed with a
million dead letters, a million outbox rows and a million inbox rows, beside the figures
measured before the pages were reworked.

    .venv/bin/python bench/admin.py [--rows 1000000] [--repeat 5] [--keep-db]

The dead letters are written with ``INSERT ... SELECT ... FROM generate_series`` into the
migrated table (indexes and the failure groups' triggers in place, as in production), shaped
as a downstream outage leaves them: 5 consumers, 40 failure groups (8 exception types in each
consumer), 1 KB tracebacks, a JSON payload naming a customer, random message ids, the failures
spread over 20 minutes. Then ``VACUUM ANALYZE`` (this machine's PostgreSQL runs without
autovacuum). The database is ``$RM_BENCH_DB`` (default ``rm_bench_admin``), created afresh and
dropped at the end unless ``--keep-db``.

The outbox rows are sent ones spread over the same 20 minutes (the day partitions of the sent
side) and ``UNSENT`` pending or failed ones (the unsent partition), a third with an idempotency
key; the inbox rows are 5 consumers' over the same minutes (its day partitions).

Each page is fetched through Django's test client as a logged-in superuser: once to warm up,
then ``--repeat`` times; the table shows the median. The baseline measured in the same run is a
bare primary-key lookup of one dead letter through the ORM: each page's ratio to it says how
many such lookups the page costs, whatever the machine.

The replay of a whole failure group is measured by ``bench/admin_replay.py``'s
``time_group_replay`` on the loaded database: 25,000 more dead letters of one group, replayed
from the admin with a real relay running until every replay is sent, beside the same relay's
rate on as many plain outbox rows (its baseline, same run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RM_BENCH_DB", "rm_bench_admin")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BENCH_DB,
    describe_machine,
    drop_database,
    median,
    recreate_database,
    setup_django,
)

CONSUMERS = 5
EXCEPTION_TYPES = 8  # per consumer: 5 x 8 = 40 failure groups
CUSTOMERS = 50_000
LOAD_CHUNK = 200_000  # rows per INSERT statement (one transaction each)
TRACEBACK_SQL = "repeat('  File \"/srv/app/billing/charge.py\", line 42, in charge\\n', 19)"


@dataclass(frozen=True)
class Row:
    """One line of the table: what the operator does, the issue's figures, what was measured."""

    what: str
    today: str  # before this work, at 1 M rows (the table)
    goal: str
    seconds: float | None = None
    note: str = ""


def execute(sql: str, params: list[Any] | None = None) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def load(rows: int) -> None:
    """``rows`` dead letters, ``LOAD_CHUNK`` per statement."""
    from reliable_messaging.models import DeadLetter

    table = DeadLetter._meta.db_table
    started = time.monotonic()
    for first in range(1, rows + 1, LOAD_CHUNK):
        last = min(rows, first + LOAD_CHUNK - 1)
        execute(
            f"""
            INSERT INTO {table} (
                message_id, consumer, queue, exchange, routing_key, ordering_key, headers,
                payload, body, content_type, reason, exception_type, exception_message,
                traceback, attempts, first_failed_at, last_failed_at, status, replay_count,
                fingerprint, history, created_at, updated_at)
            SELECT md5('m' || i)::uuid::text,
                   'bench.consumer-' || (i %% {CONSUMERS}),
                   'bench.queue-' || (i %% {CONSUMERS}),
                   'bench', 'order.placed', NULL, '{{}}'::jsonb,
                   jsonb_build_object('order_id', i, 'customer', 'cust-' || (i %% {CUSTOMERS}),
                                      'amount', '9.99'),
                   convert_to(jsonb_build_object('order_id', i)::text, 'UTF8'),
                   'application/json', 'retries_exhausted',
                   'billing.errors.Downstream' || (i / {CONSUMERS} %% {EXCEPTION_TYPES}),
                   'payment gateway answered 503 for order ' || i,
                   'Traceback (most recent call last):\\n' || {TRACEBACK_SQL},
                   6, at - interval '2 minutes', at, 'dead', 0,
                   left(md5('fp' || (i / {CONSUMERS} %% {EXCEPTION_TYPES})), 16),
                   '[]'::jsonb, at, at
            FROM (SELECT i, now() - interval '20 minutes' + i * (interval '20 minutes' / %s)
                  AS at FROM generate_series(%s, %s) AS i) AS g
            """,
            [rows, first, last],
        )
        print(f"  {last:,} dead letters ({time.monotonic() - started:.0f} s)", flush=True)
    execute(f"VACUUM ANALYZE {table}")


UNSENT = 10_000  # pending and failed outbox rows: the relay's working set


def load_outbox_and_inbox(rows: int) -> None:
    """``rows`` outbox rows and ``rows`` inbox rows, ``LOAD_CHUNK`` per statement."""
    from reliable_messaging.models import OutboxMessage, ProcessedMessage

    outbox, inbox = OutboxMessage._meta.db_table, ProcessedMessage._meta.db_table
    started = time.monotonic()
    for first in range(1, rows + 1, LOAD_CHUNK):
        last = min(rows, first + LOAD_CHUNK - 1)
        moments = (
            "FROM (SELECT i, now() - interval '20 minutes' + i * (interval '20 minutes' / %s) "
            "AS at FROM generate_series(%s, %s) AS i) AS g"
        )
        execute(
            f"""
            INSERT INTO {outbox} (message_id, exchange, routing_key, body, headers,
                idempotency_key, status, attempts, last_error, next_attempt_at, created_at,
                sent_at)
            SELECT md5('o' || i)::uuid::text, 'bench', 'order.placed.' || (i %% 50),
                   jsonb_build_object('order_id', i)::text, '{{}}'::jsonb,
                   CASE WHEN i %% 3 = 0 THEN 'idem-' || i END,
                   CASE WHEN i > {rows - UNSENT} THEN
                        (CASE WHEN i %% 2 = 0 THEN 'failed' ELSE 'pending' END)
                        ELSE 'sent' END,
                   1, CASE WHEN i > {rows - UNSENT} AND i %% 2 = 0 THEN 'NOT_FOUND' ELSE '' END,
                   at, at, CASE WHEN i <= {rows - UNSENT} THEN at END
            {moments}
            """,
            [rows, first, last],
        )
        execute(
            f"""
            INSERT INTO {inbox} (consumer, message_id, processed_at)
            SELECT 'bench.consumer-' || (i %% {CONSUMERS}), md5('i' || i)::uuid::text, at
            {moments}
            """,
            [rows, first, last],
        )
        print(f"  {last:,} outbox and inbox rows ({time.monotonic() - started:.0f} s)", flush=True)
    execute(f"VACUUM ANALYZE {outbox}")
    execute(f"VACUUM ANALYZE {inbox}")


def timed(call: Callable[[], Any], repeat: int) -> float:
    call()  # warm: the first request pays for imports and caches
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times)


def page(client: Any, url: str, **query: str) -> Callable[[], Any]:
    def fetch() -> Any:
        response = client.get(url, query)
        if response.status_code != 200:
            raise RuntimeError(f"{url} {query}: HTTP {response.status_code}")
        return response

    return fetch


def group_replay_row() -> Row:
    """The replay of one failure group from the admin, end to end (``bench/admin_replay.py``)."""
    from admin_replay import time_group_replay

    found = time_group_replay(group_size=25_000, others=0)
    ratio = found["replay_rate"] / found["plain_relay_rate"]
    return Row(
        "replay one failure group (25,000)",
        "446 /s, 20.7 s",
        ">= 5,000 /s, no request over 10 s",
        note=(
            f"{found['replay_rate']:,.0f} /s, longest request {found['longest_request_s']:.2f} s "
            f"({ratio:.2f} x the same relay on plain rows, {found['plain_relay_rate']:,.0f} /s)"
        ),
    )


def measure(rows: int, repeat: int) -> tuple[list[Row], float]:
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    from reliable_messaging.models import DeadLetter

    user = User.objects.create_superuser("bench", "bench@example.com", None)
    client = Client()
    client.force_login(user)
    changelist = reverse("admin:reliable_messaging_deadletter_changelist")
    groups = reverse("admin:reliable_messaging_deadletter_groups")
    middle = DeadLetter.objects.only("pk", "message_id").get(message_id=_message_id(rows // 2))
    detail = reverse("admin:reliable_messaging_deadletter_change", args=[middle.pk])
    large = DeadLetter.objects.create(
        message_id="bench-large",
        consumer="bench.consumer-0",
        queue="bench.queue-0",
        reason="invalid_json",
        body=b'{"rows": [' + b'"' + b"x" * (8 * 1024 * 1024) + b'"]}',
    )
    large_detail = reverse("admin:reliable_messaging_deadletter_change", args=[large.pk])

    baseline = timed(lambda: DeadLetter.objects.filter(pk=middle.pk).first(), repeat * 4)
    pages = [
        Row(
            "open the dead-letter list",
            "2.5 s",
            "<= 0.3 s",
            timed(page(client, changelist), repeat),
        ),
        Row(
            "filter by consumer",
            "2.7 s",
            "<= 0.3 s",
            timed(page(client, changelist, consumer="bench.consumer-3"), repeat),
        ),
        Row(
            "search an exact message_id",
            "6.0 s",
            "<= 0.05 s",
            timed(page(client, changelist, q=middle.message_id), repeat),
        ),
        Row(
            "search words of the exception or payload",
            "5.1 s",
            "<= 1 s",
            timed(page(client, changelist, q="cust-4242"), repeat),
        ),
        Row(
            "search two characters (refused)",
            "3 s at 200 k",
            "<= 0.3 s",
            timed(page(client, changelist, q="ab"), repeat),
        ),
        Row("failure groups page", "1.3 s", "<= 0.3 s", timed(page(client, groups), repeat)),
        Row("detail page", "0.05 s", "stays", timed(page(client, detail), repeat)),
        Row(
            "detail page of an 8 MiB body",
            "16 MB page",
            "<= 0.3 s",
            timed(page(client, large_detail), repeat),
        ),
        *outbox_and_inbox_rows(client, rows, repeat),
    ]
    return [*pages, group_replay_row()], baseline


def outbox_and_inbox_rows(client: Any, rows: int, repeat: int) -> list[Row]:
    from django.urls import reverse

    outbox = reverse("admin:reliable_messaging_outboxmessage_changelist")
    inbox = reverse("admin:reliable_messaging_processedmessage_changelist")
    sent_id = _md5_uuid("o", rows // 2)
    unsent_id = _md5_uuid("o", rows - 1)
    key = f"idem-{(rows // 2) // 3 * 3}"
    processed = _md5_uuid("i", rows // 2)
    consumer = f"bench.consumer-{(rows // 2) % CONSUMERS}"
    return [
        Row(
            "open the outbox list",
            "3.8 s at 500 k",
            "<= 0.3 s",
            timed(page(client, outbox), repeat),
        ),
        Row(
            "outbox: failed rows",
            "-",
            "<= 0.3 s",
            timed(page(client, outbox, status__exact="failed"), repeat),
        ),
        Row(
            "outbox: search a sent message_id",
            "-",
            "<= 0.3 s",
            timed(page(client, outbox, q=sent_id), repeat),
        ),
        Row(
            "outbox: search an unsent message_id",
            "-",
            "<= 0.3 s",
            timed(page(client, outbox, q=unsent_id), repeat),
        ),
        Row(
            "outbox: search an idempotency key",
            "-",
            "<= 0.3 s",
            timed(page(client, outbox, q=key), repeat),
        ),
        Row("open the inbox list", "-", "<= 0.3 s", timed(page(client, inbox), repeat)),
        Row(
            "inbox: filter by consumer",
            "-",
            "<= 0.3 s",
            timed(page(client, inbox, consumer=consumer), repeat),
        ),
        Row(
            "inbox: search “ID CONSUMER”",
            "2.7 s",
            "<= 0.3 s",
            timed(page(client, inbox, q=f"{processed} {consumer}"), repeat),
        ),
    ]


def _md5_uuid(prefix: str, i: int) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT md5(%s || %s)::uuid::text", [prefix, i])
        return str(cursor.fetchone()[0])


def _message_id(i: int) -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT md5('m' || %s)::uuid::text", [i])
        return str(cursor.fetchone()[0])


WIDTHS = (15, 10, 10, 11)  # of the columns after the first


def show(rows: list[Row], baseline: float, count: int) -> None:
    print()
    print(f"The admin, {count:,} dead letters, outbox and inbox rows; {describe_machine()}")
    print(f"baseline (one dead letter by primary key, same run): {baseline * 1000:.2f} ms")
    header = ("what the operator does", "before, 1 M", "now", "x baseline", "goal")
    first, *others = header
    print(f"| {first:<42} | " + " | ".join(f"{t:>{w}}" for t, w in zip(others, WIDTHS)) + " |")
    print(f"|{'-' * 44}|{'-' * 16}:|{'-' * 11}:|{'-' * 11}:|{'-' * 13}|")
    for row in rows:
        if row.seconds is None:
            now, ratio = row.note, ""
        else:
            now, ratio = f"{row.seconds:.3f} s", f"{row.seconds / baseline:,.0f}"
        print(f"| {row.what:<42} | {row.today:>15} | {now:>10} | {ratio:>10} | {row.goal:>11} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()

    recreate_database(BENCH_DB)
    try:
        setup_django()
        print(f"loading {args.rows:,} dead letters into {BENCH_DB}", flush=True)
        load(args.rows)
        load_outbox_and_inbox(args.rows)
        rows, baseline = measure(args.rows, args.repeat)
        show(rows, baseline, args.rows)
    finally:
        if not args.keep_db:
            from django.db import connections

            connections.close_all()
            drop_database(BENCH_DB)


if __name__ == "__main__":
    main()
