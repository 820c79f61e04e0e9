"""A real ``celery worker`` subprocess for the tests that need one, and its fixture's helper.

The worker runs ``tests.integration.celery_tasks.celery_app`` with Celery's default prefork pool on
one queue of the test's own, against the test database; its output goes to a log file that a failing
assertion quotes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.conftest import database_url
from tests.support import ROOT, wait_until


class CeleryWorker:
    """``celery -A tests.integration.celery_tasks.celery_app worker --pool prefork`` on
    ``queue``."""

    def __init__(
        self,
        queue: str,
        log_path: Path,
        *,
        concurrency: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.queue = queue
        self.log_path = log_path
        environment = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url(),
            "RM_CELERY_QUEUE": queue,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.integration.celery_tasks.celery_app",
                "worker",
                # Celery's default pool: each task runs in a child process the test can kill.
                "--pool",
                "prefork",
                "--concurrency",
                str(concurrency),
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--queues",
                queue,
                "--hostname",
                f"{queue}@%h",
            ],
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert self.popen.poll() is None, f"the worker exited early:\n{self.log()}"
            return " ready." in self.log()

        wait_until(ready, timeout=timeout, interval=0.1, message="the Celery worker to start")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()  # warm shutdown: finishes the task in hand
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)
        self._log.close()
