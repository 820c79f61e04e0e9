"""Settings of the test suite: PostgreSQL, RabbitMQ and Redis on this machine.

``RM_TEST_NAMESPACE`` isolates broker objects: the exchange and every test queue carry it, so a
failed run leaves nothing that breaks the next one. A test that starts ``manage.py consume`` in a
subprocess passes its own namespace (and the test database's URL) in the environment.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from datetime import timedelta

import dj_database_url

from tests.support import BROKER

_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ.get("RM_TEST_NAMESPACE_WORKER") != _WORKER:
    # A pytest-xdist worker: its own namespace, not the one the controller made (the workers
    # inherit it, and would share the session consumers' queues). Its subprocesses inherit
    # the marker, and keep the namespace they are given.
    os.environ["RM_TEST_NAMESPACE"] = f"t{uuid.uuid4().hex[:10]}"
    os.environ["RM_TEST_NAMESPACE_WORKER"] = _WORKER
NAMESPACE = os.environ.setdefault("RM_TEST_NAMESPACE", f"t{uuid.uuid4().hex[:10]}")

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "reliable_messaging",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
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

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/reliable_messaging")
    )
}
if os.environ.get("RM_TEST_DB_NAME"):
    # Two suites running at once on one machine each need a test database of their own.
    DATABASES["default"]["TEST"] = {"NAME": os.environ["RM_TEST_DB_NAME"]}
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    # The duplicate fast path's cache; keys carry the namespace so runs never share them.
    "messaging": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ.get("RM_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": f"rmtest.{NAMESPACE}",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
    },
}

RELIABLE_MESSAGING = {
    # RM_TEST_BROKER=rabbitmq4 or rabbitmq43: the RabbitMQ 4.0 or 4.3 node (tests/support.py).
    "BROKER_URL": os.environ.get("RM_BROKER_URL", BROKER.url),
    "EXCHANGE": f"rmtest.{NAMESPACE}",
    "RETRY_DELAYS": [0.2, 0.4, 0.8],
    "MAX_ATTEMPTS": 3,
    "DEDUP_RETENTION": timedelta(days=1),
    "SHUTDOWN_TIMEOUT": 15.0,
    "RECONNECT_MAX_DELAY": 2.0,
    "MAX_BODY_BYTES": 64 * 1024,
    # RM_TEST_CACHE_ALIAS=messaging turns the Redis fast path on (subprocesses of a test).
    "CACHE_ALIAS": os.environ.get("RM_TEST_CACHE_ALIAS") or None,
    "QUEUE_TYPE": os.environ.get("RM_TEST_QUEUE_TYPE", "classic"),
    # Fault tests of one subprocess tune these through its environment.
    "QUORUM_DELIVERY_LIMIT": int(os.environ.get("RM_TEST_QUORUM_DELIVERY_LIMIT", "50")),
    "PREFETCH": int(os.environ.get("RM_TEST_PREFETCH", "100")),
    "CONSUMER_BATCH_SIZE": int(os.environ.get("RM_TEST_CONSUMER_BATCH_SIZE", "50")),
    "CRASH_LIMIT": int(os.environ.get("RM_TEST_CRASH_LIMIT", "3")),
    "HANDLER_TIMEOUT": float(os.environ.get("RM_TEST_HANDLER_TIMEOUT", "600")),
    "HANDLER_TIMEOUT_GRACE": float(os.environ.get("RM_TEST_HANDLER_TIMEOUT_GRACE", "10")),
    "BROKER_CONSUMER_TIMEOUT": float(os.environ.get("RM_TEST_BROKER_CONSUMER_TIMEOUT", "1800")),
    "HEARTBEAT": int(os.environ.get("RM_TEST_HEARTBEAT", "60")),
    # None: the broker's host on 15672, as for users who do not set it; the RabbitMQ 4 nodes
    # beside the system's have their management API on a port of their own.
    "MANAGEMENT_URL": os.environ.get("RM_TEST_MANAGEMENT_URL")
    or (None if BROKER.name == "rabbitmq3" else BROKER.management_url),
}
if os.environ.get("RM_TEST_CONSUMER_BATCH_SIZE"):
    RELIABLE_MESSAGING["CONSUMER_BATCH_SIZE"] = int(os.environ["RM_TEST_CONSUMER_BATCH_SIZE"])
if os.environ.get("RM_TEST_PGBOUNCER"):
    # The run through a transaction-pooling PgBouncer (tests/conftest.py points DATABASES at it
    # once it runs): the relays LISTEN on a direct session, as docs/deploy.md tells users to.
    RELIABLE_MESSAGING["RELAY_LISTEN_DSN"] = "host=127.0.0.1 port=5432"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    # RM_LOG_LEVEL: the benchmarks run consume processes with WARNING (no line per message).
    "loggers": {
        "reliable_messaging": {
            "handlers": ["console"],
            "level": os.environ.get("RM_LOG_LEVEL", "INFO"),
        }
    },
}
# RM_DEFAULT_LOGGING: no LOGGING at all, as in a project fresh from startproject.
if os.environ.get("RM_DEFAULT_LOGGING"):
    del LOGGING
# RM_ROOT_LOG_LEVEL: a root logger with a handler too, as many projects configure it (then
# pika's own lines show as well).
if os.environ.get("RM_ROOT_LOG_LEVEL"):
    LOGGING["root"] = {"handlers": ["console"], "level": os.environ["RM_ROOT_LOG_LEVEL"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The django.tasks backend (docs/tasks.md). Before Django 6.0 the framework is the django-tasks
# backport (the tasks extra), an app of its own. TASKS names our backend only in the processes
# of the task tests (RM_TEST_TASKS=1): with it the app registers the consumers of the task
# queues, and every other test's `manage.py consume` would consume them too. Its task queues
# carry the namespace like every test queue.
_BUILT_IN_TASKS = importlib.util.find_spec("django.tasks") is not None
if not _BUILT_IN_TASKS and importlib.util.find_spec("django_tasks") is not None:
    INSTALLED_APPS.append("django_tasks")
if os.environ.get("RM_TEST_TASKS") and (_BUILT_IN_TASKS or "django_tasks" in INSTALLED_APPS):
    TASKS = {
        "default": {
            "BACKEND": "reliable_messaging.contrib.task_backend.ReliableTaskBackend",
            "QUEUES": ["default", "other"],
            "OPTIONS": {"QUEUE_PREFIX": f"{NAMESPACE}.tasks."},
        }
    }

if os.environ.get("RM_TRACE_FILE"):
    # The tracing tests' processes (tests/e2e/test_tracing.py): spans to a JSON-lines file.
    from tests.trace_file import configure_from_env

    configure_from_env()
