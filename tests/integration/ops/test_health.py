"""``reliable_messaging.contrib.health_check.MessagingHealthCheck`` as django-health-check runs
it: through
``HealthCheckView`` (registered by dotted path, as its docstring says) and ``get_result``,
whose executor thread reads the database the test committed to."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import RequestFactory, override_settings
from django.utils import timezone
from health_check.exceptions import ServiceUnavailable
from health_check.views import HealthCheckView

from reliable_messaging.contrib.health_check import MessagingHealthCheck
from reliable_messaging.models import OutboxMessage
from tests.support import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

CHECK = "reliable_messaging.contrib.health_check.MessagingHealthCheck"


def run_view(*checks: Any) -> tuple[int, dict[str, str]]:
    view = HealthCheckView.as_view(checks=checks)
    response = asyncio.run(view(RequestFactory().get("/health/", {"format": "json"})))
    return response.status_code, json.loads(response.content)


def stale_outbox_row(age: dt.timedelta) -> None:
    row = OutboxMessage.objects.create(message_id="m-stale", routing_key="x.y", body="{}")
    OutboxMessage.objects.filter(pk=row.pk).update(created_at=timezone.now() - age)


@pytest.fixture
def broker_down() -> Iterator[str]:
    """BROKER_URL pointing at a local port nothing listens on, with a password to look for."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"amqp://guest:hunter2secret@127.0.0.1:{port}/%2F"
    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "BROKER_URL": url}):
        yield "hunter2secret"


def test_healthy_when_the_broker_answers_and_the_outbox_keeps_up() -> None:
    stale_outbox_row(dt.timedelta(seconds=5))  # pending, but well within the limit
    result = asyncio.run(MessagingHealthCheck().get_result())
    assert result.error is None

    code, body = run_view(CHECK)
    assert code == 200
    assert body == {
        "MessagingHealthCheck(max_outbox_lag=datetime.timedelta(seconds=60), using=None)": "OK"
    }


def test_unavailable_when_the_broker_cannot_be_reached(broker_down: str) -> None:
    result = asyncio.run(MessagingHealthCheck().get_result())
    assert isinstance(result.error, ServiceUnavailable)
    assert "RabbitMQ cannot be reached" in str(result.error)
    assert "Connection refused" in str(result.error)

    code, body = run_view(CHECK)
    assert code == 500
    text = json.dumps(body)
    assert "RabbitMQ cannot be reached" in text
    assert broker_down not in text and "127.0.0.1" not in text  # nothing about the broker


def test_unavailable_when_the_outbox_lags() -> None:
    stale_outbox_row(dt.timedelta(minutes=10))
    result = asyncio.run(MessagingHealthCheck().get_result())
    assert isinstance(result.error, ServiceUnavailable)
    assert re.search(r"oldest pending outbox row is 60\d s old \(limit 60 s\)", str(result.error))

    # A lag limit of its own, passed as the view's options.
    code, body = run_view((CHECK, {"max_outbox_lag": dt.timedelta(minutes=15)}))
    assert code == 200, body


def test_importing_reliable_messaging_needs_neither_health_check_nor_celery() -> None:
    script = (
        "import sys\n"
        "sys.modules['health_check'] = None\n"  # as if not installed
        "sys.modules['celery'] = None\n"
        "import django\n"
        "django.setup()\n"
        "import reliable_messaging, reliable_messaging.ops.status\n"
        "from reliable_messaging import Message, PermanentError, consumer, publish\n"
        "try:\n"
        "    import reliable_messaging.contrib.health_check\n"
        "except ImportError:\n"
        "    print('health needs django-health-check')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "health needs django-health-check"
