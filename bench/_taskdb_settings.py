"""Settings of the django-tasks-db side of ``bench/tasks.py``: run by ``bench/_taskdb.py`` with
the interpreter of a virtualenv of its own (django-tasks-db is never installed in the
project's), on the bench database, writing the same ``tests.testapp`` row."""

import os
from urllib.parse import urlsplit

_url = urlsplit(os.environ["DATABASE_URL"])
SECRET_KEY = "bench-only"
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "django_tasks_db", "tests.testapp"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "postgres",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": _url.port or 5432,
        "CONN_MAX_AGE": 60,
    }
}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_tasks": {"level": "WARNING"}, "django.tasks": {"level": "WARNING"}},
}
