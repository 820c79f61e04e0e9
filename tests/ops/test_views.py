"""The web process's views: ``metrics/`` (database gauges) and ``healthz/`` (the system)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.models import OutboxMessage

from .conftest import parse_samples

pytestmark = pytest.mark.django_db


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
    OutboxMessage.objects.update(created_at=timezone.now() - dt.timedelta(hours=1))
    response = client.get(reverse("reliable_messaging:healthz"))
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    assert not body["checks"]["outbox_lag"]["ok"]
    [reason] = body["reasons"]
    assert "the oldest pending outbox row waits for 3600s (limit 300s)" in reason


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
    assert samples == {("reliable_messaging_database_up", frozenset()): 0}

    with pytest.raises(RollBack), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} RENAME TO {table}_away")
        health_response = client.get(reverse("reliable_messaging:healthz"))
        raise RollBack
    assert health_response.status_code == 503
    assert health_response.json()["reasons"] == ["the outbox cannot be read (ProgrammingError)"]


def test_healthz_only_answers_get(client: Client) -> None:
    assert client.post(reverse("reliable_messaging:healthz")).status_code == 405
