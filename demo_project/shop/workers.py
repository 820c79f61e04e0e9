"""The long-running processes of the demo: ``manage.py relay``, ``manage.py consume`` and a
Celery worker with its embedded beat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

MANAGE_PY = Path(__file__).resolve().parents[2] / "manage.py"


class Worker:
    """A command run as a child process, its output in ``<log_dir>/<name>.log``."""

    def __init__(self, name: str, command: Sequence[str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(command),
            cwd=MANAGE_PY.parent,
            # Same settings and DATABASE_URL as this process: they are in the environment.
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own session, so a Ctrl-C at the terminal reaches only the demo, which then
            # stops the worker with a single SIGTERM (a second signal would make it exit at once).
            start_new_session=True,
        )

    @classmethod
    def manage(cls, name: str, args: Sequence[str], log_dir: Path) -> Worker:
        """``manage.py ARGS``."""
        return cls(name, [sys.executable, str(MANAGE_PY), *args], log_dir)

    @classmethod
    def celery(cls, name: str, log_dir: Path, *, concurrency: int) -> Worker:
        """A Celery worker of the demo's app with the beat scheduler embedded (``-B``)."""
        return cls(
            name,
            [
                sys.executable,
                "-m",
                "celery",
                "--app",
                "demo_project",
                "worker",
                "--beat",
                "--schedule",
                str(log_dir / "celerybeat-schedule"),
                "--loglevel",
                "INFO",
                "--concurrency",
                str(concurrency),
                "--hostname",
                "demo@%h",
                # Nothing to synchronise with: no other workers, no monitoring.
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            log_dir,
        )

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """Ask for a graceful stop."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> int:
        """Wait until ``deadline`` (a ``time.monotonic()`` value), then kill it with every
        process it started (a Celery worker's pool and beat); the exit code."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: its process group
            self.process.wait()
        self._log.close()
        return self.process.returncode


def stop_all(workers: Sequence[Worker], timeout: float) -> dict[str, int]:
    """SIGTERM every worker at once, then wait for each within ``timeout`` in total."""
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + timeout
    return {worker.name: worker.wait(deadline) for worker in workers}
