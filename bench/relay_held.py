"""``manage.py relay --once`` beside rows held back by their ordering key, against the same run
with none held: the time a run spends on rows it cannot send.

    RM_BENCH_DB=bench_held .venv/bin/python bench/relay_held.py [--held 200000] [--keys 1000]
        [--sendable 5000] [--rounds 2] [--due-held | --busy] [--builds NAME=PATH,NAME=PATH]

Each round fills an emptied outbox with ``--keys`` keys whose first row failed and backs off an
hour, and behind them ``--held`` rows of those keys parked, as ``publish()`` writes them behind
an unsent row of their key, by INSERT ... SELECT generate_series. With ``--due-held`` the held
rows are written due (pending, due now), as ``publish()`` writes none behind an unsent row of
their key: a claim must park them. With ``--busy`` each build's own ``publish()`` statement
writes them (run by the database in a loop) while their key's first row is still due and
unsent, and then that row fails: the rows published behind a busy key before it was held, as
that build writes them. Then ``--sendable`` rows without a key from ``publish()``. Two
``relay --once`` processes run one after the other, as the Celery ``relay_outbox`` task does
every few seconds (with rows written due, the first parks them, the second finds them
parked). The baseline
run has the sendable rows only. Each figure is the process's wall time from start to exit and
its CPU; "outside sending" is the held run's wall time less the baseline's, in the same round.
Rounds alternate the order.
``--builds`` runs each source tree's ``manage.py`` in turn in every round (e.g. a ``git
archive`` of the commit before a change, and this checkout).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RM_BENCH_DB", "bench_held")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Build,
    declare_sink,
    describe_machine,
    drop_sink,
    median,
    parse_builds,
    setup_django,
)
from whole_process import process_env


def insert_statement(root: Path, namespace: str) -> str:
    """The build's publish() INSERT of a row with an ordering key, its parameters ``$1`` to
    ``$7`` (message_id, exchange, routing_key, body, headers, the key for its column and for
    the look at the key's rows)."""
    code = (
        "import django; django.setup(); "
        "from reliable_messaging.publishing.publish import _INSERT_PG; "
        "print(_INSERT_PG[True, False])"
    )
    statement = subprocess.run(
        [sys.executable, "-c", code],
        env=process_env(namespace, Build(root)),
        cwd=root,  # python -c puts the working directory first on its path
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    numbers = itertools.count(1)
    return re.sub("%s", lambda _: f"${next(numbers)}", statement)


def fill(
    exchange: str, held: int, keys: int, sendable: int, due_held: bool, statement: str | None
) -> None:
    """The outbox as the module's docstring says (``statement``: the build's INSERT, for
    ``--busy``), vacuumed and analyzed."""
    from django.db import connection, transaction

    from reliable_messaging import publish
    from reliable_messaging.models import OutboxMessage

    table = OutboxMessage._meta.db_table
    columns = (
        "message_id, exchange, routing_key, body, headers, ordering_key, status, attempts, "
        "last_error, next_attempt_at, created_at"
    )
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table}")
        if held:
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT 'head-' || k, %s, 'bench.held', "
                "'{\"n\": 0}', '{}', 'key-' || k, 'failed', 1, 'refused', "
                "now() + interval '1 hour', now() FROM generate_series(1, %s) AS k",
                [exchange, keys],
            )
        if held and statement is not None:
            # The first rows unsent and due while the rest are published, then failed.
            cursor.execute(
                f"UPDATE {table} SET status = 'pending', attempts = 0, next_attempt_at = now()"
            )
            cursor.execute(
                "DO $$ BEGIN FOR g IN 1..%s LOOP EXECUTE %s USING 'held-' || g, %s, "
                "'bench.held', '{\"n\": ' || g || '}', '{}', 'key-' || (g %% %s + 1), "
                "'key-' || (g %% %s + 1); END LOOP; END $$",
                [held, statement, exchange, keys, keys],
            )
            cursor.execute(
                f"UPDATE {table} SET status = 'failed', attempts = 1, "
                "next_attempt_at = now() + interval '1 hour' WHERE message_id LIKE 'head-%%'"
            )
        elif held:
            cursor.execute(
                f"INSERT INTO {table} ({columns}) SELECT 'held-' || g, %s, 'bench.held', "
                "'{\"n\": ' || g || '}', '{}', 'key-' || (g %% %s + 1), 'pending', 0, '', "
                "CASE WHEN %s THEN statement_timestamp() END, statement_timestamp() "
                "FROM generate_series(1, %s) AS g",
                [exchange, keys, due_held, held],
            )
    for start in range(0, sendable, 1000):
        with transaction.atomic():
            for i in range(start, min(sendable, start + 1000)):
                publish("bench.order", {"order_id": i, "amount": "19.99"}, exchange=exchange)
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {table}")


def relay_once(namespace: str, root: Path) -> tuple[float, float]:
    """One ``manage.py relay --once`` of the source tree ``root``: its wall time, and its CPU
    (the process's; its backends' are not counted here, as they exit with it)."""
    env = process_env(namespace, Build(root))
    started = time.perf_counter()
    before = os.times()
    # It exits with 1 beside the held keys' failed first rows (and says so): expected here.
    subprocess.run(
        [sys.executable, str(root / "manage.py"), "relay", "--once"],
        env=env,
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return time.perf_counter() - started, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--held", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--sendable", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    written = parser.add_mutually_exclusive_group()
    written.add_argument(
        "--due-held", action="store_true", help="write the held rows due, for a claim to park"
    )
    written.add_argument(
        "--busy", action="store_true", help="each build's publish() writes the held rows"
    )
    parser.add_argument("--builds", help="NAME=PATH,NAME=PATH: source trees run in turn")
    args = parser.parse_args()
    builds = parse_builds(args.builds)
    namespace = setup_django()
    exchange, queue = f"{namespace}.ex", f"{namespace}.sink"
    declare_sink(exchange, queue)
    print(f"machine: {describe_machine()}; load average {os.getloadavg()}", flush=True)
    statements = {
        name: insert_statement(build, namespace) if args.busy else None
        for name, build in builds.items()
    }
    figures: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            names = list(builds) if round_ % 2 == 0 else list(reversed(builds))
            for name in names:
                got: dict[str, float] = {}
                for kind in ("held", "none") if round_ % 2 == 0 else ("none", "held"):
                    fill(
                        exchange,
                        args.held if kind == "held" else 0,
                        args.keys,
                        args.sendable,
                        args.due_held,
                        statements[name],
                    )
                    runs = ("first", "next") if kind == "held" else ("first",)
                    for run in runs:
                        wall, cpu = relay_once(namespace, builds[name])
                        figures.setdefault((name, f"{kind} {run}"), []).append(wall)
                        got[f"{kind} {run}"] = wall
                        print(
                            f"  round {round_ + 1} {name}, {kind} rows, {run} run: "
                            f"{wall:.2f} s, process CPU {cpu:.2f} s",
                            flush=True,
                        )
                outside = got["held first"] - got["none first"]
                figures.setdefault((name, "outside"), []).append(outside)
                print(
                    f"  round {round_ + 1} {name}: outside sending {outside:.2f} s "
                    f"(load average {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    finally:
        drop_sink(exchange, queue)
    print(
        f"relay --once beside {args.held:,} held rows ({args.keys:,} keys, "
        f"{'due' if args.due_held else 'by publish() when busy' if args.busy else 'parked'} "
        "as written) and "
        f"{args.sendable:,} sendable rows, medians:"
    )
    for name in builds:
        print(
            f"  {name}: {median(figures[name, 'held first']):.2f} s "
            f"(the next run {median(figures[name, 'held next']):.2f} s) against "
            f"{median(figures[name, 'none first']):.2f} s with none held; outside sending "
            f"{median(figures[name, 'outside']):.2f} s"
        )


if __name__ == "__main__":
    main()
