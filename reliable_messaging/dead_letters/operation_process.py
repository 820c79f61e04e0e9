"""The relay's child process that carries out the bulk operations (:mod:`.operations`).

A process, not a thread of the relay: a batch is mostly Python work that would hold the GIL
while the relay's I/O thread, whose pipelined confirms are sensitive to latency, waits for it.
After each batch's commit it NOTIFYs the channel the relays LISTEN on, so they claim the
batch's rows at once. It dies with the relay (on Linux by ``PR_SET_PDEATHSIG``, elsewhere at
its next look), so a killed relay's batch rolls back whole. The relay alone stops it: the child
ignores SIGTERM and SIGINT, which a supervisor sends to the whole process group (systemd's
``KillMode=control-group``, a terminal's Ctrl-C). This module imports no model: a spawned child
imports it before Django is set up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import Connection

DEFAULT_BATCH_SIZE = 1000


class OperationProcess:
    """An :class:`OperationRunner` in a child process of its own (spawned, so it shares
    nothing with its parent but the settings), stopped with the parent.

    The stop is the end of a pipe, not a shared ``multiprocessing.Event``: an Event's set()
    waits for its waiters to wake, so a child that took a signal (or died) inside its wait
    left the relay waiting for ever."""

    def __init__(
        self, *, batch_size: int = DEFAULT_BATCH_SIZE, notify_channel: str | None = None
    ) -> None:
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
    # The relay stops it by closing ``stop``, after its own lanes: a terminal's Ctrl-C or a
    # supervisor's SIGTERM to the whole group must not cut a batch short, nor run a handler
    # in the middle of the wait below.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.path[:] = path
    if settings:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", settings)
    import django

    django.setup()
    from .operations import OperationRunner

    on_batch = None
    if notify_channel:
        on_batch = lambda: _notify(notify_channel)  # noqa: E731
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
