"""The web process's views: ``metrics/`` (database gauges) and ``healthz/`` (the system)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.models import OutboxMessage
from reliable_messaging.ops import views
from reliable_messaging.ops.collectors import BrokerCollector
from tests.support import Publisher, broker_connection

from .conftest import parse_samples

pytestmark = pytest.mark.django_db


def is_broker_gauge(name: str) -> bool:
    return name == "reliable_messaging_broker_up" or name.startswith("reliable_messaging_queue_")


TOKEN = "ops-token-" + "x" * 24


@pytest.fixture(autouse=True)
def fresh_broker_read() -> Iterator[None]:
    """Each test sees the broker as it is now, not the view's read kept from another test."""
    views.BROKER_COLLECTOR.forget()
    views.RECENT_BROKER_CHECK.forget()
    yield
    views.BROKER_COLLECTOR.forget()
    views.RECENT_BROKER_CHECK.forget()


@pytest.fixture(autouse=True)
def ops_token(settings: Any) -> None:
    """The views are closed to anonymous requests: the suite's settings get a token, which
    the ``client`` below sends, as a Prometheus scraper would."""
    settings.RELIABLE_MESSAGING = {**settings.RELIABLE_MESSAGING, "OPS_VIEWS_TOKEN": TOKEN}


@pytest.fixture
def client() -> Client:
    return Client(headers={"authorization": f"Bearer {TOKEN}"})


# --------------------------------------------------------------------------- who may read


@pytest.mark.parametrize("name", ["metrics", "healthz"])
def test_anonymous_requests_and_wrong_tokens_are_refused(name: str) -> None:
    url = reverse(f"reliable_messaging:{name}")
    for headers in (
        {},
        {"authorization": "Bearer not-the-token"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": f"Bearer {TOKEN[:-1]}"},
    ):
        response = Client(headers=headers).get(url)
        assert response.status_code == 403, headers
        assert b"OPS_VIEWS_TOKEN" in response.content
        assert b"reliable_messaging_" not in response.content and b"checks" not in response.content


@pytest.mark.parametrize("name", ["metrics", "healthz"])
def test_the_token_staff_and_the_public_opt_out_are_let_through(
    name: str, settings: Any, django_user_model: Any
) -> None:
    url = reverse(f"reliable_messaging:{name}")
    assert Client(headers={"authorization": f"bearer {TOKEN}"}).get(url).status_code == 200

    staff, member = Client(), Client()
    staff.force_login(django_user_model.objects.create_user("ops", is_staff=True))
    member.force_login(django_user_model.objects.create_user("shopper"))
    assert staff.get(url).status_code == 200
    assert member.get(url).status_code == 403  # logged in is not enough

    settings.RELIABLE_MESSAGING = {
        **settings.RELIABLE_MESSAGING,
        "OPS_VIEWS_TOKEN": None,
        "OPS_VIEWS_PUBLIC": True,
    }
    assert Client().get(url).status_code == 200


def test_healthz_asks_the_broker_once_per_max_age(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []
    real = views.broker_connection_error

    def counted(**kwargs: Any) -> str:
        calls.append(kwargs.get("timeout", 0.0))
        return real(**kwargs)

    monkeypatch.setattr(views, "broker_connection_error", counted)
    url = reverse("reliable_messaging:healthz")
    answers = [client.get(url) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    assert all(a.json()["checks"]["broker"]["ok"] for a in answers)
    assert len(calls) == 1  # five probes, one broker connection

    monkeypatch.setattr(views.RECENT_BROKER_CHECK, "max_age", 0.0)  # its time is up
    assert client.get(url).status_code == 200
    assert len(calls) == 2


def test_urls_are_mounted_where_the_project_includes_them() -> None:
    assert reverse("reliable_messaging:metrics") == "/messaging/metrics/"
    assert reverse("reliable_messaging:healthz") == "/messaging/healthz/"


def test_metrics_view_exports_the_database_gauges(client: Client) -> None:
    with transaction.atomic():
        publish("ops.view", {"n": 1})
        publish("ops.view", {"n": 2})
    response = client.get(reverse("reliable_messaging:metrics"))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert "no-cache" in response["Cache-Control"]
    samples = parse_samples(response.content.decode())
    assert samples[("reliable_messaging_outbox_pending_messages", frozenset())] == 2
    assert samples[("reliable_messaging_database_up", frozenset())] == 1
    # Only the database gauges: the process counters belong to the consume/relay processes.
    assert not any(name.startswith("reliable_messaging_relay_") for name, _ in samples)


def test_healthz_is_ok_with_database_broker_and_a_fresh_outbox(client: Client) -> None:
    publish("ops.view", {"n": 1})
    response = client.get(reverse("reliable_messaging:healthz"))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "ok"
    assert {name: check["ok"] for name, check in body["checks"].items()} == {
        "database": True,
        "broker": True,
        "outbox_lag": True,
    }
    assert "no-cache" in response["Cache-Control"]


def test_healthz_fails_when_the_outbox_lags(client: Client) -> None:
    publish("ops.view", {"n": 1})
    began = time.monotonic()
    OutboxMessage.objects.update(created_at=timezone.now() - dt.timedelta(hours=1))
    response = client.get(reverse("reliable_messaging:healthz"))
    took = time.monotonic() - began
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    assert not body["checks"]["outbox_lag"]["ok"]
    [reason] = body["reasons"]
    found = re.search(r"the oldest pending outbox row waits for (\d+)s \(limit 300s\)", reason)
    assert found, reason
    # An hour, and the seconds this test took to ask (a loaded machine's).
    assert 3600 <= int(found.group(1)) <= 3600 + took + 1, reason


def test_healthz_fails_when_the_broker_is_unreachable(client: Client) -> None:
    # A port nothing listens on: a real refused connection. The password must not leak.
    values = {**settings.RELIABLE_MESSAGING, "BROKER_URL": "amqp://guest:s3cret@127.0.0.1:1/%2F"}
    with override_settings(RELIABLE_MESSAGING=values):
        response = client.get(reverse("reliable_messaging:healthz"))
    assert response.status_code == 503
    body = response.json()
    assert not body["checks"]["broker"]["ok"]
    assert body["checks"]["database"]["ok"]
    [reason] = body["reasons"]
    assert reason.startswith("the broker cannot be reached: ")
    assert "s3cret" not in response.content.decode()


class RollBack(Exception):
    """Raised to roll a savepoint back on purpose."""


def test_views_answer_when_the_messaging_tables_cannot_be_read(client: Client) -> None:
    table = OutboxMessage._meta.db_table
    # A real error from PostgreSQL: the table is missing for the length of a savepoint.
    with pytest.raises(RollBack), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
        metrics_response = client.get(reverse("reliable_messaging:metrics"))
        raise RollBack
    assert metrics_response.status_code == 200
    samples = parse_samples(metrics_response.content.decode())
    database = {key: value for key, value in samples.items() if not is_broker_gauge(key[0])}
    assert database == {("reliable_messaging_database_up", frozenset()): 0}
    # The queue gauges do not depend on the database.
    assert samples[("reliable_messaging_broker_up", frozenset())] == 1

    with pytest.raises(RollBack), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
        health_response = client.get(reverse("reliable_messaging:healthz"))
        raise RollBack
    assert health_response.status_code == 503
    assert health_response.json()["reasons"] == ["the outbox cannot be read (ProgrammingError)"]


def test_healthz_only_answers_get(client: Client) -> None:
    assert client.post(reverse("reliable_messaging:healthz")).status_code == 405


def test_metrics_view_exports_queue_depths_and_consumers(
    client: Client, ns: str, rm_settings: dict[str, Any]
) -> None:
    """Ready messages and attached consumers per queue, read from the broker: what an alert
    on "messages waiting and nobody consuming" needs. Ordered consumers show their partitions."""
    plain = ConsumerSpec(name="tests.ops.plain", queue=f"rmtest.{ns}.plain", handler=lambda m: None)
    ordered = ConsumerSpec(
        name="tests.ops.ordered",
        queue=f"rmtest.{ns}.ordered",
        handler=lambda m: None,
        bindings=("o.*",),
        ordered=True,
    )
    never = ConsumerSpec(name="tests.ops.never", queue=f"rmtest.{ns}.never", handler=lambda m: None)
    connection = broker_connection()
    try:
        channel = connection.channel()
        declare_topology(channel, [plain, ordered])
        publisher = Publisher()
        try:
            for n in range(3):
                publisher.publish("", plain.queue, {"n": n})
        finally:
            publisher.close()
        channel.basic_consume(ordered.queue + ".p1", lambda *args: None)  # one consumer attached
        with registry.isolated():
            for spec in (plain, ordered, never):
                registry.register(spec)
            response = client.get(reverse("reliable_messaging:metrics"))
    finally:
        connection.close()
    assert response.status_code == 200
    samples = parse_samples(response.content.decode())

    def gauge(name: str, queue: str, consumer: str, kind: str = "consumer") -> float | None:
        labels = frozenset({"queue": queue, "consumer": consumer, "kind": kind}.items())
        return samples.get((f"reliable_messaging_queue_{name}", labels))

    assert samples[("reliable_messaging_broker_up", frozenset())] == 1
    assert gauge("exists", plain.queue, plain.name) == 1
    assert gauge("messages_ready", plain.queue, plain.name) == 3
    assert gauge("consumers", plain.queue, plain.name) == 0
    # An ordered consumer has no queue of its own name: its partitions are what is watched.
    assert gauge("exists", ordered.queue, ordered.name) is None
    partitions = [f"{ordered.queue}.p{i}" for i in range(messaging_settings.ordered_partitions)]
    assert [gauge("exists", q, ordered.name) for q in partitions] == [1] * len(partitions)
    assert [gauge("consumers", q, ordered.name) for q in partitions] == [0, 1] + [0] * (
        len(partitions) - 2
    )
    # Never declared (no consume process ran): it exists 0, and has no depth to report.
    assert gauge("exists", never.queue, never.name) == 0
    assert gauge("messages_ready", never.queue, never.name) is None
    # A retry waits in the outbox: no queue of the broker's holds one.
    assert not any(("kind", "delay") in labels for _, labels in samples)
    # The database gauges are still there, next to the queue gauges.
    assert samples[("reliable_messaging_database_up", frozenset())] == 1
    # No queue of an earlier shape of these consumers exists.
    assert not any(("kind", "leftover") in labels for _, labels in samples)


def test_a_leftover_queue_is_exported_with_its_kind(
    client: Client, ns: str, rm_settings: dict[str, Any]
) -> None:
    plain = ConsumerSpec(name="tests.ops.moved", queue=f"rmtest.{ns}.moved", handler=print)
    ordered = dataclasses.replace(plain, ordered=True)
    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [plain])
        declare_topology(connection.channel(), [ordered])
        publisher = Publisher()
        try:
            publisher.publish("", plain.queue, {"n": 1})
        finally:
            publisher.close()
        with registry.isolated():
            registry.register(ordered)
            response = client.get(reverse("reliable_messaging:metrics"))
    finally:
        connection.close()
    samples = parse_samples(response.content.decode())
    labels = frozenset({"queue": plain.queue, "consumer": plain.name, "kind": "leftover"}.items())
    assert samples[("reliable_messaging_queue_messages_ready", labels)] == 1
    assert samples[("reliable_messaging_queue_exists", labels)] == 1


def test_queue_gauges_with_the_broker_unreachable(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    values = {**settings.RELIABLE_MESSAGING, "BROKER_URL": "amqp://guest:s3cret@127.0.0.1:1/%2F"}
    with override_settings(RELIABLE_MESSAGING=values), caplog.at_level(logging.WARNING):
        first = client.get(reverse("reliable_messaging:metrics"))
        views.BROKER_COLLECTOR.forget()
        second = client.get(reverse("reliable_messaging:metrics"))
    for response in (first, second):
        assert response.status_code == 200
        samples = parse_samples(response.content.decode())
        assert samples[("reliable_messaging_broker_up", frozenset())] == 0
        assert not any(name.startswith("reliable_messaging_queue_") for name, _ in samples)
        assert samples[("reliable_messaging_database_up", frozenset())] == 1
    warnings = [r for r in caplog.records if "cannot read the queues" in r.getMessage()]
    assert len(warnings) == 1, "one warning while the broker stays unreachable"
    assert "s3cret" not in caplog.text and "s3cret" not in second.content.decode()


def test_queue_gauges_with_a_broker_url_pika_cannot_use(caplog: pytest.LogCaptureFixture) -> None:
    """pika refuses such a URL with a ValueError that quotes pieces of it: the read still
    answers (broker_up 0) and the log does not show the password."""
    spec = ConsumerSpec(name="tests.ops.badurl", queue="tests.ops.badurl", handler=print)
    collector = BrokerCollector([spec])
    values = {**settings.RELIABLE_MESSAGING, "BROKER_URL": "amqp://app:s3cret@127.0.0.1:9x/%2F"}
    with override_settings(RELIABLE_MESSAGING=values), caplog.at_level(logging.WARNING):
        samples = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert samples == {"reliable_messaging_broker_up": 0}
    assert "cannot read the queues" in caplog.text
    assert "s3cret" not in caplog.text


def test_queue_gauges_are_read_at_most_once_per_max_age(client: Client, ns: str) -> None:
    """A burst of scrapes opens one broker connection, not one each."""
    spec = ConsumerSpec(name="tests.ops.burst", queue=f"rmtest.{ns}.burst", handler=lambda m: None)
    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [spec])
        with registry.isolated():
            registry.register(spec)
            before = client.get(reverse("reliable_messaging:metrics"))
            publisher = Publisher()
            try:
                publisher.publish("", spec.queue, {"n": 1})
            finally:
                publisher.close()
            kept = client.get(reverse("reliable_messaging:metrics"))
            views.BROKER_COLLECTOR.forget()
            fresh = client.get(reverse("reliable_messaging:metrics"))
    finally:
        connection.close()
    labels = frozenset({"queue": spec.queue, "consumer": spec.name, "kind": "consumer"}.items())
    key = ("reliable_messaging_queue_messages_ready", labels)
    ready = [parse_samples(r.content.decode())[key] for r in (before, kept, fresh)]
    assert ready == [0, 0, 1]
