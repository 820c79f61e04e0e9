"""The app behind a transaction-pooling PgBouncer (the session's own, ``pgbouncer`` fixture).

What a pooler shares must stay clean: after our publish, wake-ups and relay ran on a pool of ONE
server connection, an unrelated client of that pool sees the server's defaults, no prepared
statement and no LISTEN of ours. Wake-ups keep working past psycopg's prepare threshold. A relay
whose LISTEN goes through the pooler (where it hears nothing) says so and polls at
``RELAY_POLL_INTERVAL``; with ``RELAY_LISTEN_DSN`` it is woken through a direct session while its
claims go through the pooler.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from reliable_messaging import publish
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.publishing.listener import NOTIFY_CHANNEL
from reliable_messaging.publishing.wake_after_commit import sender
from tests.conftest import POOL_OF_ONE
from tests.markers import direct_only, postgresql_only
from tests.pgbouncer import PgBouncer, routed
from tests.support import wait_until
from tests.testapp.consumers import behave
from tests.testapp.models import Effect

from .conftest import OutboxEnv

# Each test routes the app through the pooler itself: not run again in the run through it.
pytestmark = [pytest.mark.django_db(transaction=True), postgresql_only, direct_only]

DIRECT = "host=127.0.0.1 port=5432"


def direct_dsn() -> str:
    """The test database reached directly (for RELAY_LISTEN_DSN while DATABASES names a pool)."""
    return f"{DIRECT} dbname={connection.settings_dict['NAME']}"


def healthz(port: int) -> Any:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def messaging_status_json() -> Any:
    out = io.StringIO()
    with contextlib.suppress(CommandError):  # exit code 1 or 2: judged elsewhere
        call_command("messaging_status", "--json", "--management-url", "", stdout=out)
    return json.loads(out.getvalue())


def test_nothing_of_ours_stays_on_a_pooled_server_connection(
    ob: OutboxEnv, pgbouncer: PgBouncer, service: Any
) -> None:
    # publish() with its wake-ups, the relay and a consumer that handles what it sends, all on
    # a pool of one server connection.
    consumer = f"{ob.exchange}.consumer"
    spec = ConsumerSpec(
        name=consumer,
        queue=consumer,
        handler=lambda message: behave("pool", message),
        bindings=("pool.one",),
        exchange=ob.exchange,
    )
    ob.set(RELAY_LISTEN_DSN=direct_dsn())
    with routed("127.0.0.1", pgbouncer.port, POOL_OF_ONE):
        service([spec])
        relay = ob.relay_process().wait_connected()
        ids = []
        # Nothing of ours may need a second server connection while its transaction holds the
        # only one: the relay or a claim would hold the pool until a timeout of ours (30 s)
        # let go, batch after batch, and every other client (these publishes) would wait.
        deadline = time.monotonic() + 25
        for n in range(8):  # past psycopg's prepare threshold (5)
            with transaction.atomic():
                ids.append(publish("pool.one", {"n": n}, exchange=ob.exchange))
            assert sender.flush()
        wait_until(
            lambda: Effect.objects.filter(consumer="pool").count() == 8,
            timeout=max(0.0, deadline - time.monotonic()),
            message=lambda: f"the 8 messages handled; relay log:\n{relay.log()}",
        )
        handled = Effect.objects.filter(consumer="pool").values_list("message_id", flat=True)
        assert sorted(handled) == sorted(ids)
        # An unrelated client of the same pool of one: it gets the very server connection our
        # wake-ups, claims and records ran on.
        with psycopg.connect(pgbouncer.url(POOL_OF_ONE), autocommit=True) as other:
            seen = other.execute(
                "SELECT current_setting('statement_timeout'), "
                "current_setting('synchronous_commit'), "
                "(SELECT count(*) FROM pg_prepared_statements), "
                "(SELECT count(*) FROM pg_listening_channels())"
            ).fetchone()
            assert seen == ("0", "on", 0, 0), relay.log()
            other.execute("SELECT pg_sleep(3)")  # not cancelled by a timeout of ours


def test_wake_ups_keep_working_past_the_prepare_threshold(
    ob: OutboxEnv, pgbouncer: PgBouncer
) -> None:
    name = connection.settings_dict["NAME"]
    with psycopg.connect(f"{DIRECT} dbname={name}", autocommit=True) as listening:
        listening.execute(f"LISTEN {NOTIFY_CHANNEL}")
        failed = sender.failed
        with routed("127.0.0.1", pgbouncer.port, name):
            # Three server connections in the pool: PgBouncer (server_round_robin) hands out the
            # oldest idle one, so successive wake-ups go out on different ones.
            clients = [psycopg.connect(pgbouncer.url(name)) for _ in range(3)]
            for client in clients:
                client.execute("SELECT 1")  # each holds a server connection until...
            for client in clients:
                client.commit()  # ...here
                client.close()
            for n in range(10):
                with transaction.atomic():
                    publish("pool.wake", {"n": n})
                assert sender.flush()
        assert sender.failed == failed, "a wake-up failed (see the WARNING above)"
        received = 0
        end = time.monotonic() + 5
        while received < 10 and (left := end - time.monotonic()) > 0:
            if select.select([listening.fileno()], [], [], left)[0]:
                listening.pgconn.consume_input()
                while listening.pgconn.notifies() is not None:
                    received += 1
        assert received == 10


@pytest.mark.slow
def test_a_relay_whose_listen_goes_through_the_pooler_says_so_and_polls(
    ob: OutboxEnv, pgbouncer: PgBouncer
) -> None:
    # Each row must arrive within 3 s: a poll of 0.5 s meets that; the stretched poll of 5 s
    # would miss it for one row of four all but 3 times in 100.
    ob.set(RELAY_POLL_INTERVAL=0.5)
    queue = ob.queue()
    with routed("127.0.0.1", pgbouncer.port, connection.settings_dict["NAME"]):
        relay = ob.relay_process("--metrics-port", "0").wait_connected()
        port = relay.ops_port()
        relay.wait_for_log("hears nothing", timeout=30)
        assert "RELAY_LISTEN_DSN" in relay.log()
        notes = healthz(port).get("notes", [])
        assert any("RELAY_LISTEN_DSN" in note for note in notes), notes
        listen = messaging_status_json()["listen"]
        assert listen["hears_notify"] is False
        assert "RELAY_LISTEN_DSN" in listen["note"]
        for n in range(4):
            time.sleep(2.0)  # past the relay's trail of claims after rows: in its idle wait
            publish("pool.deaf", {"n": n})
            sent = n + 1
            wait_until(
                lambda: ob.broker.count(queue) == sent,
                timeout=3.0,
                interval=0.02,
                message=lambda: f"row {sent} sent after a poll; relay log:\n{relay.log()}",
            )
        assert len(re.findall("hears nothing", relay.log())) == 1  # said once


@pytest.mark.slow
def test_relay_listen_dsn_wakes_the_relay_through_a_direct_session(
    ob: OutboxEnv, pgbouncer: PgBouncer
) -> None:
    # Polling every 30 s: only a wake-up explains a delivery within 5 s.
    ob.set(RELAY_POLL_INTERVAL=30.0, RELAY_LISTEN_DSN=direct_dsn())
    queue = ob.queue()
    name = connection.settings_dict["NAME"]
    with routed("127.0.0.1", pgbouncer.port, name):
        relay = ob.relay_process().wait_connected()
        time.sleep(2.0)  # settled into its 30 s idle wait (and its probe heard)
        message_id = publish("pool.direct", {"n": 1})
        wait_until(
            lambda: ob.broker.count(queue) == 1,
            timeout=5,
            interval=0.02,
            message=lambda: f"the row sent after a wake-up; relay log:\n{relay.log()}",
        )
        assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [message_id]
        assert "hears nothing" not in relay.log()
        assert messaging_status_json()["listen"] == {"hears_notify": True, "note": None}
        # The LISTEN session is not one of PgBouncer's server connections; the claims are.
        pooled_ports = {
            int(port)
            for port in re.findall(
                r"new connection to server \(from [\d.]+:(\d+)\)", pgbouncer.logs()
            )
        }
    with psycopg.connect(f"{DIRECT} dbname={name}", autocommit=True) as direct:
        listen_ports = [
            row[0]
            for row in direct.execute(
                "SELECT client_port FROM pg_stat_activity WHERE datname = %s AND query = %s",
                [name, f"LISTEN {NOTIFY_CHANNEL}"],
            )
        ]
    assert listen_ports, "no LISTEN session of the relay"
    assert not set(listen_ports) & pooled_ports
    assert pooled_ports, "the relay's claims did not go through PgBouncer"


def test_the_suites_pgbouncer_dies_with_the_process_that_started_it() -> None:
    """A pytest killed by SIGKILL (a timeout, an impatient engineer) leaves no pgbouncer
    behind: the kernel kills it with its parent (tests/pgbouncer.py)."""
    script = (
        "import sys, time\n"
        "from tests.pgbouncer import PgBouncer\n"
        "bouncer = PgBouncer()\n"
        "print(bouncer.process.pid, bouncer.dir, flush=True)\n"
        "time.sleep(120)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert starter.stdout is not None
    pid_text, directory = starter.stdout.readline().split(maxsplit=1)
    pid = int(pid_text)

    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited
        except FileNotFoundError:
            return False

    assert alive()
    starter.send_signal(signal.SIGKILL)
    starter.wait(10)
    try:
        wait_until(lambda: not alive(), timeout=10, message=f"pgbouncer {pid} gone with its parent")
    finally:
        shutil.rmtree(directory.strip(), ignore_errors=True)  # the killed starter's
