"""``manage.py messaging_status`` against a real queue, a real outbox and real dead letters.

Each test registers one consumer of its own (its queue carries the test's namespace)
in an isolated registry, so the command looks at exactly the queues the test controls.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.broker.queues import BrokerStatus, QueueStatus
from reliable_messaging.broker.topology import (
    consumer_queues,
    declare_topology,
)
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.conf import redact_url
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.ops.collectors import DatabaseStatus
from reliable_messaging.ops.status import Thresholds, find_problems
from reliable_messaging.storage import partitions
from tests.conftest import database_url
from tests.markers import postgresql_only
from tests.support import (
    BROKER,
    MANAGE,
    MANAGEMENT_URL,
    ROOT,
    Publisher,
    broker_connection,
    rabbitmqctl,
    wait_until,
)

pytestmark = pytest.mark.django_db

CONSUMER = "tests.status.billing"


@pytest.fixture(autouse=True)
def true_statistics(db: None) -> None:
    """The inbox and the scheduled rows are counted up to a bound by PostgreSQL's statistics
    (``collectors.counted_or_estimated``). Another test's ANALYZE of rows it then rolled back
    leaves its figure there (``pg_class`` is written in place), so they are made true first."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        for table in (partitions.INBOX_TABLE, partitions.OUTBOX_SCHEDULED):
            cursor.execute(f'ANALYZE "{table}"')


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        return json.loads(self.out)

    def queue(self, name: str) -> dict[str, Any]:
        return next(q for q in self.json["broker"]["queues"] if q["name"] == name)


def status(*args: str) -> Ran:
    """Run the command in-process; ``code`` is what ``manage.py`` would exit with. The
    management API is the broker under test's unless ``args`` name one."""
    if "--management-url" not in args:
        args = (*args, "--management-url", MANAGEMENT_URL)
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("messaging_status", *args, stdout=out, stderr=err)
    except CommandError as exc:
        err.write(f"CommandError: {exc}\n")
        return Ran(exc.returncode, out.getvalue(), err.getvalue())
    return Ran(0, out.getvalue(), err.getvalue())


def closed_port() -> int:
    """A local port nothing listens on (it was free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def declare(spec: ConsumerSpec) -> None:
    """What ``consume`` declares for ``spec`` on start (its queue or partitions)."""
    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [spec])
    finally:
        connection.close()


@pytest.fixture
def queue(ns: str, rm_settings: dict[str, Any]) -> Iterator[str]:
    """The test's consumer, registered alone, with its queue declared."""
    spec = ConsumerSpec(
        name=CONSUMER, queue=f"rmtest.{ns}.billing", handler=lambda m: None, bindings=("x.#",)
    )
    with registry.isolated():
        registry.register(spec)
        declare(spec)
        yield spec.queue


@pytest.fixture
def backlog(queue: str) -> str:
    """Three messages ready in the queue, one outbox row pending for two minutes, one failed
    outbox row, one dead letter awaiting review and two inbox rows."""
    publisher = Publisher()
    try:
        for n in range(3):
            publisher.publish("", queue, {"n": n})
    finally:
        publisher.close()
    pending = OutboxMessage.objects.create(message_id="m-pending", routing_key="x.y", body="{}")
    OutboxMessage.objects.filter(pk=pending.pk).update(
        created_at=timezone.now() - dt.timedelta(minutes=2)
    )
    OutboxMessage.objects.create(
        message_id="m-failed", routing_key="x.y", body="{}", status=OutboxStatus.FAILED
    )
    OutboxMessage.objects.create(
        message_id="m-sent",
        routing_key="x.y",
        body="{}",
        status=OutboxStatus.SENT,
        sent_at=timezone.now(),
    )
    DeadLetter.objects.create(
        message_id="m-dead", consumer=CONSUMER, queue=queue, reason="permanent", body=b"{}"
    )
    DeadLetter.objects.create(
        message_id="m-resolved",
        consumer=CONSUMER,
        queue=queue,
        reason="permanent",
        body=b"{}",
        status="resolved",
    )
    ProcessedMessage.objects.create(consumer=CONSUMER, message_id="m-1")
    ProcessedMessage.objects.create(consumer=CONSUMER, message_id="m-2")
    return queue


RELAXED = ("--max-outbox-lag", "3600", "--max-dead-letters", "1", "--max-outbox-failed", "1")


def test_json_has_the_numbers(backlog: str, rm_settings: dict[str, Any]) -> None:
    ran = status("--json", *RELAXED)
    assert ran.code == 0, ran.err
    document = ran.json
    assert document["version"] == 1 and document["exit_code"] == 0
    assert document["problems"] == []

    broker = document["broker"]
    assert broker["reachable"] is True and broker["management_api"] is True
    assert broker["error"] is None
    assert broker["url"] == redact_url(BROKER.url)
    billing = ran.queue(backlog)
    assert billing["kind"] == "consumer" and billing["consumer"] == CONSUMER
    assert billing["exists"] is True
    assert (billing["ready"], billing["unacked"], billing["consumers"]) == (3, 0, 0)
    assert billing["redelivery_ratio"] is None  # nothing delivered yet
    # A retry waits in the outbox: no queue of the broker's holds one.
    assert {q["kind"] for q in broker["queues"]} == {"consumer"}

    database = document["database"]
    assert database["reachable"] is True and database["alias"] == "default"
    assert database["outbox"]["pending"] == 1 and database["outbox"]["failed"] == 1
    assert 120 <= database["outbox"]["lag_seconds"] < 600
    assert database["dead_letters"] == {
        "total": 1,
        "by_consumer_and_reason": [{"consumer": CONSUMER, "reason": "permanent", "count": 1}],
    }
    assert database["inbox"] == {"rows": 2}
    assert document["thresholds"]["max_outbox_lag"] == 3600


def test_unacked_deliveries_come_from_the_management_api(backlog: str) -> None:
    connection = broker_connection()
    try:
        channel = connection.channel()
        method, _, _ = channel.basic_get(backlog, auto_ack=False)  # held, not acked
        assert method is not None
        # ready is exact at once (a passive declare); unacked is the plugin's sample, which
        # it refreshes every few seconds.
        ran = wait_until(
            lambda: (r := status("--json", *RELAXED)).queue(backlog)["unacked"] == 1 and r,
            timeout=30,
            interval=0.5,
            message="the management API to report the unacked delivery",
        )
        assert ran.queue(backlog)["ready"] == 2
    finally:
        connection.close()


def test_without_the_management_api_ready_and_consumers_still_show(backlog: str) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    ran = status("--json", *RELAXED, "--management-url", url)
    assert ran.code == 0, ran.err
    broker = ran.json["broker"]
    assert broker["reachable"] is True and broker["management_api"] is False
    assert url in broker["note"] and "Connection refused" in broker["note"]
    billing = ran.queue(backlog)
    assert (billing["ready"], billing["unacked"], billing["consumers"]) == (3, None, 0)

    text = status(*RELAXED, "--management-url", url)
    assert "unacked/rates need the management plugin" in text.out
    assert "OK: no threshold crossed" in text.out


def test_human_output(backlog: str) -> None:
    ran = status(*RELAXED)
    assert ran.code == 0, ran.err
    lines = ran.out.splitlines()
    row = next(line for line in lines if line.strip().startswith(backlog))
    assert row.split() == [backlog, CONSUMER, "3", "0", "0", "-"]
    assert "Outbox: 1 pending (oldest 2 min old), 1 failed" in ran.out
    assert "Dead letters awaiting review: 1" in ran.out
    assert "Inbox: 2 processed message(s) remembered" in ran.out


def test_a_missing_queue_is_shown_as_not_declared(ns: str, rm_settings: dict[str, Any]) -> None:
    spec = ConsumerSpec(name=CONSUMER, queue=f"rmtest.{ns}.never", handler=lambda m: None)
    with registry.isolated():
        registry.register(spec)
        ran = status("--json")
        text = status()
    assert ran.code == 0, ran.err
    assert ran.queue(spec.queue) == {
        "name": spec.queue,
        "kind": "consumer",
        "consumer": CONSUMER,
        "exists": False,
        "ready": None,
        "unacked": None,
        "consumers": None,
        "deliver_rate": None,
        "redeliver_rate": None,
        "redelivery_ratio": None,
    }
    assert f"not declared yet (manage.py consume declares them): {spec.queue}" in text.out


def test_an_ordered_consumer_is_shown_by_its_partitions(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    """An ordered consumer has no queue of its own name: its partition queues are what holds
    its messages, so they are what the status shows (and judges against the thresholds)."""
    spec = ConsumerSpec(
        name=CONSUMER,
        queue=f"rmtest.{ns}.ledger",
        handler=lambda m: None,
        bindings=("x.#",),
        ordered=True,
    )
    partitions = consumer_queues(spec)
    assert len(partitions) > 1
    with registry.isolated():
        registry.register(spec)
        declare(spec)
        publisher = Publisher()
        try:
            publisher.publish("", partitions[1], {"n": 1})
        finally:
            publisher.close()
        ran = status("--json")
    assert ran.code == 0, ran.err
    consumer_queues_shown = [q for q in ran.json["broker"]["queues"] if q["kind"] == "consumer"]
    assert [q["name"] for q in consumer_queues_shown] == partitions
    assert all(q["exists"] and q["consumer"] == CONSUMER for q in consumer_queues_shown)
    assert [q["ready"] for q in consumer_queues_shown] == [0, 1] + [0] * (len(partitions) - 2)


def test_a_queue_left_by_an_earlier_shape_is_shown_and_judged(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    """A consumer made ordered leaves its old queue bound: messages reaching it are handled by
    nobody until ``consume`` retires it, so the status shows it and counts it a problem."""
    plain = ConsumerSpec(
        name=CONSUMER, queue=f"rmtest.{ns}.ledger", handler=lambda m: None, bindings=("x.#",)
    )
    ordered = dataclasses.replace(plain, ordered=True)
    declare(plain)
    declare(ordered)
    publisher = Publisher()
    try:
        publisher.publish(rm_settings["EXCHANGE"], "x.y", {"n": 1})  # a copy in both shapes
    finally:
        publisher.close()
    with registry.isolated():
        registry.register(ordered)
        ran = status("--json", "--strict")
        relaxed = status("--json", "--strict", "--max-leftover-messages", "1")
        text = status()
        probe = status("--json")  # the default: a probe, which a leftover queue does not fail
    assert probe.code == 0, probe.err
    assert probe.queue(plain.queue)["ready"] == 1  # shown all the same
    assert ran.code == 1, ran.err
    leftover = ran.queue(plain.queue)
    assert (leftover["kind"], leftover["consumer"], leftover["ready"]) == ("leftover", CONSUMER, 1)
    [problem] = ran.json["problems"]
    assert problem["threshold"] == "max_leftover_messages"
    assert f"queue {plain.queue} was left by an earlier shape" in problem["message"]
    assert "--max-leftover-messages" in ran.err
    assert relaxed.code == 0, relaxed.err
    row = next(line for line in text.out.splitlines() if line.split()[:1] == [plain.queue])
    assert f"{CONSUMER} (leftover)" in row


def test_the_default_is_a_probe_that_only_a_stalled_outbox_fails(backlog: str) -> None:
    """A dead letter, a failed outbox row and a two-minute-old pending row need a person, not a
    restart: a probe passes, and says what it saw."""
    ran = status("--json")
    assert ran.code == 0, ran.err
    assert ran.json["problems"] == []
    assert ran.json["thresholds"]["max_dead_letters"] is None
    assert ran.json["database"]["dead_letters"]["total"] == 1
    assert ran.json["database"]["outbox"]["failed"] == 1
    text = status()
    assert "Dead letters awaiting review: 1" in text.out
    assert "OK: no threshold crossed" in text.out

    # Five minutes behind: the relay has stopped or cannot publish, which a probe must see.
    OutboxMessage.objects.filter(message_id="m-pending").update(
        created_at=timezone.now() - dt.timedelta(minutes=6)
    )
    ran = status("--json")
    assert ran.code == 1
    assert [p["threshold"] for p in ran.json["problems"]] == ["max_outbox_lag"]
    assert "(limit 300 s)" in ran.json["problems"][0]["message"]


def test_crossed_thresholds_exit_1_and_say_which(backlog: str) -> None:
    ran = status("--json", "--strict")  # lag 60 s, no failed row, no dead letter
    assert ran.code == 1
    problems = {p["threshold"]: p["message"] for p in ran.json["problems"]}
    assert set(problems) == {"max_outbox_lag", "max_outbox_failed", "max_dead_letters"}
    assert re.search(
        r"oldest pending outbox row is 12\d s old \(limit 60 s\)", problems["max_outbox_lag"]
    )
    assert "1 dead letter(s) await review (limit 0)" in problems["max_dead_letters"]
    assert ran.json["exit_code"] == 1
    assert "--max-outbox-lag, --max-outbox-failed, --max-dead-letters" in ran.err

    ran = status("--strict", *RELAXED, "--max-ready", "2", "--min-consumers", "1")
    assert ran.code == 1
    assert f"PROBLEM: queue {backlog} has 3 ready message(s) (limit 2)" in ran.out
    assert f"PROBLEM: queue {backlog} has 0 consumer(s) attached" in ran.out
    assert "threshold(s) crossed: --max-ready, --min-consumers" in ran.err
    assert status("--strict", *RELAXED, "--max-ready", "3").code == 0  # the limit is not over it


def test_redelivery_ratio_threshold() -> None:
    def queue(deliver: float | None, redeliver: float | None) -> QueueStatus:
        return QueueStatus(
            "q", "consumer", "c", True, 0, 0, 1, deliver_rate=deliver, redeliver_rate=redeliver
        )

    def problems(*queues: QueueStatus) -> list[str]:
        broker = BrokerStatus("amqp://", reachable=True, management_api=True, queues=queues)
        database = DatabaseStatus("default", reachable=True)
        return [p.threshold for p in find_problems(broker, database, Thresholds.strict())]

    assert queue(10.0, 5.0).redelivery_ratio == 0.5
    assert problems(queue(10.0, 5.0)) == ["max_redelivery_rate"]
    assert problems(queue(10.0, 2.0)) == []  # 20% is the limit, not over it
    assert problems(queue(0.0, 0.0), queue(None, None)) == []  # no deliveries: no ratio


def test_the_broker_password_never_appears(
    ns: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    user, password = f"rmtest-{ns}", f"pw{uuid.uuid4().hex}"
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_user_tags", user, "monitoring")
        rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        caplog.set_level(logging.DEBUG)
        outputs = []
        broker_port = urllib.parse.urlsplit(BROKER.url).port
        for port in (broker_port, closed_port()):
            url = f"amqp://{user}:{password}@127.0.0.1:{port}/%2F"
            with override_settings(
                RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "BROKER_URL": url}
            ):
                for args in ((), ("--json",), ("--management-url", f"http://127.0.0.1:{port}")):
                    ran = status(*args)
                    outputs.append((port, args, ran))
        seen = "".join(r.out + r.err for _, _, r in outputs) + caplog.text
        assert password not in seen
        reachable = [r for port, _, r in outputs if port == broker_port]
        assert all(r.code == 0 for r in reachable), [r.err for r in reachable]
        assert f"amqp://{user}:***@127.0.0.1:{broker_port}/%2F" in reachable[0].out
        assert reachable[1].json["broker"]["management_api"] is True  # the user can read it
        assert all(r.code == 2 for port, _, r in outputs if port != broker_port)
    finally:
        rabbitmqctl("delete_user", user)


def test_an_unreachable_broker_exits_2_with_a_clear_message(queue: str) -> None:
    port = closed_port()
    url = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "BROKER_URL": url}):
        ran = status()
        document = status("--json").json
    assert ran.code == 2
    assert (
        f"UNREACHABLE: cannot connect to amqp://guest:***@127.0.0.1:{port}/%2F: "
        f"AMQPConnectionError" in ran.out
    )
    assert "Connection refused" in ran.out
    assert "CommandError: the broker cannot be reached" in ran.err
    assert "Traceback" not in ran.out + ran.err
    # The database is still reported: a person sees everything that can be seen.
    assert "Inbox: 0 processed message(s) remembered" in ran.out
    assert document["exit_code"] == 2 and document["broker"]["reachable"] is False
    assert document["broker"]["queues"] == [] and document["database"]["reachable"] is True


def manage_status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(MANAGE), "messaging_status", "--settings", "tests.settings", *args],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_as_a_probe_manage_py_exits_2_without_a_traceback() -> None:
    port = closed_port()
    broker_down = manage_status({"RM_BROKER_URL": f"amqp://guest:s3cr3t@127.0.0.1:{port}/%2F"})
    assert broker_down.returncode == 2, broker_down.stdout + broker_down.stderr
    assert "the broker cannot be reached" in broker_down.stderr
    assert "Traceback" not in broker_down.stdout + broker_down.stderr
    assert "s3cr3t" not in broker_down.stdout + broker_down.stderr

    database_down = manage_status(
        {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{closed_port()}/nowhere"}, "--json"
    )
    assert database_down.returncode == 2, database_down.stdout + database_down.stderr
    assert "the database cannot be reached" in database_down.stderr
    assert "Traceback" not in database_down.stdout + database_down.stderr
    document = json.loads(database_down.stdout)
    assert document["database"]["reachable"] is False
    assert "OperationalError" in document["database"]["error"]
    assert document["broker"]["reachable"] is True


def test_a_queue_name_with_a_slash_and_a_vhost_are_quoted(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    # The management API path takes the vhost and the queue name URL-quoted.
    spec = ConsumerSpec(name=CONSUMER, queue=f"rmtest.{ns}/odd name", handler=lambda m: None)
    connection = broker_connection()
    publisher = Publisher()
    try:
        connection.channel().queue_declare(spec.queue, durable=False)
        publisher.publish("", spec.queue, {})
        with registry.isolated():
            registry.register(spec)
            ran = status("--json")
    finally:
        publisher.close()
        connection.close()
    assert ran.json["broker"]["management_api"] is True
    odd = ran.queue(spec.queue)
    assert odd["exists"] is True and odd["ready"] == 1 and odd["unacked"] == 0


@pytest.mark.django_db(transaction=True)
@postgresql_only
def test_the_inbox_is_estimated_on_postgresql_not_counted() -> None:
    """Counting a billion inbox rows takes minutes: past COUNT_INBOX_UP_TO rows by PostgreSQL's
    statistics, the status reads them (here 300 rows analyzed, then 100 deleted unseen by the
    statistics)."""
    from unittest import mock

    from django.test.utils import CaptureQueriesContext

    from reliable_messaging.ops import collectors

    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="c", message_id=f"m{n}") for n in range(300)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {ProcessedMessage._meta.db_table}")
    ProcessedMessage.objects.filter(message_id__in=[f"m{n}" for n in range(100)]).delete()
    with (
        mock.patch.object(collectors, "COUNT_INBOX_UP_TO", 50),
        CaptureQueriesContext(connection) as queries,
    ):
        figures = collectors.database_status()
    assert figures.inbox_rows == 300
    inbox = ProcessedMessage._meta.db_table
    assert not [q for q in queries.captured_queries if "COUNT(" in q["sql"] and inbox in q["sql"]]


def test_a_scheduled_row_past_its_due_time_is_outbox_lag() -> None:
    # No relay runs: a scheduled row that came due six minutes ago waits as a pending one
    # would, and a probe must see it as /healthz and the metrics do.
    late = publish("status.x", {"n": 1}, deliver_at=timezone.now() + dt.timedelta(hours=1))
    OutboxMessage.objects.filter(message_id=late).update(
        next_attempt_at=timezone.now() - dt.timedelta(minutes=6)
    )
    with registry.isolated():
        ran = status("--json")
    outbox = ran.json["database"]["outbox"]
    assert (outbox["pending"], outbox["scheduled"]) == (0, 1)
    assert outbox["lag_seconds"] >= 360
    assert ran.code == 1, ran.err
    assert [p["threshold"] for p in ran.json["problems"]] == ["max_outbox_lag"]
