"""Helpers shared by the suite: bounded waiting, the broker seen from outside, subprocesses.

Everything here talks to the real services on this machine. Every wait is bounded; every helper
that shells out has a timeout. Fixtures built on these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pika
import pika.exceptions

from tests import rabbitmq4

ROOT = Path(__file__).resolve().parent.parent
MANAGE = ROOT / "manage.py"


class WaitTimeout(AssertionError):
    """A bounded wait ran out; the message says what was awaited and the last value seen."""


# What a process started with --metrics-port logs once it listens.
OPS_LINE = re.compile(r"serving /metrics and /healthz on http://[^:]+:(\d+)")


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    message: str | Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            what = text or getattr(predicate, "__name__", repr(predicate))
            raise WaitTimeout(
                f"timed out after {timeout}s waiting for {what}; last value: {value!r}"
            )
        time.sleep(interval)


def no_suspect_left(context: str | Callable[[], str] = "") -> None:
    """Wait until the crash guard holds no suspect. It forgets one just after the outcome's own
    transaction commits, so a test that has seen the outcome may look a moment too early."""
    from reliable_messaging.models import SuspectDelivery

    def left() -> str:
        extra = context() if callable(context) else context
        return f"no suspect left: {list(SuspectDelivery.objects.values())}\n{extra}"

    wait_until(lambda: not SuspectDelivery.objects.exists(), timeout=10, message=left)


def new_namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- RabbitMQ


@dataclass(frozen=True)
class BrokerUnderTest:
    """The RabbitMQ node a test session talks to: AMQP URL (the default of the settings'
    ``BROKER_URL``), management API and the ``rabbitmqctl`` command that reaches it."""

    name: str
    url: str
    management_url: str
    rabbitmqctl: tuple[str, ...]


BROKERS = {
    "rabbitmq3": BrokerUnderTest(
        "rabbitmq3",
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        "http://127.0.0.1:15672",
        ("rabbitmqctl",),
    ),
    **{
        name: BrokerUnderTest(name, node.url, node.management_url, (*node.script, "ctl"))
        for name, node in rabbitmq4.NODES.items()
    },
}
# RM_TEST_BROKER=rabbitmq4 (or rabbitmq43) points the whole session (and the subprocesses it
# starts, which inherit the variable) at the 4.0 (or 4.3) node beside the system's 3.10 one:
# `make test` runs the broker-sensitive slice again so. RM_BROKER_URL still overrides the AMQP
# URL alone.
try:
    BROKER = BROKERS[os.environ.get("RM_TEST_BROKER") or "rabbitmq3"]
except KeyError:
    raise RuntimeError(
        f"RM_TEST_BROKER={os.environ['RM_TEST_BROKER']!r}: expected one of {sorted(BROKERS)}"
    ) from None
MANAGEMENT_URL = BROKER.management_url


def broker_url(vhost: str = "/") -> str:
    from django.conf import settings

    base = str(settings.RELIABLE_MESSAGING["BROKER_URL"])
    parts = urllib.parse.urlsplit(base)
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, "/" + urllib.parse.quote(vhost, safe=""), parts.query, "")
    )


def broker_connection(vhost: str = "/", name: str = "rm-tests") -> pika.BlockingConnection:
    params = pika.URLParameters(broker_url(vhost))
    params.client_properties = {"connection_name": name}
    params.connection_attempts = 3
    params.retry_delay = 1
    return pika.BlockingConnection(params)


# The CLI's own Erlang VM: one scheduler that sleeps when idle. Each rabbitmqctl call boots a
# VM; with the defaults one took 0.9 s of CPU here, and a wait polling it kept a core busy.
LEAN_CLI_ERL_ARGS = "+S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none"


def cli_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment by default) with the lean CLI VM's flags."""
    return {**(os.environ if base is None else base), "RABBITMQ_CTL_ERL_ARGS": LEAN_CLI_ERL_ARGS}


def rabbitmqctl(*args: str, timeout: float = 60, attempts: int = 5) -> str:
    """Run ``rabbitmqctl -q ARGS`` against the broker under test; retried briefly because the
    node may be restarted by another engineer's service script. Raises on a persistent
    failure."""
    last: subprocess.CompletedProcess[str] | None = None
    for attempt in range(attempts):
        last = subprocess.run(
            [*BROKER.rabbitmqctl, "-q", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=cli_env(),
            check=False,
        )
        if last.returncode == 0:
            return last.stdout
        time.sleep(min(2.0, 0.5 * (attempt + 1)))
    assert last is not None
    raise RuntimeError(
        f"rabbitmqctl {' '.join(args)} failed ({last.returncode}): "
        f"{last.stderr.strip() or last.stdout.strip()}"
    )


def queue_counts(queue: str, vhost: str = "/") -> tuple[int, int] | None:
    """(ready, unacknowledged) of ``queue`` as the broker counts them now, or None if absent.

    Uses rabbitmqctl (exact, not the management plugin's sampled statistics)."""
    return all_queue_counts(vhost).get(queue)


def all_queue_counts(vhost: str = "/") -> dict[str, tuple[int, int]]:
    """{queue: (ready, unacknowledged)} for every queue of ``vhost``, in one rabbitmqctl call.

    A queue whose counts the broker leaves blank (RabbitMQ 4.0 does while a queue it has just
    declared starts) is left out, as if not there yet."""
    out = rabbitmqctl(
        "list_queues",
        "-p",
        vhost,
        "name",
        "messages_ready",
        "messages_unacknowledged",
        "--no-table-headers",
    )
    counts: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            counts[fields[0]] = (int(fields[1]), int(fields[2]))
    return counts


def drained(*queues: str, vhost: str = "/") -> bool:
    """True when every one of ``queues`` exists and holds no message, ready or unacked."""
    counts = all_queue_counts(vhost)
    return all(counts.get(q) == (0, 0) for q in queues)


def ready_count(queue: str, vhost: str = "/") -> int:
    """Messages ready in ``queue`` (a passive declare; quick, but blind to unacked ones)."""
    connection = broker_connection(vhost)
    try:
        method = connection.channel().queue_declare(queue, passive=True)
        return int(method.method.message_count)
    finally:
        connection.close()


def queue_exists(queue: str, vhost: str = "/") -> bool:
    connection = broker_connection(vhost)
    try:
        connection.channel().queue_declare(queue, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker:
        return False
    finally:
        if connection.is_open:
            connection.close()


def all_queue_arguments(vhost: str = "/") -> dict[str, dict[str, Any]]:
    """{queue: the x-arguments it was declared with} for ``vhost`` (one rabbitmqctl call)."""
    out = rabbitmqctl("list_queues", "-p", vhost, "name", "arguments", "--formatter", "json")
    result: dict[str, dict[str, Any]] = {}
    for row in json.loads(out or "[]"):
        args = row.get("arguments")
        if isinstance(args, list):  # [[key, type, value], ...] (or [key, value])
            result[row["name"]] = {item[0]: item[-1] for item in args}
        else:
            result[row["name"]] = dict(args or {})
    return result


def queue_arguments(queue: str, vhost: str = "/") -> dict[str, Any] | None:
    """The x-arguments ``queue`` was declared with, or None when it does not exist."""
    return all_queue_arguments(vhost).get(queue)


def management(method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    """One call of the broker under test's management HTTP API (``path`` below ``/api``,
    already quoted), with the settings' broker credentials; the decoded JSON answer, or None
    for an empty one. Raises ``urllib.error.HTTPError`` (or ``URLError`` without the plugin)."""
    from django.conf import settings

    parts = urllib.parse.urlsplit(str(settings.RELIABLE_MESSAGING["BROKER_URL"]))
    user = urllib.parse.unquote(parts.username or "guest")
    password = urllib.parse.unquote(parts.password or "guest")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{MANAGEMENT_URL}/api{path}", data=data, method=method)
    request.add_header("Authorization", f"Basic {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def _management_list(kind: str, vhost: str) -> list[str] | None:
    """Names of queues/exchanges via the management API, or None when it is not available."""
    try:
        rows = management(
            "GET", f"/{kind}/{urllib.parse.quote(vhost, safe='')}?columns=name", timeout=3
        )
    except Exception:  # noqa: BLE001 - the plugin is optional: fall back to rabbitmqctl
        return None
    return [row["name"] for row in rows]


def list_broker_names(kind: str, vhost: str = "/") -> list[str]:
    names = _management_list(kind, vhost)
    if names is not None:
        return names
    out = rabbitmqctl(f"list_{kind}", "-p", vhost, "name", "--no-table-headers")
    return [line.strip() for line in out.splitlines() if line.strip()]


def delete_broker_objects(fragment: str, vhost: str = "/") -> list[str]:
    """Delete every queue and exchange of ``vhost`` whose name contains ``fragment``."""
    assert len(fragment) >= 8, "refusing to delete by a short name fragment"
    deleted: list[str] = []
    queues = [n for n in list_broker_names("queues", vhost) if fragment in n]
    exchanges = [n for n in list_broker_names("exchanges", vhost) if fragment in n]
    if not queues and not exchanges:
        return deleted
    connection = broker_connection(vhost, name="rm-tests cleanup")
    try:
        for kind, names in (("queue", queues), ("exchange", exchanges)):
            for name in names:
                channel = connection.channel()
                try:
                    if kind == "queue":
                        channel.queue_delete(name)
                    else:
                        channel.exchange_delete(name)
                    deleted.append(name)
                except pika.exceptions.ChannelClosedByBroker:
                    pass  # already gone
                finally:
                    if channel.is_open:
                        channel.close()
    finally:
        if connection.is_open:
            connection.close()
    return deleted


class Publisher:
    """A raw pika publisher with publisher confirms: bytes go on the wire exactly as given."""

    def __init__(self, vhost: str = "/") -> None:
        self.vhost = vhost
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None

    def _open(self) -> Any:
        if self._connection is None or not self._connection.is_open or not self._channel.is_open:
            self.close()
            self._connection = broker_connection(self.vhost, name="rm-tests publisher")
            self._channel = self._connection.channel()
            self._channel.confirm_delivery()
        return self._channel

    def publish(
        self,
        exchange: str,
        routing_key: str,
        payload: Any = None,
        *,
        body: bytes | None = None,
        message_id: str | bytes | None = "auto",
        content_type: str | None = "application/json",
        headers: Mapping[Any, Any] | None = None,
        mandatory: bool = True,
    ) -> str | None:
        """Publish one persistent message; ``message_id="auto"`` gives a fresh UUID, None none."""
        if message_id == "auto":
            message_id = str(uuid.uuid4())
        if body is None:
            body = json.dumps(payload).encode()
        properties = pika.BasicProperties(
            message_id=message_id,  # type: ignore[arg-type]  # raw bytes on purpose
            content_type=content_type,
            delivery_mode=2,
            timestamp=int(time.time()),
            headers=dict(headers) if headers else None,
        )
        self._open().basic_publish(exchange, routing_key, body, properties, mandatory=mandatory)
        return message_id if isinstance(message_id, str) else None

    def close(self) -> None:
        if self._connection is not None and self._connection.is_open:
            with contextlib.suppress(Exception):  # already broken: nothing to close
                self._connection.close()
        self._connection = None
        self._channel = None


# --------------------------------------------------------------------------- PostgreSQL


def pg_version() -> str:
    versions = sorted(
        os.listdir("/etc/postgresql"), key=lambda v: [int(p) for p in v.split(".") if p.isdigit()]
    )
    return versions[-1]


def pg_isready() -> bool:
    return (
        subprocess.run(
            ["pg_isready", "-q", "-t", "2", "-h", "127.0.0.1", "-p", "5432"],
            check=False,
            timeout=10,
        ).returncode
        == 0
    )


def pg_query_ok() -> bool:
    result = subprocess.run(
        [
            "psql",
            "-w",
            "-X",
            "-A",
            "-t",
            "-q",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-c",
            "select 1",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    )
    return result.stdout.strip() == "1"


def pg_ctl(action: str) -> None:
    args = ["pg_ctlcluster", "--skip-systemctl-redirect", pg_version(), "main", action]
    if action == "stop":
        args += ["-m", "fast"]
    result = subprocess.run(args, capture_output=True, text=True, check=False, timeout=120)
    if result.returncode != 0 and not (action == "start" and pg_isready()):
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")


def ensure_postgresql_up(timeout: float = 90) -> None:
    if not pg_isready():
        pg_ctl("start")
    wait_until(
        lambda: pg_isready() and pg_query_ok(),
        timeout=timeout,
        interval=0.5,
        message="PostgreSQL to accept queries",
    )


def maintenance_sql(*statements: Any) -> None:
    """Run ``statements`` (strings or ``psycopg.sql`` objects) as ``postgres`` on the
    ``postgres`` database, in autocommit: for what a test does to its own database from outside."""
    import psycopg

    with psycopg.connect(
        "host=127.0.0.1 port=5432 user=postgres dbname=postgres",
        autocommit=True,
        connect_timeout=10,
    ) as conn:
        for statement in statements:
            conn.execute(statement)


def terminate_sessions(database: str) -> None:
    from psycopg import sql

    maintenance_sql(
        sql.SQL(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = {} AND pid <> pg_backend_pid()"
        ).format(sql.Literal(database))
    )


@contextlib.contextmanager
def read_only_failover(database: str) -> Iterator[None]:
    """A managed failover as the app sees it, on ``database`` only (never the server: others
    share it): new transactions are read-only (SQLSTATE 25006 on the first write) and every
    session is terminated; on leaving, writable again and every session terminated again
    (each client reconnects, as after a promotion). This process's own Django connections
    are cut too: close them before using them again."""
    from psycopg import sql

    name = sql.Identifier(database)
    maintenance_sql(
        sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(name)
    )
    try:
        terminate_sessions(database)
        yield
    finally:
        maintenance_sql(
            sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(name)
        )
        terminate_sessions(database)


@contextlib.contextmanager
def database_setting(database: str, setting: str, value: str) -> Iterator[None]:
    """``ALTER DATABASE database SET setting = value`` for the sessions opened meanwhile."""
    from psycopg import sql

    name, key = sql.Identifier(database), sql.Identifier(setting)
    maintenance_sql(sql.SQL("ALTER DATABASE {} SET {} = {}").format(name, key, sql.Literal(value)))
    try:
        yield
    finally:
        maintenance_sql(sql.SQL("ALTER DATABASE {} RESET {}").format(name, key))


def deadlocks(database: str) -> int:
    """Deadlocks PostgreSQL detected in ``database`` so far (its statistics, a little late)."""
    import psycopg

    with psycopg.connect(
        "host=127.0.0.1 port=5432 user=postgres dbname=postgres",
        autocommit=True,
        connect_timeout=10,
    ) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = %s", [database]
        ).fetchone()
    return int(row[0]) if row else 0


# --------------------------------------------------------------------------- subprocesses


class ManageProcess:
    """A real ``manage.py <command>`` subprocess whose stdout and stderr go to a log file."""

    command = ""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        settings: str = "tests.settings",
    ) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log_file = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [sys.executable, str(MANAGE), self.command, "--settings", settings, *self.args],
            cwd=ROOT,
            env=dict(env),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        def seen() -> bool:
            if text in self.log():
                return True
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"{self.command} exited with {self.popen.returncode} before "
                    f"logging {text!r}:\n{self.log()}"
                )
            return False

        wait_until(
            seen, timeout=timeout, interval=0.05, message=f"{text!r} in the {self.command} log"
        )

    def ops_port(self, timeout: float = 30.0) -> int:
        """The port of this process's /metrics and /healthz, started with ``--metrics-port 0``
        (one the process binds itself: a port picked free beforehand may be taken by then)."""

        def port() -> int | None:
            found = OPS_LINE.search(self.log())
            return int(found.group(1)) if found else None

        return int(wait_until(port, timeout=timeout, message=f"the ops port of pid {self.pid}"))

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float = 120.0) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WaitTimeout(
                f"{self.command} pid {self.pid} {self.args} still running after {timeout}s:\n"
                f"{self.log()}"
            ) from None

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            self._log_file.close()


class ConsumeProcess(ManageProcess):
    """A real ``manage.py consume`` subprocess."""

    command = "consume"

    def wait_consuming(self, timeout: float = 45.0) -> ConsumeProcess:
        self.wait_for_log("consuming ", timeout=timeout)
        return self


class RelayProcess(ManageProcess):
    """A real ``manage.py relay`` subprocess."""

    command = "relay"

    def wait_connected(self, timeout: float = 60.0) -> Self:
        self.wait_for_log("relay: publishing the outbox", timeout=timeout)
        return self


def count_where(rows: Iterable[Any], **fields: Any) -> int:
    return sum(all(getattr(r, k) == v for k, v in fields.items()) for r in rows)


def fast_path_key(cache: Any, kind: str, consumer: str, message_id: str) -> str:
    """The Redis key of a message's ``kind`` ("done" or "lease") in a ``DuplicateCache``."""
    from reliable_messaging.consuming.fastpath import _digest

    return f"{cache._prefix()}{kind}:{_digest(consumer, message_id)}"
