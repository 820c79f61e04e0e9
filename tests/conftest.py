"""Fixtures of the suite. Real PostgreSQL and RabbitMQ; isolation by a namespace per test.

- ``ns``: a unique namespace; every broker object whose name contains it is deleted afterwards.
- ``rm_settings``: ``RELIABLE_MESSAGING`` overridden so the exchange carries the test's
  namespace, for services run in this process.
- ``service``: runs :class:`ConsumerService` in a background thread, with the relay ``consume``
  runs beside it (retry copies wait in the outbox); stopped in teardown.
- ``consume``: starts real ``manage.py consume`` subprocesses; killed in teardown, and their
  logs are attached to the report of a failed test.
- ``publisher``: a raw pika publisher (publisher confirms).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from tests import support
from tests.pgbouncer import PgBouncer, routed
from tests.support import ConsumeProcess, Publisher

# The PgBouncer fixture's database whose pool holds ONE server connection to the test database.
POOL_OF_ONE = "rm_pool_of_one"


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in setup.cfg; repeated so the suite runs under --strict-markers either way.
    config.addinivalue_line("markers", "slow: spawns real processes (manage.py consume)")
    for marker, says in SERIAL_GROUP_MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {says}")


# Tests that stop, restart or alarm a service other tests use (the broker under test, PostgreSQL,
# Redis), or start a cluster of their own: marked ``serial``, `make test` runs none of them in
# its parallel workers (pytest-xdist), so no other test sees their faults. Each also carries
# the marker of its group, by what it breaks; `make test` runs a group in one process, beside
# no test that uses what it breaks:
#
# - ``stops_storage``: PostgreSQL or Redis stopped. Every test uses them: nothing runs beside.
# - ``stops_broker``: the broker under test stopped, alarmed, or closing channels and taking
#   permissions away by ``rabbitmqctl eval`` in the node (the two test_broker_closes.py tests).
#   What runs beside them (make test's lanes): the RabbitMQ 4.3 node's own serial tests, then
#   the 4.0 node's slice.
# - ``cluster``: a RabbitMQ cluster of the session's own (tests/cluster), beside the node under
#   test, never touching it.
#
# Listed by what they do, not by directory: tests/faults/test_bad_input_corpus.py,
# test_foreign_producers.py, test_poison_pills.py and test_security.py work in a namespace or a
# vhost of their own with processes of their own and break nothing shared, so they run in the
# parallel part, as do the tests of test_broker_closes.py, test_consume_ops.py,
# test_relay_faults.py and test_pipeline_under_faults.py not named here (in the last, kill -9 of
# the rig's own processes and closing the connections of the rig's own vhost).
SERIAL_GROUP_MARKERS = {
    "stops_storage": "stops PostgreSQL or Redis (serial; run with nothing beside it)",
    "stops_broker": "stops, alarms or acts inside the broker under test (serial)",
    "cluster": "starts a RabbitMQ cluster of its own (3 nodes) beside the node on 5672",
}
SERIAL = {
    "cluster": ("tests/cluster/",),
    "stops_broker": (
        "tests/faults/test_pipeline_under_faults.py::test_broker_restarted_twice_",
        "tests/faults/test_pipeline_under_faults.py::test_publishers_blocked_by_a_memory_alarm_",
        "tests/faults/test_broker_closes.py::test_a_channel_the_broker_closes_mid_handler_",
        "tests/faults/test_broker_closes.py::test_healthz_is_unhealthy_while_the_broker_keeps_",
        "tests/integration/ops/test_consume_ops.py::test_consumer_healthz_fails_while_the_broker_is_stopped",
        "tests/integration/ops/test_relay_broker_faults.py",
        "tests/integration/publishing/test_relay_faults.py::test_relay_reconnects_by_itself_after_a_broker_restart",
        "tests/integration/publishing/test_relay_broker_limits.py::test_a_limit_the_operator_raises_",
        "tests/e2e/test_ordering.py::test_keys_keep_publish_order_across_a_restart_",
    ),
    "stops_storage": (
        "tests/faults/test_pipeline_under_faults.py::test_postgresql_restarted_mid_run",
        "tests/faults/test_pipeline_under_faults.py::test_redis_stopped_and_started_mid_run",
        "tests/integration/publishing/test_relay_faults.py::test_relay_rides_out_a_database_outage",
        "tests/e2e/test_consume_command.py::test_database_",
        "tests/e2e/test_consume_command.py::test_sigterm_during_a_database_outage",
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for group, prefixes in SERIAL.items():
            if item.nodeid.startswith(prefixes):
                item.add_marker(pytest.mark.serial)
                item.add_marker(getattr(pytest.mark, group))
                break


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[Any]:
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed:
        for proc in getattr(item, "_rm_processes", []):
            try:
                text = proc.log()
            except OSError as exc:
                text = f"(log unreadable: {exc})"
            report.sections.append(
                (f"consume pid={proc.pid} args={proc.args} rc={proc.returncode} log", text)
            )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Objects the session namespace's registered consumers (tests.alpha/beta) may have declared.
    namespace = os.environ.get("RM_TEST_NAMESPACE", "")
    if len(namespace) >= 8:
        # Best effort: the broker may be down at the end of a failed run.
        with contextlib.suppress(Exception):
            support.delete_broker_objects(namespace)


@pytest.fixture(autouse=True)
def _wake_up_connections_closed() -> Iterator[None]:
    """publish() wakes the relay from a connection of the process's own: it is given back after
    each test, so that nothing holds the test database open when it is dropped."""
    yield
    from reliable_messaging.publishing.wake_after_commit import sender

    sender.flush(timeout=5)
    sender.close()


@pytest.fixture(autouse=True)
def _no_broker_limit_learned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process remembers for a minute the max_message_size a broker quoted in a refusal,
    and publish() refuses bodies over it meanwhile: each test starts from a process that has
    heard none (a twin's refusal of 300 bytes in one test refused the next tests' bodies)."""
    from reliable_messaging.broker import limits

    monkeypatch.setattr(limits, "_learned", None)


@pytest.fixture(scope="session")
def pgbouncer(django_db_setup: None) -> Iterator[PgBouncer]:
    """One transaction-pooling PgBouncer per session (per xdist worker), shared by every test
    that asks for it; any database name goes through it to the local PostgreSQL, and
    ``POOL_OF_ONE`` is the test database with a pool of one server connection. Stopped (its
    server connections closed) before the test database is dropped."""
    from django.db import connection

    name = connection.settings_dict["NAME"]
    bouncer = PgBouncer({POOL_OF_ONE: f"host=127.0.0.1 port=5432 dbname={name} pool_size=1"})
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(scope="session", autouse=True)
def _through_pgbouncer(request: pytest.FixtureRequest) -> Iterator[None]:
    """``RM_TEST_PGBOUNCER=1``: the whole session's database traffic (the tests', their
    threads' and their ``manage.py`` subprocesses') goes through :func:`pgbouncer` in
    transaction pooling mode; ``make test`` runs the e2e and publishing slices once more so."""
    if not os.environ.get("RM_TEST_PGBOUNCER"):
        yield
        return
    from django.db import connection

    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    with routed("127.0.0.1", bouncer.port, connection.settings_dict["NAME"]):
        yield


@pytest.fixture(scope="session", autouse=True)
def _broker_under_test() -> None:
    """``RM_TEST_BROKER=rabbitmq4`` (or ``rabbitmq43``): the session talks to the RabbitMQ 4.0
    (or 4.3) node (tests/support.py); it is started (built, the first time on a machine) before
    any test."""
    from tests.rabbitmq4 import NODES

    if support.BROKER.name in NODES:
        NODES[support.BROKER.name].ensure_started()


@pytest.fixture(scope="session")
def rabbitmq4() -> Any:
    """The RabbitMQ 4.0 node (tests/rabbitmq4.py), started for the session if it is not up."""
    from tests.rabbitmq4 import NODES

    NODES["rabbitmq4"].ensure_started()
    return NODES["rabbitmq4"]


@pytest.fixture(scope="session")
def rabbitmq43() -> Any:
    """The RabbitMQ 4.3 node (tests/rabbitmq4.py), started for the session if it is not up."""
    from tests.rabbitmq4 import NODES

    NODES["rabbitmq43"].ensure_started()
    return NODES["rabbitmq43"]


@pytest.fixture
def ns() -> Iterator[str]:
    namespace = support.new_namespace()
    yield namespace
    support.delete_broker_objects(namespace)


@pytest.fixture
def rm_settings(ns: str) -> Iterator[dict[str, Any]]:
    """The test's RELIABLE_MESSAGING: the suite's settings with an exchange of its own."""
    values = {**settings.RELIABLE_MESSAGING, "EXCHANGE": f"rmtest.{ns}"}
    with override_settings(RELIABLE_MESSAGING=values):
        yield values


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


@pytest.fixture
def service(rm_settings: dict[str, Any], transactional_db: None) -> Iterator[Callable[..., Any]]:
    """``service(specs, **kwargs)`` starts a ConsumerService in a thread and waits until it
    consumes, and once a relay beside it as ``consume`` does (``relay=False``: none); every
    service started is stopped (and joined) in teardown."""
    from reliable_messaging.consuming.service import ConsumerService
    from reliable_messaging.management.relay_beside import RelayBeside

    running: list[tuple[Any, threading.Thread]] = []
    relays: list[RelayBeside] = []

    def start(specs: list[Any], *, wait: bool = True, relay: bool = True, **kwargs: Any) -> Any:
        if relay and not relays:
            relays.append(RelayBeside())
            relays[0].start()
        svc = ConsumerService(specs, **kwargs)
        thread = threading.Thread(target=svc.run, name="rm-test-service", daemon=True)
        thread.start()
        running.append((svc, thread))
        if wait:
            assert svc.connected.wait(30), "the consumer service did not connect within 30s"
        return svc

    yield start
    for svc, _ in running:
        svc.request_stop()
    for svc, thread in running:
        thread.join(60)
        assert not thread.is_alive(), "the consumer service did not stop within 60s"
    for beside in relays:
        beside.stop()


def database_url() -> str:
    """URL of the test database (the one pytest-django created), for subprocesses."""
    from django.db import connection

    conf = connection.settings_dict
    user = conf.get("USER") or "postgres"
    password = f":{conf['PASSWORD']}" if conf.get("PASSWORD") else ""
    host = conf.get("HOST") or "127.0.0.1"
    port = conf.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{conf['NAME']}"


def subprocess_env(ns: str, *, unset: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """Environment of a ``manage.py`` subprocess for namespace ``ns`` and the test database;
    ``unset`` names variables of this process it must not inherit."""
    env = {
        **os.environ,
        "RM_TEST_NAMESPACE": ns,
        "DATABASE_URL": database_url(),
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    for name in unset:
        env.pop(name, None)
    env.update(extra)
    return env


@pytest.fixture
def consume(
    request: pytest.FixtureRequest, ns: str, transactional_db: None, tmp_path: Path
) -> Iterator[Callable[..., ConsumeProcess]]:
    """``consume(*args)`` starts ``manage.py consume ARGS`` for the test's namespace and its
    database; every process is SIGKILLed (if still running) in teardown."""
    processes: list[ConsumeProcess] = []
    request.node._rm_processes = processes
    env = {
        **os.environ,
        "RM_TEST_NAMESPACE": ns,
        "DATABASE_URL": database_url(),
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }

    def start(*args: str) -> ConsumeProcess:
        log = tmp_path / f"consume-{len(processes) + 1}.log"
        proc = ConsumeProcess(list(args), env, log)
        processes.append(proc)
        return proc

    yield start
    for proc in processes:
        proc.close()
