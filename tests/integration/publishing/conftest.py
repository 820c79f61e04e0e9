"""Fixtures of the outbox/relay tests. Real PostgreSQL and RabbitMQ, nothing mocked.

- ``ob``: an :class:`OutboxEnv`: a namespace of its own (exchange ``rmtest.<ns>``, declared
  durable), ``RELIABLE_MESSAGING`` overridden to use it, helpers to declare test queues, start
  ``manage.py relay`` subprocesses and in-process relays in threads. In teardown every relay is
  stopped, every subprocess killed and every broker object of the namespace deleted.
- ``broker``: short-lived pika connections (each operation opens its own, so a broker restart
  in the middle of a test does not break the helpers).
- ``far_day``: for the tests of the outbox's indexes on PostgreSQL, a day partition created by
  the upkeep now.

Every wait is bounded. Subprocess logs are attached to the report of a failed test.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from django.conf import settings
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import OUTBOX
from tests import support
from tests.support import WaitTimeout

ROOT = Path(__file__).resolve().parents[3]
MANAGE = ROOT / "manage.py"
RELAY_SETTINGS = "tests.integration.publishing.relay_settings"


def new_namespace() -> str:
    return f"ob{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- RabbitMQ


@dataclass(frozen=True)
class Received:
    """One message taken off a test queue."""

    exchange: str
    routing_key: str
    properties: pika.BasicProperties
    body: bytes
    redelivered: bool

    @property
    def message_id(self) -> str:
        return str(self.properties.message_id)

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


class Broker:
    """The real broker seen from the tests; every call opens (and closes) its own connection."""

    def __init__(self, url: str) -> None:
        self.url = url

    def parameters(self) -> pika.URLParameters:
        params = pika.URLParameters(self.url)
        params.connection_attempts = 5
        params.retry_delay = 1
        params.socket_timeout = 10
        params.blocked_connection_timeout = 60
        params.client_properties = {"connection_name": "rm-outbox-tests"}
        return params

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        conn = pika.BlockingConnection(self.parameters())
        try:
            yield conn.channel()
        finally:
            if conn.is_open:
                with contextlib.suppress(Exception):
                    conn.close()

    def declare_exchange(self, name: str) -> None:
        with self.channel() as ch:
            ch.exchange_declare(name, exchange_type="topic", durable=True)

    def declare_queue(
        self,
        name: str,
        exchange: str,
        bindings: Sequence[str] = ("#",),
        arguments: dict[str, Any] | None = None,
    ) -> None:
        with self.channel() as ch:
            ch.queue_declare(name, durable=True, arguments=arguments)
            for key in bindings:
                ch.queue_bind(name, exchange, routing_key=key)

    def bind(self, queue: str, exchange: str, key: str) -> None:
        with self.channel() as ch:
            ch.queue_bind(queue, exchange, routing_key=key)

    def count(self, queue: str) -> int:
        """Messages ready in ``queue`` now."""
        with self.channel() as ch:
            return int(ch.queue_declare(queue, passive=True).method.message_count)

    def drain(self, queue: str, expected: int = 0, timeout: float = 60.0) -> list[Received]:
        """Take every message off ``queue``: at least ``expected`` of them (waiting up to
        ``timeout``), then whatever else arrives until the queue has been quiet for 0.5 s."""
        got: list[Received] = []
        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            ch.basic_qos(prefetch_count=500)
            for method, properties, body in ch.consume(
                queue, auto_ack=True, inactivity_timeout=0.5
            ):
                if method is None:
                    if len(got) >= expected:
                        break
                    if time.monotonic() >= deadline:
                        ch.cancel()
                        raise WaitTimeout(
                            f"only {len(got)} of {expected} message(s) arrived on {queue} "
                            f"within {timeout}s"
                        )
                    continue
                got.append(
                    Received(
                        exchange=method.exchange,
                        routing_key=method.routing_key,
                        properties=properties,
                        body=body,
                        redelivered=bool(method.redelivered),
                    )
                )
            ch.cancel()
        return got

    def delete_queue(self, name: str) -> None:
        with contextlib.suppress(pika.exceptions.ChannelClosedByBroker), self.channel() as ch:
            ch.queue_delete(name)

    def delete_exchange(self, name: str) -> None:
        with contextlib.suppress(pika.exceptions.ChannelClosedByBroker), self.channel() as ch:
            ch.exchange_delete(name)

    def names(self, kind: str) -> list[str]:
        """Names of the queues or exchanges of vhost / (management API, else rabbitmqctl)."""
        return support.list_broker_names(kind)

    def delete_matching(self, fragment: str) -> None:
        assert len(fragment) >= 10, "refusing to delete broker objects by a short fragment"
        for name in self.names("queues"):
            if fragment in name:
                self.delete_queue(name)
        for name in self.names("exchanges"):
            if fragment in name:
                self.delete_exchange(name)


def ensure_broker_running() -> None:
    """Bring the rabbit app back (after ``stop_app``) and wait until it has booted."""
    try:
        support.rabbitmqctl("start_app", timeout=120)
    finally:
        support.rabbitmqctl("await_startup", "--timeout", "120", timeout=150)


# --------------------------------------------------------------------------- subprocesses


def database_url() -> str:
    """URL of the test database pytest-django created, for subprocesses."""
    conf = connection.settings_dict
    user = conf.get("USER") or "postgres"
    password = f":{conf['PASSWORD']}" if conf.get("PASSWORD") else ""
    host = conf.get("HOST") or "127.0.0.1"
    port = conf.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{conf['NAME']}"


class RelayProcess(support.RelayProcess):
    """A real ``manage.py relay`` subprocess (with the per-test settings overrides)."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        super().__init__(args, env, log_path, settings=RELAY_SETTINGS)


# --------------------------------------------------------------------------- in-process relays


class RelayThread:
    """A relay (:func:`build_relay`) running in a thread of the test process (so it sees the test's
    ``override_settings``); ``done`` is set when ``run()`` returned (``result``) or raised
    (``error``)."""

    def __init__(self, **kwargs: Any) -> None:
        from reliable_messaging.publishing.relay import build_relay

        self.relay = build_relay(**kwargs)
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rm-outbox-test-relay", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.relay.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop()
            self.error = exc
        finally:
            connections.close_all()
            self.done.set()

    def stop(self, timeout: float = 60.0) -> Any:
        """Ask the relay to stop, wait for it, and return its report (or raise its error)."""
        self.relay.request_stop()
        assert self.done.wait(timeout), f"the relay thread did not stop within {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


# --------------------------------------------------------------------------- the environment


class OutboxEnv:
    """Everything one outbox test needs, isolated by a namespace of its own."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path: Path, broker: Broker) -> None:
        self.request = request
        self.tmp_path = tmp_path
        self.broker = broker
        self.ns = new_namespace()
        self.exchange = f"rmtest.{self.ns}"
        self.processes: list[RelayProcess] = []
        self.threads: list[RelayThread] = []
        self.queues: list[str] = []
        self._base = dict(settings.RELIABLE_MESSAGING)
        self.overrides: dict[str, Any] = {"EXCHANGE": self.exchange}
        self._override: Any = None
        request.node._ob_processes = self.processes
        broker.declare_exchange(self.exchange)
        self._apply()

    # -- settings --------------------------------------------------------------------------

    def set(self, **values: Any) -> None:
        """Override ``RELIABLE_MESSAGING`` keys for this process and later subprocesses."""
        self.overrides.update(values)
        self._apply()

    def _apply(self) -> None:
        if self._override is not None:
            self._override.disable()
        self._override = override_settings(RELIABLE_MESSAGING={**self._base, **self.overrides})
        self._override.enable()

    # -- broker ----------------------------------------------------------------------------

    def queue(
        self,
        suffix: str = "q",
        bindings: Sequence[str] = ("#",),
        arguments: dict[str, Any] | None = None,
        exchange: str | None = None,
    ) -> str:
        """Declare a durable test queue bound to the test's exchange; deleted in teardown."""
        name = f"rmtest.{self.ns}.{suffix}"
        self.queues.append(name)
        self.broker.declare_queue(name, exchange or self.exchange, bindings, arguments)
        return name

    # -- relays ----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        environment = {
            **os.environ,
            "RM_TEST_NAMESPACE": self.ns,
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            "RM_OUTBOX_OVERRIDES": json.dumps(self.overrides),
        }
        environment.pop("DJANGO_SETTINGS_MODULE", None)
        return environment

    def relay_process(self, *args: str) -> RelayProcess:
        """Start ``manage.py relay ARGS`` on the test database with the test's settings."""
        log = self.tmp_path / f"relay-{len(self.processes) + 1}.log"
        process = RelayProcess(args, self.env(), log)
        self.processes.append(process)
        return process

    def run_relay_once(self, timeout: float = 120.0, *args: str) -> tuple[int, str]:
        """Run ``manage.py relay --once ARGS`` to its end; returns (exit code, log)."""
        process = self.relay_process("--once", *args)
        code = process.wait(timeout)
        return code, process.log()

    def relay_thread(self, **kwargs: Any) -> RelayThread:
        """Start an in-process relay (``kwargs`` for :func:`build_relay`) in a thread; it is
        stopped in teardown."""
        runner = RelayThread(**kwargs)
        self.threads.append(runner)
        return runner

    def stop_relay(self, runner: RelayThread, timeout: float = 60.0) -> Any:
        return runner.stop(timeout)

    # -- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        problems: list[str] = []
        for runner in self.threads:
            runner.relay.request_stop()
        for runner in self.threads:
            runner.thread.join(60)
            if runner.thread.is_alive():
                problems.append("a relay thread did not stop within 60s")
        for process in self.processes:
            process.close()
        if self._override is not None:
            self._override.disable()
            self._override = None
        try:
            for name in self.queues:
                self.broker.delete_queue(name)
            self.broker.delete_exchange(self.exchange)
            self.broker.delete_matching(self.ns)
        except Exception as exc:  # noqa: BLE001 - report, but let the other teardowns run
            problems.append(f"cleaning up broker objects of {self.ns} failed: {exc!r}")
        if problems:
            raise AssertionError("; ".join(problems))


@pytest.fixture
def broker() -> Broker:
    return Broker(str(settings.RELIABLE_MESSAGING["BROKER_URL"]))


@pytest.fixture
def ob(request: pytest.FixtureRequest, tmp_path: Path, broker: Broker) -> Iterator[OutboxEnv]:
    env = OutboxEnv(request, tmp_path, broker)
    try:
        yield env
    finally:
        env.close()


# --------------------------------------------------------------------------- the outbox's schema


@pytest.fixture
def far_day() -> Iterator[str]:
    """A day partition created now, by ``partitions.outbox_leaf_sql``, a year ahead (dropped
    afterwards with its neighbours, which were created with it)."""
    now = timezone.now() + dt.timedelta(days=365)
    created = partitions.ensure_partitions("default", now=now, spec=OUTBOX)
    day = partitions.day_name(now.astimezone(dt.UTC).date(), OUTBOX)
    assert day in created
    yield day
    with connection.cursor() as cursor:
        for name in created:
            cursor.execute(f'DROP TABLE IF EXISTS "{name}"')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed:
        for process in getattr(item, "_ob_processes", []):
            report.sections.append(
                (
                    f"relay pid={process.pid} args={process.args} rc={process.returncode} log",
                    process.log(),
                )
            )
