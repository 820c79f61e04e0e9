"""The relay's database worker threads: the I/O loop never waits on the database."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

logger = logging.getLogger("reliable_messaging.relay")


class DatabaseWorker:
    """Runs database jobs one at a time on a thread and connection of its own."""

    def __init__(self, name: str) -> None:
        self.batch: Any = None  # I/O loop only: the batch whose transaction it holds
        self.claiming = False  # I/O loop only
        self.claimed: Any = None  # a claim's answer, handed to the I/O loop
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def free(self) -> bool:
        """Neither claiming nor holding a batch in flight (it may still be recording one)."""
        return not (self.claiming or self.batch is not None)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                try:
                    if job is None:
                        return
                    job()
                except Exception:
                    # A bug to see, never a reason to stop recording batches.
                    logger.exception("relay: unexpected error in database work")
                finally:
                    self._jobs.task_done()
        finally:
            connections.close_all()  # this thread's connections
