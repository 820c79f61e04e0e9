"""The relay's database worker threads.

The relay's I/O loop (pika's ``SelectConnection``) must never wait on PostgreSQL: claims, leases
and the recording of batches run on worker threads, each with its own database connection, so
that publishing and taking confirms overlap with the database work (on two cores the two run
side by side instead of taking turns).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")


class DatabaseWorker:
    """Runs database jobs one at a time on a thread of its own with its own connection.

    A batch's rows stay locked by its claim's transaction on its worker's connection until the
    batch is recorded, so each batch in flight has a worker of its own."""

    def __init__(self, name: str) -> None:
        # Set and read on the I/O loop only: the batch whose transaction this worker's
        # connection holds, and whether a claim was given to it.
        self.batch: Any = None
        self.claiming = False
        # A claim's answer, handed from this worker's thread to the I/O loop.
        self.claimed: Any = None
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def free(self) -> bool:
        """Neither claiming nor holding a batch in flight (it may still be recording one: a
        claim given to it runs after that)."""
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
                    # Jobs handle their own database errors; anything else is a bug to see,
                    # never a reason for the relay to stop recording batches.
                    logger.exception("relay: unexpected error in database work")
                finally:
                    self._jobs.task_done()
        finally:
            connections.close_all()  # this thread's connections
