"""The relay's child process that carries out the bulk operations (:mod:`.operations`).

A process, not a thread of the relay: a batch is mostly Python work that would hold the GIL
while the relay's I/O thread, whose pipelined confirms are sensitive to latency, waits for it.
After each batch's commit it NOTIFYs the channel the relays LISTEN on, so they claim the
batch's rows at once. It dies with the relay (on Linux by ``PR_SET_PDEATHSIG``, elsewhere at
its next look), so a killed relay's batch rolls back whole. This module imports no model: a
spawned child imports it before Django is set up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from typing import Any

DEFAULT_BATCH_SIZE = 1000


class OperationProcess:
    """An :class:`OperationRunner` in a child process of its own (spawned, so it shares
    nothing with its parent but the settings), stopped with the parent."""

    def __init__(
        self, *, batch_size: int = DEFAULT_BATCH_SIZE, notify_channel: str | None = None
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._process = context.Process(
            target=_run_in_child,
            args=(batch_size, notify_channel, self._stop, list(sys.path), os.getpid()),
            kwargs={"settings": os.environ.get("DJANGO_SETTINGS_MODULE", "")},
            name="dead-letter-operations",
            daemon=True,
        )

    def start(self) -> None:
        self._process.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the batch under way."""
        self._stop.set()
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
    stop: Any,
    path: list[str],
    parent: int,
    *,
    settings: str,
) -> None:
    _die_with_parent()
    # The relay stops it through ``stop``; a terminal's Ctrl-C or a supervisor's SIGTERM to
    # the whole group must not cut a batch short either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
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
    while not stop.wait(1.0):
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
