"""Settings of the demo shop.

SQLite by default (``demo_project/db.sqlite3``); set ``DATABASE_URL`` to use another database,
e.g. ``postgres://postgres@127.0.0.1:5432/rm_demo``. Not for production: the secret key is public.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "reliable_messaging",
    "demo_project.shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "demo_project.urls"
WSGI_APPLICATION = "demo_project.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"

if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": dj_database_url.parse(os.environ["DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(BASE_DIR / "db.sqlite3"),
            "OPTIONS": {
                # Several processes share the file (run_demo, consume, relay, the Celery
                # worker's). WAL lets readers run beside the one writer; IMMEDIATE takes the
                # write lock at BEGIN, so a transaction waits (up to the timeout) instead of
                # failing with "database is locked" when it upgrades from reading to writing.
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

RELIABLE_MESSAGING = {
    "BROKER_URL": os.environ.get("RM_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    "EXCHANGE": "shop",
    # Short delays and few attempts so a transient failure is retried within the demo's run.
    "RETRY_DELAYS": [1, 2],
    "MAX_ATTEMPTS": 3,
    # SQLite has no LISTEN/NOTIFY: the relay polls, so poll often.
    "RELAY_POLL_INTERVAL": 0.2,
}

# django.tasks, for the demo's task part: its tasks run by `manage.py consume` (docs/tasks.md).
# Before Django 6.0 the framework is the django-tasks backport, an app of its own.
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.append("django_tasks")
TASKS = {
    "default": {
        "BACKEND": "reliable_messaging.contrib.task_backend.ReliableTaskBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"QUEUE_PREFIX": "shop.tasks."},
    }
}

# Celery, for the second part of the demo: the same RabbitMQ as broker, on its own queue. Beat
# runs relay_outbox in place of `manage.py relay`. Publisher confirms, so a task sent is a task
# the broker has.
CELERY_BROKER_URL = RELIABLE_MESSAGING["BROKER_URL"]
CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = "demo.celery"
CELERY_TASK_DEFAULT_EXCHANGE = "demo.celery"
CELERY_TASK_DEFAULT_ROUTING_KEY = "demo.celery"
# @idempotent_task needs both: a task is acked only once it ran, and a pool child killed under
# it (the OOM killer) gives the task back instead of acking it as failed; the crash guard then
# dead-letters a task that kills its child CRASH_LIMIT times.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# No pidbox queues or event exchanges: the demo has no monitoring tools to answer.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_BEAT_SCHEDULE = {
    "relay-outbox": {
        "task": "reliable_messaging.relay_outbox",
        "schedule": 2.0,
        "kwargs": {"max_seconds": 10.0},
    }
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        # run_demo, consume and relay log side by side: the pid says which process spoke.
        "plain": {"format": "%(asctime)s pid=%(process)d %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    # Not propagated: the Celery worker puts a handler on the root logger, which would print
    # every line a second time.
    "loggers": {
        "reliable_messaging": {"handlers": ["stderr"], "level": "INFO", "propagate": False}
    },
}

if os.environ.get("RM_TRACE_FILE"):
    # run_demo sets it for itself and the processes it starts (relay, consume, the Celery
    # worker): each exports its spans to that file, and run_demo prints one trace at the end.
    from demo_project.tracing import configure_from_env

    configure_from_env()
