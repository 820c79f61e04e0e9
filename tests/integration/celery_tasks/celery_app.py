"""The Celery app a test's worker runs (``celery -A tests.integration.celery_tasks.celery_app
worker``).

RabbitMQ is the broker. Everything a test varies comes from the environment the test gives the
worker: the queue (``RM_CELERY_QUEUE``, one per test), the database (``DATABASE_URL``) and the
broker (``RM_BROKER_URL``); with ``RM_CELERY_DELIVERY_LIMIT``, the queue is a quorum queue with
that delivery limit and no dead-letter exchange, so a message past it is dropped. The test
process sends tasks through this app too, without making it Celery's current app, so the eager
tests elsewhere are not affected.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Exchange, Queue

from tests.support import BROKER

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

QUEUE = os.environ.get("RM_CELERY_QUEUE", "rmtest.celery")

app = Celery("rmtests", include=["tests.integration.celery_tasks.tasks"], set_as_current=False)
limit = os.environ.get("RM_CELERY_DELIVERY_LIMIT")
if limit:
    app.conf.task_queues = [
        Queue(
            QUEUE,
            Exchange(QUEUE),
            routing_key=QUEUE,
            queue_arguments={"x-queue-type": "quorum", "x-delivery-limit": int(limit)},
        )
    ]
app.conf.update(
    # kombu reads the vhost from the path like pika does ("%2F" is "/").
    broker_url=os.environ.get("RM_BROKER_URL", BROKER.url),
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    # No pidbox queues or event exchanges left behind on the shared broker.
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    worker_prefetch_multiplier=1,
    # What @idempotent_task needs (the system check warns without it): a message is acked
    # once its task is done, and the task of a pool child that was killed goes back to the
    # queue instead of being acked as failed.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
)
