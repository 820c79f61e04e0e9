"""A small process supervisor for fault tests: restarts a ``manage.py`` process whenever it
exits, as systemd's ``Restart=always`` or a Kubernetes pod would, but a bounded number of times.

A poison pill that kills its process is only a crash *loop* under such a supervisor; without one
it is a single dead process. The supervisor watches from a background thread, so restarts happen
whatever the test is waiting for, and it records every exit code. When its restart budget runs
out it gives up (the crash loop the product must break did not end), and :meth:`check` turns that
into a test failure that shows every process's exit code and the tail of its log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from tests.support import ManageProcess

P = TypeVar("P", bound=ManageProcess)


class SupervisorGaveUp(AssertionError):
    """The supervised process kept exiting: the restart budget ran out."""


class Supervisor(Generic[P]):
    """Runs ``start()`` and starts it again each time its process exits, at most
    ``max_restarts`` times, ``restart_delay`` seconds after the exit; never longer than
    ``lifetime`` seconds in all. Use :meth:`stop` in a ``finally``."""

    def __init__(
        self,
        start: Callable[[], P],
        *,
        max_restarts: int,
        restart_delay: float = 0.2,
        lifetime: float = 240.0,
    ) -> None:
        self._start = start
        self.max_restarts = max_restarts
        self.restart_delay = restart_delay
        self.lifetime = lifetime
        self.processes: list[P] = []
        self.exit_codes: list[int] = []
        self.gave_up = False
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rm-test-supervisor", daemon=True)

    def start(self) -> P:
        first = self._spawn()
        self._thread.start()
        return first

    @property
    def current(self) -> P:
        with self._lock:
            return self.processes[-1]

    @property
    def restarts(self) -> int:
        with self._lock:
            return len(self.processes) - 1

    def _spawn(self) -> P:
        proc = self._start()
        with self._lock:
            self.processes.append(proc)
        return proc

    def _watch(self) -> None:
        deadline = time.monotonic() + self.lifetime
        try:
            while not self._stop.wait(0.05) and time.monotonic() < deadline:
                code = self.current.returncode
                if code is None:
                    continue
                self.exit_codes.append(code)
                if self.restarts >= self.max_restarts:
                    self.gave_up = True
                    return
                if self._stop.wait(self.restart_delay):
                    return
                self._spawn()
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc

    def check(self) -> None:
        """Raise (with every log's tail) if the supervisor gave up or broke; for use inside
        ``wait_until`` predicates, so a crash loop fails the test at once."""
        if self.error is not None:
            raise AssertionError(f"the supervisor failed: {self.error!r}\n{self.report()}")
        if self.gave_up:
            raise SupervisorGaveUp(
                f"the process kept exiting: restarted {self.restarts} times (the budget), "
                f"exit codes {self.exit_codes}\n{self.report()}"
            )

    def report(self, tail: int = 2500) -> str:
        """Restarts, exit codes and the last ``tail`` characters of each process's log."""
        with self._lock:
            processes = list(self.processes)
        parts = [f"supervisor: {len(processes) - 1} restart(s), exit codes {self.exit_codes}"]
        for number, proc in enumerate(processes, 1):
            parts.append(
                f"--- process {number} pid {proc.pid} exit code {proc.returncode}, log tail:\n"
                f"{proc.log()[-tail:]}"
            )
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop restarting, then kill whatever still runs."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(15)
        with self._lock:
            processes = list(self.processes)
        for proc in processes:
            proc.close()
