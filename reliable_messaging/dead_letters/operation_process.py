"""The relay's child process that carries out the bulk operations (:mod:`.operations`), why a
process and how it stops: ``docs/design.md#dead-letters-replay-and-bulk-operations``. It imports
no model: a spawned child imports it before Django is set up."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from functools import partial
from multiprocessing.connection import Connection


class OperationProcess:
    """An :class:`OperationRunner` in a spawned child process, stopped by closing a pipe (an
    Event's set() waits for its waiters, so a child that died inside its wait hung the relay)."""

    def __init__(self, *, batch_size: int, notify_channel: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop_seen, self._stop_sent = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_run_in_child,
            args=(batch_size, notify_channel, self._stop_seen, list(sys.path), os.getpid()),
            kwargs={"settings": os.environ.get("DJANGO_SETTINGS_MODULE", "")},
            name="dead-letter-operations",
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()
        self._stop_seen.close()  # the child has its own copy

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch under way."""
        self._stop_sent.close()  # the child reads the end of the pipe
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(5)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a no-op elsewhere)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_in_child(
    batch_size: int,
    notify_channel: str | None,
    stop: Connection,
    path: list[str],
    parent: int,
    *,
    settings: str,
) -> None:
    _die_with_parent()
    # The relay stops it by closing ``stop``: a signal to the whole group must not cut a batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.path[:] = path
    if settings:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", settings)
    import django

    django.setup()
    from .operations import OperationRunner

    on_batch = partial(_notify, notify_channel) if notify_channel else None
    runner = OperationRunner(batch_size=batch_size, on_batch=on_batch)
    runner.start()
    while not stop.poll(1.0):  # readable at the end of the pipe: the relay closed it, or died
        if os.getppid() != parent:  # the relay is gone (where no death signal could be asked)
            break
    runner.stop()


def _notify(channel: str) -> None:
    """Wake the relays listening on ``channel`` (PostgreSQL's NOTIFY)."""
    from django.db import connections, router

    from ..models import DeadLetterOperation

    using = router.db_for_write(DeadLetterOperation)
    if connections[using].vendor == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [channel])
