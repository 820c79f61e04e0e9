"""The demo's Celery app: RabbitMQ is Celery's broker too, on a queue of its own.

``celery -A demo_project worker -B`` runs it with the embedded beat scheduler, which starts
``reliable_messaging.relay_outbox`` every few seconds (``CELERY_BEAT_SCHEDULE`` in the
settings); ``run_demo`` does that for the second part of its scenario.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds demo_project.shop.tasks and reliable_messaging.tasks (relay_outbox).
app.autodiscover_tasks()
