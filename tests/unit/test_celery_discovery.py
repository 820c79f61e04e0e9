"""A project's Celery app finds ``reliable_messaging.relay_outbox`` the usual way: its
``app.autodiscover_tasks()`` imports ``reliable_messaging.tasks``, as the demo's app does.

It runs in a fresh interpreter: in the test process another test may have imported the task's
module already, and a shared task joins every app once imported, discovered or not.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT

SCRIPT = """
import django
from celery import Celery

django.setup()
app = Celery("project", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.loader.import_default_modules()  # what a worker does as it starts: discovery runs here
print("reliable_messaging.relay_outbox" in app.tasks)
"""


def test_autodiscover_tasks_registers_relay_outbox() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True", result.stdout
