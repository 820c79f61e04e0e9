"""What tracing costs publish(), the relay and the consumer, off and on, against the build
before tracing, in one run.

    .venv/bin/python bench/tracing.py [--rows 15000] [--messages 5000] [--rounds 7]
        [--baseline 9e03e54 | --no-baseline] [--quick]

Each mode (MODES) runs in a warm worker process with its own database and exchange; "today"
runs ``--baseline`` from a throwaway git worktree. One worker works at a time, in an order
that rotates from round to round. Per round and mode: publish() rows/s (``--tx-rows`` a
transaction), the relay sending those rows (``relay --once``'s engine), the consumer
(ConsumerService, concurrency 2) over ``--messages`` messages; then ratios to "today", medians
and spread, and one more run of each off mode timing every call into the tracing hooks. Ends
with one JSON line. docs/benchmarks.md describes the modes.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    BROKER_URL,
    ROOT,
    database_url_for,
    describe_machine,
    drop_database,
    recreate_database,
)

DB_PREFIX = os.environ.get("RM_BENCH_DB", "rm_trace_bench")
BASELINE = "9e03e54"
# name -> (tree, tracing, traceparent). tree: "baseline" (the --baseline commit) or "current";
# tracing: None (no tracer provider), "blocked" (opentelemetry unimportable), "simple" or "batch"
# (an SDK provider exporting to memory through that span processor); traceparent: rows and
# messages carry one (in the traced modes publish() runs inside a span, which gives them one).
MODES: dict[str, tuple[str, str | None, bool]] = {
    "today": ("baseline", None, False),
    "not installed": ("current", "blocked", False),
    "off": ("current", None, False),
    "off, traceparent": ("current", None, True),
    "on, simple": ("current", "simple", True),
    "on, batch": ("current", "batch", True),
}
# The modes the 3 % bound is about.
BOUND_MODES = ("not installed", "off")
BOUND = 0.03
OFF_MODES = ("not installed", "off", "off, traceparent")
WORKLOADS = ("publish", "relay", "consume")
RESULT = "RESULT "


# --------------------------------------------------------------------------- the worker


class _NoOpenTelemetry(importlib.abc.MetaPathFinder):
    """Refuses ``opentelemetry`` and its submodules, as if the extra were not installed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "opentelemetry" or fullname.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class HookTimer:
    """Times every call into ``reliable_messaging.tracing`` (the outermost, per thread) and into
    ``metrics.delivery_times`` and ``metrics.batch_times`` (the histograms that came with
    tracing; the second when no tracer provider is set), by replacing the
    module's functions with timed wrappers; callers look them up on the module at each call.
    What the timer itself costs a call is measured too (``floor_us``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.local = threading.local()
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.originals: list[tuple[Any, str, Any]] = []
        self.floor_us = self._floor()

    def _wrap(self, group: str, original: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "inside", False):
                return original(*args, **kwargs)
            self.local.inside = True
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.local.inside = False
                with self.lock:
                    self.calls[group] += 1
                    self.seconds[group] += elapsed

        return timed

    def _floor(self, n: int = 100_000) -> float:
        """µs the wrapper measures around a function that does nothing."""
        timed = self._wrap("floor", lambda: None)
        for _ in range(n):
            timed()
        floor = self.seconds.pop("floor") / self.calls.pop("floor") * 1e6
        return round(floor, 3)

    def install(self) -> None:
        import inspect

        from reliable_messaging import metrics, tracing

        for name, function in vars(tracing).items():
            if inspect.isfunction(function) and function.__module__ == tracing.__name__:
                self.originals.append((tracing, name, function))
                setattr(tracing, name, self._wrap("tracing", function))
        for name in ("delivery_times", "batch_times"):
            self.originals.append((metrics, name, getattr(metrics, name)))
            setattr(metrics, name, self._wrap("metrics", getattr(metrics, name)))

    def uninstall(self) -> None:
        for module, name, function in self.originals:
            setattr(module, name, function)
        self.originals.clear()

    def take(self) -> dict[str, dict[str, int]]:
        with self.lock:
            taken = {
                group: {"calls": self.calls[group], "us": round(self.seconds[group] * 1e6)}
                for group in sorted(self.calls)
            }
            self.calls.clear()
            self.seconds.clear()
        return taken


class Worker:
    """One mode's process: set up on its tree and database, then runs the commands read from
    stdin, one JSON line each, and answers each with a ``RESULT`` line."""

    def __init__(self, mode: str, root: Path) -> None:
        self.mode = mode
        _tree, self.tracing, self.context = MODES[mode]
        if self.tracing == "blocked":
            sys.meta_path.insert(0, _NoOpenTelemetry())
        sys.path.insert(0, str(root))
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        import logging

        from django.db import connections

        # Every module of the package comes from this tree (the venv's editable install points
        # at another checkout, and would answer for modules this tree does not have).
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if name.split(".")[0] == "reliable_messaging" and file:
                assert Path(file).resolve().is_relative_to(root.resolve()), name
        logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
        connections["default"].settings_dict["CONN_MAX_AGE"] = 60
        self.exporter: Any = None
        self.provider: Any = None
        self._check_tracing(_tree)
        self.namespace = os.environ["RM_TEST_NAMESPACE"]
        self.sink = f"{self.namespace}.sink"
        self._declare()

    def _check_tracing(self, tree: str) -> None:
        if tree == "baseline":
            assert "reliable_messaging.tracing" not in sys.modules
            return
        from reliable_messaging import tracing

        if self.tracing == "blocked":
            assert tracing.INSTALLED is False, "opentelemetry importable"
            return
        assert tracing.INSTALLED is True
        if self.tracing is None:
            assert not tracing.active()
            return
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        processor = SimpleSpanProcessor if self.tracing == "simple" else BatchSpanProcessor
        self.provider.add_span_processor(processor(self.exporter))
        trace.set_tracer_provider(self.provider)
        assert tracing.active()

    def _declare(self) -> None:
        import pika

        from reliable_messaging.broker.topology import declare_topology
        from reliable_messaging.conf import messaging_settings
        from reliable_messaging.testing import find_consumer

        self.spec = find_consumer("tests.alpha")
        self.exchange = messaging_settings.exchange
        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        declare_topology(channel, [self.spec], messaging_settings)
        channel.queue_declare(self.sink, durable=True)
        channel.queue_bind(self.sink, self.exchange, "bench.#")
        connection.close()

    def _purge(self, queue: str) -> None:
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        connection.channel().queue_purge(queue)
        connection.close()

    def spans(self) -> int | None:
        """Spans exported since the last call (None when not tracing)."""
        if self.exporter is None:
            return None
        self.provider.force_flush()
        count = len(self.exporter.get_finished_spans())
        self.exporter.clear()
        return count

    def outbox(self, rows: int, tx_rows: int, hooks: HookTimer | None = None) -> dict[str, Any]:
        """``rows`` rows through publish() in transactions of ``tx_rows`` (inside a request
        span when tracing), then sent by the relay; seconds of each."""
        from django.db import connection, transaction

        from reliable_messaging import publish
        from reliable_messaging.models import OutboxMessage
        from reliable_messaging.publishing.lanes import run_lanes
        from reliable_messaging.publishing.relay import build_relay

        OutboxMessage.objects.all().delete()
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE reliable_messaging_outboxmessage")
        self._purge(self.sink)
        self.spans()
        tracer = None
        if self.exporter is not None:
            from opentelemetry import trace

            tracer = trace.get_tracer("bench")
        # Off with context: the caller's traceparent, stored as given (one for all rows).
        headers = {"traceparent": traceparent()} if self.context and not tracer else None
        started = time.perf_counter()
        for first in range(0, rows, tx_rows):
            request = tracer.start_as_current_span("bench request") if tracer else nullcontext()
            with request, transaction.atomic():
                for i in range(first, min(rows, first + tx_rows)):
                    publish(
                        "bench.order",
                        {"order_id": i, "amount": "19.99", "customer": f"c{i % 97}"},
                        headers=headers,
                    )
        publish_s = time.perf_counter() - started
        publish_spans = self.spans()
        publish_hooks = hooks.take() if hooks else None
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE reliable_messaging_outboxmessage")
        started = time.perf_counter()
        report = run_lanes([build_relay(once=True, listen=False)])
        relay_s = time.perf_counter() - started
        assert report.sent == rows, report.summary()
        relay_spans = self.spans()
        relay_hooks = hooks.take() if hooks else None
        self._purge(self.sink)
        return {
            "publish_s": publish_s,
            "relay_s": relay_s,
            "publish_spans": publish_spans,
            "relay_spans": relay_spans,
            "publish_hooks": publish_hooks,
            "relay_hooks": relay_hooks,
        }

    def consume(self, messages: int, hooks: HookTimer | None = None) -> dict[str, Any]:
        """``messages`` messages (with a traceparent each in the traced modes) through the
        consumer; seconds."""
        import pika
        from consume import run_service

        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        channel.confirm_delivery()
        body = json.dumps({"n": 1}).encode()
        for _ in range(messages):
            channel.basic_publish(
                self.exchange,
                "order.placed",
                body,
                pika.BasicProperties(
                    content_type="application/json",
                    delivery_mode=2,
                    message_id=str(uuid.uuid4()),
                    timestamp=int(time.time()),
                    headers={"traceparent": traceparent()} if self.context else None,
                ),
            )
        connection.close()
        self.spans()
        if hooks:
            hooks.take()
        seconds = run_service(self.spec, messages, self.mode, 2)
        return {
            "consume_s": seconds,
            "consume_spans": self.spans(),
            "consume_hooks": hooks.take() if hooks else None,
        }

    def clean_up(self) -> None:
        """Deletes this worker's queues and exchanges (the delay exchanges too)."""
        import pika

        def names(kind: str) -> list[str]:
            listing = subprocess.run(
                ["rabbitmqctl", "-q", f"list_{kind}", "name"], capture_output=True, text=True
            )
            return [name for name in listing.stdout.split() if self.namespace in name]

        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        channel = connection.channel()
        for name in names("queues"):
            channel.queue_delete(name)
        for name in names("exchanges"):
            channel.exchange_delete(name)
        connection.close()

    def serve(self, stdin: IO[str], stdout: IO[str]) -> None:
        stdout.write(RESULT + json.dumps({"ready": self.mode}) + "\n")
        stdout.flush()
        for line in stdin:
            command = json.loads(line)
            hooks = HookTimer() if command.get("hooks") else None
            if hooks:
                hooks.install()
            try:
                if command["op"] == "outbox":
                    answer = self.outbox(command["rows"], command["tx_rows"], hooks)
                elif command["op"] == "consume":
                    answer = self.consume(command["messages"], hooks)
                else:
                    self.clean_up()
                    answer = {"bye": True}
            finally:
                if hooks:
                    hooks.uninstall()
            if hooks:
                answer["timer_floor_us"] = hooks.floor_us
            stdout.write(RESULT + json.dumps(answer) + "\n")
            stdout.flush()
            if "bye" in answer:
                return


def worker_main(mode: str, root: str) -> None:
    Worker(mode, Path(root)).serve(sys.stdin, sys.stdout)


# --------------------------------------------------------------------------- the parent


class Child:
    """A worker process and its pipes."""

    def __init__(self, mode: str, root: Path, database: str) -> None:
        self.mode = mode
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("RM_TRACE_FILE", "PYTHONPATH", "OTEL_TRACES_EXPORTER")
        }
        env.update(
            RM_TEST_NAMESPACE=f"tb{uuid.uuid4().hex[:8]}",
            DATABASE_URL=database_url_for(database),
            DJANGO_SETTINGS_MODULE="tests.settings",
            RM_LOG_LEVEL="WARNING",
            PYTHONUNBUFFERED="1",
        )
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--root", str(root)],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(RESULT):
                result: dict[str, Any] = json.loads(line[len(RESULT) :])
                return result
        raise RuntimeError(f"worker {self.mode!r} ended (exit code {self.process.wait()})")

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.ask(op="quit")
                self.process.wait(60)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(60)


def add_worktree(ref: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="rm_trace_bench_base_"))
    path.rmdir()
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), ref],
        check=True,
    )
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False
    )
    shutil.rmtree(path, ignore_errors=True)


def verdict(values: list[float]) -> str:
    """Whether these per-round ratios show "within 3 % of the reference": every round."""
    if min(values) >= 1 - BOUND:
        return "holds (every round within the bound)"
    if max(values) < 1 - BOUND:
        return "does not hold (every round below the bound)"
    return f"not proven (rounds {min(values)} to {max(values)}: the spread is wider than the bound)"


def off_path_report(hooks: dict[str, dict[str, Any]], rows: int, messages: int) -> dict[str, Any]:
    """Prints and returns, per off mode and workload, the time spent in the tracing hooks
    (and in the new histograms) per row or message, and its share of the run's wall time."""
    if hooks:
        floor = next(iter(hooks.values()))["timer_floor_us"]
        print(
            "time inside the tracing hooks with tracing off (timed call by call in one more run; "
            f"the timer alone measures {floor} µs a call), per row or message and as a share "
            "of the run:"
        )
    report: dict[str, Any] = {}
    for mode, out in hooks.items():
        for workload, count in (("publish", rows), ("relay", rows), ("consume", messages)):
            wall_us = out[f"{workload}_s"] * 1e6
            parts = []
            for group, figures in (out[f"{workload}_hooks"] or {}).items():
                per = figures["us"] / count
                share = figures["us"] / wall_us
                report.setdefault(mode, {}).setdefault(workload, {})[group] = {
                    "calls_per_item": round(figures["calls"] / count, 2),
                    "us_per_item": round(per, 2),
                    "share_of_run": round(share, 4),
                }
                parts.append(
                    f"{group} {figures['calls'] / count:.2f} calls, {per:.2f} µs "
                    f"({share:.2%} of {wall_us / count:.0f} µs)"
                )
            print(f"  {mode:17} {workload:8} " + ("; ".join(parts) or "no calls"))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=15_000, help="outbox rows a run")
    parser.add_argument("--tx-rows", type=int, default=100, help="publish() calls a transaction")
    parser.add_argument("--messages", type=int, default=5_000, help="messages a consumer run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", default=BASELINE, help="the commit 'today' is measured on")
    parser.add_argument("--no-baseline", action="store_true", help="skip 'today'")
    parser.add_argument(
        "--mode",
        action="append",
        choices=list(MODES),
        help="measure only this mode (repeat for more); default: all",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.root)
        return
    if args.quick:
        args.rows, args.messages, args.rounds = 1_000, 400, 2

    modes = [m for m in MODES if m in args.mode] if args.mode else list(MODES)
    if args.no_baseline and "today" in modes:
        modes.remove("today")
    reference = "today" if "today" in modes else "off"
    assert reference in modes, "without 'today', 'off' is the reference"
    print(f"machine: {describe_machine()}; load average {os.getloadavg()[0]:.1f}")
    print(
        f"{args.rows:,} rows a run (publish() {args.tx_rows} a transaction, then the relay), "
        f"{args.messages:,} messages a consumer run (concurrency 2), {args.rounds} rounds; "
        f"today = {args.baseline if 'today' in modes else 'skipped'}; ratios to {reference!r}",
        flush=True,
    )
    started = time.monotonic()
    worktree = add_worktree(args.baseline) if "today" in modes else None
    databases = {mode: f"{DB_PREFIX}_{i}" for i, mode in enumerate(modes)}
    children: dict[str, Child] = {}
    try:
        for mode in modes:
            recreate_database(databases[mode])
            tree = worktree if MODES[mode][0] == "baseline" else ROOT
            assert tree is not None
            children[mode] = Child(mode, tree, databases[mode])
        for child in children.values():
            child.read()  # ready
        # A warm-up of each, not counted.
        for child in children.values():
            child.ask(op="outbox", rows=args.rows // 4, tx_rows=args.tx_rows)
            child.ask(op="consume", messages=args.messages // 4)
        print(f"set up and warmed up in {time.monotonic() - started:.0f} s", flush=True)
        rates: dict[str, dict[str, list[float]]] = {w: {m: [] for m in modes} for w in WORKLOADS}
        ratios: dict[str, dict[str, list[float]]] = {w: {m: [] for m in modes} for w in WORKLOADS}
        spans: dict[str, dict[str, int | None]] = {}
        for round_ in range(args.rounds):
            shift = round_ % len(modes)
            order = modes[shift:] + modes[:shift]
            for mode in order:
                out = children[mode].ask(op="outbox", rows=args.rows, tx_rows=args.tx_rows)
                rates["publish"][mode].append(args.rows / out["publish_s"])
                rates["relay"][mode].append(args.rows / out["relay_s"])
                spans.setdefault(mode, {}).update(
                    publish=out["publish_spans"], relay=out["relay_spans"]
                )
            for mode in order:
                out = children[mode].ask(op="consume", messages=args.messages)
                rates["consume"][mode].append(args.messages / out["consume_s"])
                spans[mode]["consume"] = out["consume_spans"]
            print(f"round {round_ + 1} (first: {order[0]})", flush=True)
            for workload in WORKLOADS:
                base = rates[workload][reference][-1]
                shown = []
                for mode in modes:
                    rate = rates[workload][mode][-1]
                    ratios[workload][mode].append(round(rate / base, 3))
                    shown.append(f"{mode} {rate:,.0f} ({ratios[workload][mode][-1]})")
                print(f"  {workload:8} /s: " + ", ".join(shown), flush=True)
        # The off path's own cost, timed call by call (one more run of each off mode).
        hooks: dict[str, dict[str, Any]] = {}
        for mode in (m for m in modes if m in OFF_MODES):
            out = children[mode].ask(op="outbox", rows=args.rows, tx_rows=args.tx_rows, hooks=True)
            out.update(children[mode].ask(op="consume", messages=args.messages, hooks=True))
            hooks[mode] = out
        for child in children.values():
            child.stop()
    finally:
        for child in children.values():
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait(60)
        for database in databases.values():
            drop_database(database)
        if worktree is not None:
            remove_worktree(worktree)

    print(f"spans exported in the last round: {spans}")
    print(f"medians over {args.rounds} rounds (ratio to {reference!r}: median, rounds min to max)")
    summary: dict[str, Any] = {}
    for workload in WORKLOADS:
        print(f"  {workload}:")
        for mode in modes:
            values = ratios[workload][mode]
            rate = statistics.median(rates[workload][mode])
            summary.setdefault(workload, {})[mode] = {
                "median_per_s": round(rate),
                "median_ratio": round(statistics.median(values), 3),
                "ratio_range": [min(values), max(values)],
                "ratios": values,
            }
            print(
                f"    {mode:17} {rate:9,.0f}/s  ratio {statistics.median(values):.3f} "
                f"({min(values)} to {max(values)})"
            )
    summary["off_path"] = off_path_report(hooks, args.rows, args.messages)
    if reference == "today":
        print(f"the {BOUND:.0%} bound (tracing off against today), relay and consumer:")
        for workload in ("relay", "consume"):
            for mode in BOUND_MODES:
                if mode in modes:
                    print(f"  {workload}, {mode}: {verdict(ratios[workload][mode])}")
    print(f"total {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")
    print(
        json.dumps(
            {
                "machine": describe_machine(),
                "rows": args.rows,
                "tx_rows": args.tx_rows,
                "messages": args.messages,
                "rounds": args.rounds,
                "baseline": args.baseline if "today" in modes else None,
                "reference": reference,
                "spans_last_round": spans,
                **summary,
            }
        )
    )


if __name__ == "__main__":
    main()
