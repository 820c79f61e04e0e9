"""``@idempotent_task`` while the database is unavailable, with a real ``celery worker``.

The outage is a failover to read-only on the test's own database, its sessions terminated
(``tests.support.read_only_failover``); the task queue is a quorum queue with a delivery limit,
as RabbitMQ 4.x gives every quorum queue one (20 by default).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.db import connection, connections

from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests import support
from tests.support import drained, wait_until
from tests.testapp.models import Effect

from .tasks import email_receipt
from .worker import CeleryWorker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_task_is_held_through_an_outage_without_spending_its_queues_delivery_limit(
    ns: str, tmp_path: Path
) -> None:
    """The task goes on running again in its worker until the database is back, as ``consume``
    holds a delivery; given back to the queue once a second instead, the message would pass
    the queue's delivery limit of 2 within the outage and be dropped, never taking effect."""
    from .celery_app import app

    worker = CeleryWorker(
        f"rmtest.{ns}.celery",
        tmp_path / "celery-worker.log",
        env={"RM_CELERY_DELIVERY_LIMIT": "2"},
    )
    try:
        worker.wait_ready()
        database = connection.settings_dict["NAME"]
        connections.close_all()
        with support.read_only_failover(database):
            started = time.monotonic()
            # Through the worker's exchange: the worker declared the queue, with its limit.
            app.send_task(
                email_receipt.name, args=[401], exchange=worker.queue, routing_key=worker.queue
            )
            wait_until(
                lambda: "database unavailable" in worker.log(),
                timeout=30,
                message=lambda: f"the task held by the outage; worker log:\n{worker.log()}",
            )
            time.sleep(max(0.0, 6.0 - (time.monotonic() - started)))
        connections.close_all()
        wait_until(
            lambda: Effect.objects.filter(consumer="receipt", message_id="401").exists(),
            timeout=60,
            message=lambda: f"the task's effect after the outage; worker log:\n{worker.log()}",
        )
        wait_until(lambda: drained(worker.queue), timeout=20, message="the queue emptied")
        assert Effect.objects.filter(consumer="receipt", message_id="401").count() == 1
        assert ProcessedMessage.objects.filter(message_id="receipt:401").count() == 1
        assert not DeadLetter.objects.exists()
        assert "Traceback" not in worker.log(), worker.log()
    finally:
        worker.stop()
