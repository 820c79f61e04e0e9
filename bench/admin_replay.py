"""A failure group of 25,000 dead letters replayed from the admin, end to end.

What an operator does after an outage: open the group's confirmation page, press "replay",
and wait until every replay is on its way. Measured here with a real ``manage.py relay`` in a
subprocess (which carries the operation out and sends the outbox rows) and the admin's own
views through Django's test client, logged in as a superuser:

- the longest admin request (the confirmation page's GET, the POST that records the
  operation, the progress page and its JSON);
- letters per second from the POST until the last replay's outbox row is *sent* (confirmed by
  the broker), not merely written.

Baseline, measured in the same run: the same relay sending as many plain outbox rows (written
with one INSERT, with the headers a replay carries), so the ratio says what the replay costs on
top of the relay's own speed; a replay cannot go faster than that. Beside it, the figures of
the request-loop replay this replaced (issue 19: 446 letters/s at 1 M rows, one request of
20.7 s), whose code no longer exists to be measured again.

Run alone: ``python bench/admin_replay.py [--group-size N] [--others N]`` (a database of its
own, ``rm_bench_replay``, created afresh). ``bench/admin.py`` imports :func:`time_group_replay`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (
    describe_machine,
    recreate_database,
    setup_django_on,
    subprocess_env,
)

BENCH_DB = "rm_bench_replay"
GROUP_FINGERPRINT = "benchgroup000001"
# The request-loop replay before operations (issue 19's table, at 1 M dead letters).
BEFORE_RATE = 446.0
BEFORE_LONGEST_REQUEST = 20.7


def fill(group_size: int, others: int, queue: str) -> None:
    """``group_size`` dead letters of one failure group among ``others`` of other groups,
    written by the database itself."""
    from django.db import connection

    sql = """
        INSERT INTO reliable_messaging_deadletter
            (message_id, consumer, queue, exchange, routing_key, headers, payload, body,
             content_type, reason, exception_type, exception_message, traceback, attempts,
             first_failed_at, last_failed_at, status, replay_count, fingerprint, history,
             created_at, updated_at)
        SELECT %s || i, 'bench.consumer', %s, 'bench', 'order.placed', '{}'::jsonb,
               jsonb_build_object('i', i), convert_to('{"i": ' || i || '}', 'UTF8'),
               'application/json', 'permanent', 'builtins.KeyError', 'boom', '', 1,
               now(), now(), 'dead', 0, %s, '[]'::jsonb, now(), now()
        FROM generate_series(1, %s) AS i
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, ["other-", queue, "benchother000001", others])
        cursor.execute(sql, ["group-", queue, GROUP_FINGERPRINT, group_size])
        cursor.execute("ANALYZE reliable_messaging_deadletter")


def plain_rows(count: int, queue: str) -> None:
    from django.db import connection

    from reliable_messaging.publishing.listener import NOTIFY_CHANNEL

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO reliable_messaging_outboxmessage
                (message_id, exchange, routing_key, body, headers, status, attempts,
                 last_error, next_attempt_at, created_at)
            SELECT 'plain-' || i, '', %s, '{"i": ' || i || '}',
                   jsonb_build_object(
                       'x-rm-original-exchange', 'bench',
                       'x-rm-original-routing-key', 'order.placed',
                       'x-rm-replay', 1,
                       'x-rm-replayed-by', 'bench (admin)',
                       'x-rm-dead-letter-id', i
                   ),
                   'pending', 0, '', now(), now()
            FROM generate_series(1, %s) AS i
            """,
            [queue, count],
        )
        # Committed (autocommit): wake the relay as publish() and the operations' batches do.
        cursor.execute(f"NOTIFY {NOTIFY_CHANNEL}")


def wait_sent(prefix: str, count: int, timeout: float) -> float:
    """Seconds until ``count`` outbox rows whose message_id starts with ``prefix`` are sent."""
    from reliable_messaging.models import OutboxMessage

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sent = OutboxMessage.objects.filter(message_id__startswith=prefix, status="sent").count()
        if sent >= count:
            return time.monotonic()
        time.sleep(0.05)
    raise RuntimeError(f"only {sent} of {count} {prefix}* rows sent after {timeout}s")


def timed(client: Any, method: str, url: str, longest: list[tuple[float, str]], **kw: Any) -> Any:
    started = time.perf_counter()
    response = getattr(client, method)(url, **kw)
    longest.append((time.perf_counter() - started, f"{method.upper()} {url}"))
    return response


def time_group_replay(
    group_size: int = 25_000,
    *,
    others: int = 75_000,
    operation_batch_size: int = 1000,
    separate_runner: bool = False,
    fill_database: bool = True,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Replay a failure group of ``group_size`` from the admin with a relay running, on the
    database Django is set up with (filled unless ``fill_database`` is false: then a group
    of fingerprint ``GROUP_FINGERPRINT`` must be there); returns the figures."""
    import pika
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse
    from django.utils.http import urlencode

    from reliable_messaging.models import DeadLetterOperation, OutboxMessage
    from tests.support import ManageProcess

    queue = f"bench.replay.{uuid.uuid4().hex[:8]}"
    channel = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
    channel_ = channel.channel()
    channel_.queue_declare(queue, arguments={"x-queue-type": "classic"})
    if fill_database:
        fill(group_size, others, queue)
    User.objects.filter(username="bench").delete()
    User.objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(User.objects.get(username="bench"))

    class Relay(ManageProcess):
        command = "relay"

    import os
    import tempfile

    from django.db import connection

    conf = connection.settings_dict
    database_url = (
        f"postgres://{conf.get('USER') or 'postgres'}@{conf.get('HOST') or '127.0.0.1'}:"
        f"{conf.get('PORT') or 5432}/{conf['NAME']}"
    )
    log = Path(tempfile.mkstemp(prefix="rm-bench-relay-", suffix=".log")[1])
    env = subprocess_env(os.environ.get("RM_TEST_NAMESPACE", "bench"), DATABASE_URL=database_url)
    relay = Relay(
        [
            "--operation-batch-size",
            "0" if separate_runner else str(operation_batch_size),
            "--progress-interval",
            "0",
        ],
        env,
        log,
    )
    runner = None
    if separate_runner:
        # The operations in a process of their own, beside a relay that leaves them alone.
        runner = subprocess.Popen(
            [sys.executable, __file__, "--runner-child", str(operation_batch_size)], env=env
        )
    try:
        relay.wait_for_log("relay: publishing the outbox", timeout=60)
        # Baseline: the same relay sending as many plain rows.
        started = time.monotonic()
        plain_rows(group_size, queue)
        plain_s = wait_sent("plain-", group_size, timeout) - started

        requests: list[tuple[float, str]] = []
        query = urlencode({"fingerprint": GROUP_FINGERPRINT, "status__exact": "dead"})
        url = reverse("admin:reliable_messaging_deadletter_replay_matching") + "?" + query
        confirmation = timed(client, "get", url, requests)
        assert confirmation.status_code == 200, confirmation.status_code
        started = time.monotonic()
        recorded = timed(client, "post", url, requests)
        assert recorded.status_code == 302, recorded.status_code
        progress_url = recorded["Location"]
        operation = DeadLetterOperation.objects.order_by("-pk").first()
        assert operation is not None
        status_url = reverse(
            "admin:reliable_messaging_deadletter_operation_status", args=[operation.pk]
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            figures = timed(client, "get", status_url, requests).json()
            if figures["finished"]:
                break
            time.sleep(0.5)
        timed(client, "get", progress_url, requests)
        replayed_s = wait_sent("group-", group_size, timeout) - started
        operation.refresh_from_db()
        longest_s, longest_what = max(requests)
        return {
            "group_size": group_size,
            "dead_letters": group_size + others,
            "replayed": operation.replayed,
            "operation_state": operation.state,
            "replay_s": replayed_s,
            "replay_rate": group_size / replayed_s,
            "plain_relay_s": plain_s,
            "plain_relay_rate": group_size / plain_s,
            "longest_request_s": longest_s,
            "longest_request": longest_what,
            "outbox_rows_sent": OutboxMessage.objects.filter(status="sent").count(),
        }
    finally:
        relay.send(signal.SIGTERM)
        relay.wait(30)
        relay.close()
        if runner is not None:
            runner.terminate()
            runner.wait(30)
        channel_.queue_delete(queue)
        channel.close()


def report(result: dict[str, Any]) -> str:
    ratio = result["replay_rate"] / result["plain_relay_rate"]
    rows = [
        ("", "this run", "before (issue 19, 1 M rows)"),
        (
            f"replay of a {result['group_size']:,}-letter group, end to end (letters/s)",
            f"{result['replay_rate']:,.0f}",
            f"{BEFORE_RATE:,.0f}",
        ),
        (
            "longest admin request (s)",
            f"{result['longest_request_s']:.3f}",
            f"{BEFORE_LONGEST_REQUEST:.1f}",
        ),
        (
            "same relay, plain outbox rows (rows/s): baseline",
            f"{result['plain_relay_rate']:,.0f}",
            "",
        ),
        ("replay rate / plain relay rate", f"{ratio:.2f}", ""),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{a:<{width}}  {b:>10}  {c}" for a, b, c in rows]
    lines.append(
        f"({result['dead_letters']:,} dead letters in the table; {result['replayed']:,} replayed, "
        f"operation {result['operation_state']}; longest request: {result['longest_request']})"
    )
    return "\n".join(lines)


def runner_child(batch_size: int) -> None:
    """The operations runner alone in this process, until terminated."""
    import django

    django.setup()
    from reliable_messaging.dead_letters.operations import OperationRunner

    OperationRunner(batch_size=batch_size).start()
    signal.sigwait({signal.SIGTERM})


def main() -> None:
    if sys.argv[1:2] == ["--runner-child"]:
        runner_child(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group-size", type=int, default=25_000)
    parser.add_argument("--others", type=int, default=75_000)
    parser.add_argument("--operation-batch-size", type=int, default=1000)
    parser.add_argument(
        "--separate-runner",
        action="store_true",
        help="carry the operation out in a process started by the bench, the relay leaving "
        "operations alone (by default the relay's own operations process does it)",
    )
    args = parser.parse_args()
    setup_django_on(recreate_database(BENCH_DB), f"bench{uuid.uuid4().hex[:8]}")
    print(describe_machine())
    result = time_group_replay(
        args.group_size,
        others=args.others,
        operation_batch_size=args.operation_batch_size,
        separate_runner=args.separate_runner,
    )
    print(report(result))


if __name__ == "__main__":
    main()
