"""The CPU budget per message of ``manage.py relay`` and ``manage.py consume``: the Python
process and its PostgreSQL backends, each split into its parts, in µs of CPU per message.

    RM_BENCH_DB=bench_whole .venv/bin/python bench/cpu_budget.py [--messages 20000]
        [--rounds 3] [--only relay|consume]

Each round runs the process twice over ``--messages`` messages, as bench/whole_process.py
does (the same set-up, the same window from the first to the last message at the broker or in
the database):

1. plain: the CPU per message of the process and of its PostgreSQL backends, from /proc
   (utime + stime at the first and at the last message);
2. charged: the same command run by this file's ``--charged`` wrapper, which wraps the functions
   of each part (PARTS) and charges the thread CPU (``time.thread_time``) spent inside them to
   the innermost part running on that thread, and reads the CPU of the connection's backend
   (``/proc/<pid>/schedstat``, ns) around each SQL statement and commit, charged to the part
   running then. The parent marks the window with SIGUSR1 (first message: start afresh) and
   SIGUSR2 (last message: take the figures).

A part's µs per message is its charge over the window's messages; "rest" is the charged run's
total less the parts (the I/O loop, threads handing work over, timers, the interpreter; for
PostgreSQL, the backends' work outside our statements and commits). The wrappers cost a few
µs per call, and the parts are called per batch or per message, so the charged run's total
stays near the plain one (both are printed). Rounds give the spread: the machine is shared,
and CPU time per message is far steadier than wall time on it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RM_BENCH_DB", "bench_whole")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Build

HERE = Path(__file__).resolve()

# A part: a name and the functions charged to it ("module:Class.attribute" or "module:func";
# a trailing "@cm" for a context-manager function, charged for its enter and its exit).
# Charges are exclusive: time spent in a part called inside another is the inner part's.
PARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "relay": {
        "claim (select due rows, park, lock)": (
            "reliable_messaging.publishing.claims:OutboxClaims.claim",
        ),
        "encoding (headers, properties, frames)": (
            "reliable_messaging.publishing.in_flight:InFlight.publish",
        ),
        "socket write": (
            "reliable_messaging.broker.publisher:ConfirmingPublisher.flush",
            "pika.adapters.utils.io_services_utils:_AsyncPlaintextTransport._on_socket_writable",
        ),
        "confirm handling (read, decode, settle)": (
            "pika.adapters.utils.io_services_utils:_AsyncPlaintextTransport._on_socket_readable",
        ),
        "marking sent (the move to the sent partition)": (
            "reliable_messaging.publishing.in_flight:InFlight._settle",
        ),
    },
    "consume": {
        "receive (socket read, frames, hand-off)": (
            "pika.adapters.utils.io_services_utils:_AsyncPlaintextTransport._on_socket_readable",
            "reliable_messaging.consuming.connection:ConnectionThread._on_message",
        ),
        "decode": ("reliable_messaging.consuming.processing:DeliveryProcessor.decode",),
        "inbox claim": ("reliable_messaging.consuming.processing:_claim",),
        "handler (its ORM insert, in its savepoint if any)": (
            "reliable_messaging.consuming.processing:_run",
        ),
        "commit": ("django.db.backends.base.base:BaseDatabaseWrapper.commit",),
        "stages (screens, handling, decided, open/close)": (
            "reliable_messaging.consuming.pipeline:BatchStages.screen",
            "reliable_messaging.consuming.pipeline:BatchStages.handling",
            "reliable_messaging.consuming.pipeline:BatchStages.decided",
            "reliable_messaging.consuming.pipeline:Pipeline.around@cm",
        ),
        "metrics and outcome log": (
            "reliable_messaging.consuming.outcome_metrics:OutcomeMetrics.open",
            "reliable_messaging.consuming.outcome_metrics:OutcomeMetrics.close",
            "reliable_messaging.consuming.outcome_log:OutcomeLog.close",
        ),
        "ack (hand back, coalesced acks)": (
            "reliable_messaging.consuming.settling:OutcomeSettler.hand_back",
            "reliable_messaging.consuming.settling:OutcomeSettler.settle_all",
        ),
    },
}
REST = "rest"


# --------------------------------------------------------------------------- the wrapper


def _schedstat_ns(pid: int) -> int:
    """CPU nanoseconds process ``pid`` has run (/proc/<pid>/schedstat), 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/schedstat") as stat:
            return int(stat.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class Charges:
    """Thread CPU (``time.thread_time``) charged to the innermost part running on each thread,
    and backend CPU around each statement and commit charged to the part running then."""

    def __init__(self) -> None:
        self.python: dict[str, float] = {}
        self.database: dict[str, float] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def _stack(self) -> list[list[Any]]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def current(self) -> str:
        stack = self._stack()
        return stack[-1][0] if stack else REST

    def enter(self, part: str) -> None:
        self._stack().append([part, time.thread_time(), 0.0])

    def exit(self) -> None:
        part, started, inner = self._stack().pop()
        spent = time.thread_time() - started
        with self.lock:
            self.python[part] = self.python.get(part, 0.0) + spent - inner
        stack = self._stack()
        if stack:
            stack[-1][2] += spent

    def wrap(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        charges = self

        @functools.wraps(function)
        def charged(*args: Any, **kwargs: Any) -> Any:
            charges.enter(part)
            try:
                return function(*args, **kwargs)
            finally:
                charges.exit()

        return charged

    def wrap_cm(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        charges = self

        @functools.wraps(function)
        @contextlib.contextmanager
        def charged(*args: Any, **kwargs: Any) -> Any:
            manager = function(*args, **kwargs)
            charges.enter(part)
            try:
                entered = manager.__enter__()
            finally:
                charges.exit()
            try:
                yield entered
            except BaseException as exc:  # noqa: BLE001 - the exit decides, as with-blocks do
                charges.enter(part)
                try:
                    if not manager.__exit__(type(exc), exc, exc.__traceback__):
                        raise
                finally:
                    charges.exit()
            else:
                charges.enter(part)
                try:
                    manager.__exit__(None, None, None)
                finally:
                    charges.exit()

        return charged

    def backend(self, pid: int, work: Callable[[], Any]) -> Any:
        before = _schedstat_ns(pid)
        try:
            return work()
        finally:
            spent = (_schedstat_ns(pid) - before) / 1e9
            part = self.current()
            with self.lock:
                self.database[part] = self.database.get(part, 0.0) + spent

    def install(self, parts: dict[str, tuple[str, ...]]) -> None:
        for part, targets in parts.items():
            for target in targets:
                module_name, _, path = target.partition(":")
                cm = path.endswith("@cm")
                *owners, attribute = path.removesuffix("@cm").split(".")
                owner: Any = importlib.import_module(module_name)
                for name in owners:
                    owner = getattr(owner, name)
                original = getattr(owner, attribute)
                wrap = self.wrap_cm if cm else self.wrap
                setattr(owner, attribute, wrap(part, original))
        self._install_backend_reads()

    def _install_backend_reads(self) -> None:
        from django.db.backends.base.base import BaseDatabaseWrapper
        from django.db.backends.signals import connection_created

        charges = self

        def on_created(sender: object, connection: Any, **kwargs: object) -> None:
            with connection.connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid = connection._rm_backend_pid = cursor.fetchone()[0]

            def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
                return charges.backend(pid, lambda: execute(sql, params, many, context))

            connection.execute_wrappers.append(wrapper)

        connection_created.connect(on_created, weak=False)
        commit = BaseDatabaseWrapper._commit  # type: ignore[attr-defined]

        def charged_commit(self: Any) -> Any:
            pid = getattr(self, "_rm_backend_pid", None)
            if pid is None:
                return commit(self)
            return charges.backend(pid, lambda: commit(self))

        BaseDatabaseWrapper._commit = charged_commit  # type: ignore[attr-defined]


def run_charged(out: str, kind: str, argv: list[str]) -> None:
    """Run ``argv`` (manage.py and its arguments) in this process with the parts of ``kind``
    charged; write the charges to ``out`` (JSON) when it ends."""
    import runpy
    import signal

    import django

    charges = Charges()
    window: dict[str, Any] = {}

    def on_first(signum: int, frame: object) -> None:  # the window opens: start afresh
        with charges.lock:
            charges.python.clear()
            charges.database.clear()

    def on_last(signum: int, frame: object) -> None:  # the window closes: what it cost
        with charges.lock:
            window.update(python=dict(charges.python), database=dict(charges.database))

    signal.signal(signal.SIGUSR1, on_first)
    signal.signal(signal.SIGUSR2, on_last)
    original_setup = django.setup

    def setup(*args: Any, **kwargs: Any) -> None:
        original_setup(*args, **kwargs)
        charges.install(PARTS[kind])

    django.setup = setup  # type: ignore[assignment]
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        pass
    finally:
        Path(out).write_text(json.dumps(window))


# --------------------------------------------------------------------------- the parent


@dataclass
class Budget:
    """One round: the plain run, and the charged run with its parts' µs per message."""

    plain: Any  # whole_process.Run
    charged: Any  # whole_process.Run
    python: dict[str, float]
    database: dict[str, float]


def budget(
    kind: str, namespace: str, exchange: str, queue: str, n: int, build: Build, parts: bool
) -> Budget:
    """A plain run of the process from the build's source tree and, with ``parts``, a charged
    one (without, the plain run stands in for it and the parts are empty)."""
    import whole_process

    run = {"relay": whole_process.relay_run, "consume": whole_process.consume_run}[kind]
    plain = run(namespace, exchange, queue, n, build=build)
    print(f"  {build.root}: {plain.line()}", flush=True)
    if not parts:
        return Budget(plain, plain, {}, {})
    out = Path(f"/tmp/{namespace}.{kind}.charges.json")
    wrapper = [sys.executable, str(HERE), "--charged", str(out), kind]
    charged = run(namespace, exchange, queue, n, wrapper, build=build)
    charges = json.loads(out.read_text())
    out.unlink()
    python = {
        part: charges["python"].get(part, 0.0) * 1e6 / charged.messages for part in PARTS[kind]
    }
    python[REST] = charged.process_us - sum(python.values())
    database = {
        part: charges["database"].get(part, 0.0) * 1e6 / charged.messages for part in PARTS[kind]
    }
    database[REST] = charged.database_us - sum(database.values())
    return Budget(plain, charged, python, database)


def show(kind: str, budgets: list[Budget]) -> dict[str, object]:
    """The parts' medians and spreads over the rounds."""

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):6.1f} ({min(values):.1f} to {max(values):.1f})"

    print(f"\n{kind}: CPU us per message, median (min to max) of {len(budgets)} rounds")
    print(f"  {'part':50} {'Python':>24} {'PostgreSQL':>24}")
    names = list(budgets[0].python)
    for name in names:  # none without parts
        print(
            f"  {name:50} {spread([b.python[name] for b in budgets]):>24} "
            f"{spread([b.database[name] for b in budgets]):>24}"
        )
    print(
        f"  {'total, charged run':50} {spread([b.charged.process_us for b in budgets]):>24} "
        f"{spread([b.charged.database_us for b in budgets]):>24}"
    )
    print(
        f"  {'total, plain run':50} {spread([b.plain.process_us for b in budgets]):>24} "
        f"{spread([b.plain.database_us for b in budgets]):>24}"
    )
    print(
        f"  msg/s: plain {', '.join(f'{b.plain.rate:,.0f}' for b in budgets)}; charged "
        f"{', '.join(f'{b.charged.rate:,.0f}' for b in budgets)}"
    )
    return {
        "plain_process_us": [round(b.plain.process_us, 1) for b in budgets],
        "plain_database_us": [round(b.plain.database_us, 1) for b in budgets],
        "plain_msgs_per_s": [round(b.plain.rate) for b in budgets],
        "charged_process_us": [round(b.charged.process_us, 1) for b in budgets],
        "charged_database_us": [round(b.charged.database_us, 1) for b in budgets],
        "python_us": {n: [round(b.python[n], 1) for b in budgets] for n in names},
        "database_parts_us": {n: [round(b.database[n], 1) for b in budgets] for n in names},
    }


def alternate_builds(
    builds: dict[str, Build], rounds: int, measure: Callable[[Build], Budget]
) -> dict[str, list[Budget]]:
    """``rounds`` rounds measuring each build, their order rotating from round to round."""
    names = list(builds)
    results: dict[str, list[Budget]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            results[name].append(measure(builds[name]))
    return results


def show_ratios(kind: str, rounds: dict[str, list[Budget]]) -> dict[str, list[float]]:
    """Each build's CPU per message (process + PostgreSQL) and rate over the first build's, round
    by round."""
    first, *others = rounds
    ratios: dict[str, list[float]] = {}
    for name in others:
        cpu = [
            round(
                (b.plain.process_us + b.plain.database_us)
                / (a.plain.process_us + a.plain.database_us),
                3,
            )
            for a, b in zip(rounds[first], rounds[name], strict=True)
        ]
        rate = [
            round(b.plain.rate / a.plain.rate, 3)
            for a, b in zip(rounds[first], rounds[name], strict=True)
        ]
        ratios[f"{name} / {first} CPU per message"] = cpu
        ratios[f"{name} / {first} msg/s"] = rate
        print(f"{kind}: {name} / {first}: CPU per message {cpu}, msg/s {rate}")
    return ratios


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--charged":
        run_charged(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("relay", "consume"))
    parser.add_argument(
        "--builds",
        help="compare source trees in the same run, NAME=PATH[@DATABASE],... (e.g. a `git "
        "archive` of the commit before a change, and this checkout): their rounds alternate, "
        "each round prints its CPU ratios to the first; a build with @DATABASE (bench_*, "
        "dropped and made again) runs on a database of its own, made by its own migrations",
    )
    parser.add_argument(
        "--no-parts", action="store_true", help="plain runs only (the totals, for --builds)"
    )
    args = parser.parse_args()
    from _common import parse_build_list, prepare_build_databases

    builds = parse_build_list(args.builds)

    import pika
    from _common import BROKER_URL, describe_machine, drop_sink, setup_django
    from whole_process import cleanup

    namespace = setup_django()
    prepare_build_databases(builds, namespace)
    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.testing import find_consumer

    exchange = messaging_settings.exchange
    sink = f"{namespace}.sink"
    alpha = find_consumer("tests.alpha")
    print(f"machine: {describe_machine()}; {args.messages:,} messages per run")
    result: dict[str, object] = {"machine": describe_machine(), "messages": args.messages}
    try:
        for kind, queue in (("relay", sink), ("consume", alpha.queue)):
            if args.only not in (None, kind):
                continue
            if kind == "consume":
                connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
                declare_topology(connection.channel(), [alpha])
                connection.close()

            def measure(build: Build, kind: str = kind, queue: str = queue) -> Budget:
                return budget(
                    kind, namespace, exchange, queue, args.messages, build, not args.no_parts
                )

            rounds = alternate_builds(builds, args.rounds, measure)
            result[kind] = {
                name: show(f"{kind}, {name}", budgets) for name, budgets in rounds.items()
            }
            if len(builds) > 1:
                result[kind]["ratios"] = show_ratios(kind, rounds)  # type: ignore[index]
    finally:
        drop_sink(None, sink)
        cleanup(namespace)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
