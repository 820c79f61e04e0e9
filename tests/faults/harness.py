"""The fault-injection harness: steady traffic through the whole pipeline, real processes, the
services broken and restored, and the exactly-once verdict.

A :class:`FaultRig` gives one test everything it needs, isolated from every other test:

- a RabbitMQ vhost of its own (named after the test's namespace), so closing "all connections"
  or deleting what is left touches nothing else on the broker;
- real ``manage.py consume`` processes (the testapp's ``tests.alpha`` and ``tests.beta``, both
  bound to ``order.*`` on ``rmtest.<ns>``) and a real ``manage.py relay``, each with its own
  PostgreSQL ``application_name`` so the test can see when *that* process is inside a
  transaction (a handler running, a relay batch waiting for its confirms);
- :class:`Traffic`: a background thread that commits ``publish()`` calls at a steady rate,
  some of them failing once for alpha (a retry through the outbox) and some refused for
  good by beta (an expected dead letter), and that rides out a database outage;
- :meth:`FaultRig.settle` and :meth:`FaultRig.verdict`: once everything committed has been
  handled, exactly one effect per (consumer, message_id) that was not dead-lettered, nothing
  missing, and no dead letter but the expected ones.

The testapp records an ``Effect`` row inside the handler's transaction; a failing attempt rolls
its row back with it. So one ``Effect`` row per (consumer, message_id) is the exactly-once proof,
and the outbox table, not what the test thinks it committed, says which messages exist (a commit
interrupted by a database restart may or may not have happened).

The service helpers (:func:`broker_stopped`, :func:`postgresql_stopped`, :func:`redis_stopped`,
:func:`memory_alarm`) are context managers that always restore the service on the way out, as
``scripts/ensure-services.sh`` would start it, even when the body fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from django.db import DatabaseError, connection, connections, transaction

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from tests import support
from tests.support import ROOT, ConsumeProcess, ManageProcess, RelayProcess, WaitTimeout, wait_until
from tests.testapp.models import Effect

LABELS = {"alpha": "tests.alpha", "beta": "tests.beta"}
ROUTING_KEY = "order.placed"
# pg_stat_activity keeps only the first 1 kB of a statement, so match the claim's beginning: the
# relay's ``SELECT ... FOR UPDATE SKIP LOCKED`` of the outbox rows it is about to publish, inside
# the statement that cuts them at the claim's byte budget.
RELAY_BATCH_SQL = (
    'SELECT pk, message_id, %AS bytes_before FROM (SELECT "reliable_messaging_outboxmessage"."id"%'
)
HANDLER_SQL = '%"testapp_effect"%'
P = TypeVar("P", bound=ManageProcess)


# --------------------------------------------------------------------------- payloads


def standard_payload(seq: int) -> dict[str, Any]:
    """The traffic's mix: one message in ten fails once for alpha (it succeeds on the retry
    that comes back after 0.2 s through the outbox), one in fifty is refused for good by beta (an
    expected dead letter; alpha takes it normally), the rest just succeed."""
    payload: dict[str, Any] = {"seq": seq}
    if seq % 10 == 3:
        payload["fail"] = {"alpha": 1}
    if seq % 50 == 7:
        payload["permanent"] = {"beta": 1}
    return payload


def with_slow_handlers(every: int = 4, seconds: float = 0.25) -> Callable[[int], dict[str, Any]]:
    """The standard mix, with one message in ``every`` keeping both handlers busy inside their
    transaction for ``seconds`` (so a fault can land while a handler runs or an ack is due)."""

    def payload(seq: int) -> dict[str, Any]:
        value = standard_payload(seq)
        if seq % every == 1:
            value["sleep"] = {"alpha": seconds, "beta": seconds}
        return value

    return payload


def expected_dead(payload: dict[str, Any]) -> set[str]:
    """Labels of the consumers that must dead-letter ``payload``."""
    return {label for label, flag in payload.get("permanent", {}).items() if flag}


# --------------------------------------------------------------------------- traffic


class Traffic:
    """Commits ``total`` ``publish()`` calls, one transaction each, at ``rate`` per second, from a
    background thread. With ``duplicate_every=n`` every n-th message is written to the outbox
    twice under one message_id (two deliveries of one message). A database error (an outage)
    is survived: the connection is dropped and the same message tried again with a new id."""

    def __init__(
        self,
        exchange: str,
        total: int,
        rate: float,
        payload: Callable[[int], dict[str, Any]] = standard_payload,
        duplicate_every: int = 0,
    ) -> None:
        self.exchange = exchange
        self.total = total
        self.rate = rate
        self.payload = payload
        self.duplicate_every = duplicate_every
        self.committed: list[str] = []
        self.payloads: dict[str, dict[str, Any]] = {}
        self.database_errors = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rm-fault-traffic", daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    @property
    def published(self) -> int:
        with self._lock:
            return len(self.committed)

    def _publish_one(self, seq: int) -> None:
        payload = self.payload(seq)
        with transaction.atomic():
            message_id = publish(ROUTING_KEY, payload, exchange=self.exchange)
            if self.duplicate_every and seq % self.duplicate_every == 0:
                publish(ROUTING_KEY, payload, exchange=self.exchange, message_id=message_id)
        with self._lock:
            self.committed.append(message_id)
            self.payloads[message_id] = payload

    def _run(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        seq = 0
        try:
            while seq < self.total and not self._stop.is_set():
                try:
                    self._publish_one(seq)
                except DatabaseError:
                    # PostgreSQL is down or restarting: nothing (or, if the commit itself was
                    # cut, perhaps the message) was written; the outbox table will tell.
                    self.database_errors += 1
                    connections.close_all()
                    self._stop.wait(0.2)
                    next_at = time.monotonic()
                    continue
                seq += 1
                next_at += interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc
        finally:
            connections.close_all()

    def wait_published(self, count: int, timeout: float = 60.0) -> None:
        wait_until(
            lambda: self.published >= count or not self._thread.is_alive(),
            timeout=timeout,
            message=lambda: f"{count} messages committed (now {self.published})",
        )
        if self.error is not None:
            raise AssertionError(f"the traffic thread failed: {self.error!r}") from self.error

    def join(self, timeout: float = 120.0) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join(10)
            raise WaitTimeout(
                f"traffic still publishing after {timeout}s ({self.published}/{self.total})"
            )
        if self.error is not None:
            raise AssertionError(f"the traffic thread failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True)
class Verdict:
    """The final state, consumer by consumer (labels ``alpha``/``beta``)."""

    messages: int
    lost: dict[str, list[str]]
    doubled: dict[str, dict[str, int]]
    unexpected_dead: list[tuple[str, str, str]]
    missing_dead: list[tuple[str, str]]
    foreign_effects: dict[str, list[str]]
    inbox_rows: dict[str, int]
    dead_letters: int

    @property
    def ok(self) -> bool:
        return not (
            any(self.lost.values())
            or any(self.doubled.values())
            or self.unexpected_dead
            or self.missing_dead
            or any(self.foreign_effects.values())
        )

    def summary(self) -> str:
        lost = {k: len(v) for k, v in self.lost.items()}
        doubled = {k: len(v) for k, v in self.doubled.items()}
        return (
            f"{self.messages} messages; lost {lost}; doubled {doubled}; dead letters "
            f"{self.dead_letters} (unexpected {self.unexpected_dead[:5]}, missing "
            f"{self.missing_dead[:5]}); effects of unknown ids "
            f"{ {k: v[:5] for k, v in self.foreign_effects.items()} }; inbox {self.inbox_rows}"
        )


@dataclass
class FaultRig:
    """One fault test's vhost, processes, traffic and verdict. Use as the ``rig`` fixture."""

    tmp_path: Path
    database_url: str
    ns: str = field(default_factory=support.new_namespace)
    processes: list[ManageProcess] = field(default_factory=list)
    _names: Counter[str] = field(default_factory=Counter)
    app_names: dict[int, str] = field(default_factory=dict)  # pid -> PostgreSQL application_name
    traffic: Traffic | None = None
    # Inside ``starting_together()``: the processes started, not waited for yet.
    _unawaited: list[ManageProcess] | None = None

    def __post_init__(self) -> None:
        self.vhost = self.ns
        self.exchange = f"rmtest.{self.ns}"
        self.queues = {label: f"{self.ns}.{label}" for label in LABELS}
        support.rabbitmqctl("add_vhost", self.vhost)
        support.rabbitmqctl("set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        self.broker_url = support.broker_url(self.vhost)

    # -- processes ---------------------------------------------------------------------------

    def env(self, app_name: str, **extra: str) -> dict[str, str]:
        env = {
            **os.environ,
            "RM_TEST_NAMESPACE": self.ns,
            "DATABASE_URL": f"{self.database_url}?application_name={app_name}",
            "RM_BROKER_URL": self.broker_url,
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "tests.settings",
        }
        env.pop("RM_TEST_CACHE_ALIAS", None)  # only the processes that ask for it
        env.update(extra)
        return env

    def _app_name(self, kind: str) -> str:
        self._names[kind] += 1
        return f"rmfault-{self.ns}-{kind}-{self._names[kind]}"

    def consumer(self, *args: str, **env: str) -> ConsumeProcess:
        """Start ``manage.py consume ARGS`` (both handlers unless ``--queue``) and wait until it
        consumes."""
        name = self._app_name("consume")
        proc = ConsumeProcess(list(args), self.env(name, **env), self.tmp_path / f"{name}.log")
        self.app_names[proc.pid] = name
        self.processes.append(proc)
        return self._await_started(proc)

    def relay(self, *args: str) -> RelayProcess:
        name = self._app_name("relay")
        proc = RelayProcess(list(args), self.env(name), self.tmp_path / f"{name}.log")
        self.app_names[proc.pid] = name
        self.processes.append(proc)
        return self._await_started(proc)

    def _await_started(self, proc: P) -> P:
        """Wait until ``proc`` consumes (or, a relay, publishes), unless inside
        :meth:`starting_together`, which waits for it on the way out."""
        if self._unawaited is not None:
            self._unawaited.append(proc)
        elif isinstance(proc, ConsumeProcess):
            proc.wait_consuming(60)
        elif isinstance(proc, RelayProcess):
            proc.wait_connected(60)
        return proc

    @contextlib.contextmanager
    def starting_together(self) -> Iterator[None]:
        """The processes started in the body start side by side, as a supervisor starts a
        deployment's; on the way out each one is waited for as :meth:`consumer` and
        :meth:`relay` would have waited for it alone (consuming, publishing the outbox)."""
        assert self._unawaited is None, "starting_together() does not nest"
        self._unawaited = []
        try:
            yield
            started, self._unawaited = self._unawaited, None
            for proc in started:
                self._await_started(proc)
        finally:
            self._unawaited = None

    def kill_9(self, proc: ManageProcess) -> None:
        proc.send(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL, proc.log()

    def in_transaction(self, proc: ManageProcess, query_like: str) -> bool:
        """Whether ``proc`` has a database session inside a transaction whose last statement
        matches ``query_like`` (a handler in its transaction, a relay batch awaiting confirms)."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                "AND xact_start IS NOT NULL AND query LIKE %s",
                [self.app_names[proc.pid], query_like],
            )
            return bool(cursor.fetchone()[0])

    def wait_in_transaction(self, proc: ManageProcess, query_like: str, timeout: float) -> None:
        def caught() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"{proc.command} exited with {proc.returncode}:\n{proc.log()}")
            return self.in_transaction(proc, query_like)

        wait_until(
            caught,
            timeout=timeout,
            interval=0.005,
            message=f"{proc.command} pid {proc.pid} inside a transaction ({query_like})",
        )

    def assert_still_running(self, *procs: ManageProcess) -> None:
        for proc in procs:
            assert proc.returncode is None, (
                f"{proc.command} pid {proc.pid} exited with {proc.returncode} instead of "
                f"recovering by itself:\n{proc.log()}"
            )

    # -- traffic and the verdict ---------------------------------------------------------------

    def start_traffic(self, total: int, rate: float, **kwargs: Any) -> Traffic:
        self.traffic = Traffic(self.exchange, total, rate, **kwargs).start()
        return self.traffic

    def outbox_ids(self) -> set[str]:
        return set(
            OutboxMessage.objects.filter(exchange=self.exchange).values_list(
                "message_id", flat=True
            )
        )

    def _progress(self) -> str:
        pending = OutboxMessage.objects.filter(exchange=self.exchange).exclude(
            status=OutboxStatus.SENT
        )
        done = {
            label: Effect.objects.filter(consumer=label).values("message_id").distinct().count()
            for label in LABELS
        }
        queues = support.all_queue_counts(self.vhost)
        busy = {q: c for q, c in queues.items() if c != (0, 0)}
        return (
            f"outbox rows {len(self.outbox_ids())}, unsent {pending.count()}; ids with an "
            f"effect {done}; dead letters {DeadLetter.objects.count()}; queues not drained "
            f"{busy}"
        )

    def settled(self) -> bool:
        """Everything committed was sent, handled (or dead-lettered) by both consumers, and no
        message is left in any queue of the vhost, ready or unacked."""
        return self.all_handled() and self.queues_settled()

    def queues_settled(self) -> bool:
        counts = support.all_queue_counts(self.vhost)
        return bool(counts) and all(c == (0, 0) for c in counts.values())

    def all_handled(self) -> bool:
        """Every row committed was sent, and handled (or dead-lettered) by both consumers."""
        if self.traffic is not None and self.traffic.published < self.traffic.total:
            return False
        if (
            OutboxMessage.objects.filter(exchange=self.exchange)
            .exclude(status=OutboxStatus.SENT)
            .exists()
        ):
            return False
        ids = self.outbox_ids()
        for label, name in LABELS.items():
            handled = set(
                Effect.objects.filter(consumer=label).values_list("message_id", flat=True)
            )
            handled |= set(
                DeadLetter.objects.filter(consumer=name).values_list("message_id", flat=True)
            )
            if not ids <= handled:
                return False
        return True

    def settle(self, timeout: float = 120.0) -> None:
        if self.traffic is not None:
            self.traffic.join(timeout)
        try:
            wait_until(self.settled, timeout=timeout, interval=0.5, message=self._progress)
        except WaitTimeout as exc:
            # Say which process is stuck, if one is.
            dead = [f"{p.command} pid {p.pid} rc={p.returncode}" for p in self.processes]
            raise WaitTimeout(f"{exc}\nprocesses: {dead}") from None

    def verdict(self) -> Verdict:
        ids = self.outbox_ids()
        payloads: dict[str, dict[str, Any]] = {}
        for message_id, body in OutboxMessage.objects.filter(exchange=self.exchange).values_list(
            "message_id", "body"
        ):
            payloads[message_id] = json.loads(body)
        dead = {
            (consumer, message_id): reason
            for consumer, message_id, reason in DeadLetter.objects.values_list(
                "consumer", "message_id", "reason"
            )
        }
        lost: dict[str, list[str]] = {}
        doubled: dict[str, dict[str, int]] = {}
        foreign: dict[str, list[str]] = {}
        missing_dead: list[tuple[str, str]] = []
        expected_dead_keys: set[tuple[str, str]] = set()
        inbox: dict[str, int] = {}
        for label, name in LABELS.items():
            counts = Counter(
                Effect.objects.filter(consumer=label).values_list("message_id", flat=True)
            )
            must_die = {m for m in ids if label in expected_dead(payloads[m])}
            expected_dead_keys |= {(name, m) for m in must_die}
            lost[label] = sorted(m for m in ids - must_die if counts[m] == 0)
            doubled[label] = {m: n for m, n in counts.items() if n > 1}
            # An effect of a message that must fail for good, or of an id nobody published.
            foreign[label] = sorted(
                m for m in counts if m not in ids or (m in must_die and counts[m])
            )
            missing_dead += [(name, m) for m in sorted(must_die) if (name, m) not in dead]
            inbox[label] = ProcessedMessage.objects.filter(consumer=name).count()
        unexpected = sorted(
            (consumer, message_id, reason)
            for (consumer, message_id), reason in dead.items()
            if (consumer, message_id) not in expected_dead_keys
        )
        return Verdict(
            messages=len(ids),
            lost=lost,
            doubled=doubled,
            unexpected_dead=unexpected,
            missing_dead=missing_dead,
            foreign_effects=foreign,
            inbox_rows=inbox,
            dead_letters=len(dead),
        )

    def assert_exactly_once(self, timeout: float = 120.0) -> Verdict:
        """Wait until everything is handled, then: no message lost, none doubled, the expected
        dead letters and no other; the retried messages really took a second attempt."""
        assert self.traffic is not None
        self.settle(timeout)
        verdict = self.verdict()
        assert verdict.ok, verdict.summary()
        committed = set(self.traffic.committed)
        ids = self.outbox_ids()
        assert committed <= ids, f"committed but not in the outbox: {sorted(committed - ids)[:5]}"
        assert len(ids) >= self.traffic.total
        # Each handler's inbox holds exactly the messages it took effect for.
        for label, name in LABELS.items():
            assert verdict.inbox_rows[label] == Effect.objects.filter(consumer=label).count(), name
        # The transient failures went through the outbox and succeeded on attempt 2.
        retried = [m for m, p in self.traffic.payloads.items() if p.get("fail")]
        assert retried
        attempts = set(
            Effect.objects.filter(consumer="alpha", message_id__in=retried).values_list(
                "attempt", flat=True
            )
        )
        assert attempts and min(attempts) >= 2, attempts
        for letter in DeadLetter.objects.all():
            assert letter.reason == "permanent", (letter.message_id, letter.reason)
        consumers = [p for p in self.processes if isinstance(p, ConsumeProcess)]
        print(  # shown with -rP: what the run went through
            f"verdict: {verdict.summary()}; committed {len(committed)}; traffic database "
            f"errors {self.traffic.database_errors}; duplicates absorbed "
            f"{log_count(consumers, 'outcome=duplicate')}; retries "
            f"{log_count(consumers, 'outcome=retry ')}; processes started {len(self.processes)}"
        )
        return verdict

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()
        for proc in self.processes:
            proc.close()
        # Best effort: the broker is back by now (every fault restores it in a finally).
        with contextlib.suppress(Exception):
            support.rabbitmqctl("delete_vhost", self.vhost, attempts=2)


def log_count(procs: Sequence[ManageProcess], text: str) -> int:
    return sum(p.log().count(text) for p in procs)


def wait_log_count(proc: ManageProcess, text: str, count: int, timeout: float = 60.0) -> None:
    """Wait until ``text`` appears ``count`` times in ``proc``'s log (e.g. once per reconnect)."""
    wait_until(
        lambda: proc.log().count(text) >= count,
        timeout=timeout,
        interval=0.1,
        message=lambda: f"{count} x {text!r} in the {proc.command} log:\n{proc.log()[-3000:]}",
    )


# --------------------------------------------------------------------------- RabbitMQ


def restore_broker() -> None:
    """Start the rabbit app again and wait until it has booted; if that fails, let the project's
    self-healing script try (it also resets the memory watermark and the plugins)."""
    try:
        support.rabbitmqctl("start_app", timeout=120, attempts=3)
        support.rabbitmqctl("await_startup", "--timeout", "120", timeout=150, attempts=2)
    except Exception:
        ensure_services()
        raise


@contextlib.contextmanager
def broker_stopped() -> Iterator[None]:
    """``rabbitmqctl stop_app`` for the body of the ``with``; started again on the way out."""
    try:
        support.rabbitmqctl("stop_app", timeout=120, attempts=2)
        yield
    finally:
        restore_broker()


def broker_status() -> dict[str, Any]:
    return dict(json.loads(support.rabbitmqctl("status", "--formatter", "json")))


def memory_alarm_on() -> bool:
    return "memory" in json.dumps(broker_status().get("alarms") or [])


def watermark_args(setting: dict[str, Any]) -> list[str]:
    """``set_vm_memory_high_watermark`` arguments that bring back ``setting`` (from status)."""
    if "relative" in setting:
        return [str(setting["relative"])]
    if "absolute" in setting:
        return ["absolute", str(setting["absolute"])]
    return ["0.4"]  # scripts/ensure-services.sh's value


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """A memory alarm (the watermark set far below what the node uses) for the body of the
    ``with``: every publishing connection is blocked. The previous watermark comes back on the
    way out, and the alarm is awaited to clear."""
    previous = watermark_args(broker_status().get("vm_memory_high_watermark_setting") or {})
    try:
        support.rabbitmqctl("set_vm_memory_high_watermark", "absolute", "1MB")
        wait_until(memory_alarm_on, timeout=30, interval=0.3, message="the memory alarm")
        yield
    finally:
        try:
            support.rabbitmqctl("set_vm_memory_high_watermark", *previous)
            wait_until(
                lambda: not memory_alarm_on(),
                timeout=60,
                interval=0.3,
                message="the memory alarm to clear",
            )
        except Exception:
            ensure_services()
            raise


def close_all_connections(vhost: str) -> None:
    support.rabbitmqctl("close_all_connections", "--vhost", vhost, "fault injection")


# --------------------------------------------------------------------------- PostgreSQL


@contextlib.contextmanager
def postgresql_stopped() -> Iterator[None]:
    """PostgreSQL stopped (fast shutdown: every session is cut) for the body of the ``with``."""
    connections.close_all()  # this thread's; they would break anyway
    try:
        support.pg_ctl("stop")
        yield
    finally:
        connections.close_all()
        support.ensure_postgresql_up()


# --------------------------------------------------------------------------- Redis

# The start command of scripts/ensure-services.sh.
REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


def redis_up() -> bool:
    result = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", "6379", "ping"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return result.stdout.strip() == "PONG"


def redis_keys(pattern: str) -> int:
    """How many keys match ``pattern`` (SCAN, so harmless on a busy server)."""
    result = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", "6379", "--scan", "--pattern", pattern],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return len(result.stdout.split())


def start_redis() -> None:
    if not redis_up():
        # close_fds (the default) matters: the daemon must not inherit the test run's lock.
        subprocess.run(REDIS_START, capture_output=True, timeout=30, check=False, close_fds=True)
    wait_until(redis_up, timeout=30, interval=0.2, message="Redis answering PING")


@contextlib.contextmanager
def redis_stopped() -> Iterator[None]:
    """Redis shut down for the body of the ``with``; started again on the way out."""
    try:
        subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", "6379", "shutdown", "nosave"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        wait_until(lambda: not redis_up(), timeout=30, interval=0.2, message="Redis down")
        yield
    finally:
        start_redis()


# --------------------------------------------------------------------------- last resort


def ensure_services() -> None:
    """The project's self-healing script: starts whatever is down, resets the watermark."""
    subprocess.run(
        [str(ROOT / "scripts" / "ensure-services.sh")],
        capture_output=True,
        timeout=600,
        check=False,
        close_fds=True,
    )
