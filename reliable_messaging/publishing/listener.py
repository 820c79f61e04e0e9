"""LISTEN for committed outbox rows, so that the relay wakes at once instead of polling.

``publish()`` has ``NOTIFY_CHANNEL`` notified after each transaction that wrote outbox rows
commits, from a connection of its own (:mod:`.wake_after_commit`; until migration 0013 a trigger
on the outbox table did it inside the publishing transaction). The relay keeps one autocommit
psycopg connection LISTENing and watches its socket from
its own I/O loop; a notification only wakes it to claim, it carries nothing the claim relies on,
so a lost one costs at most a poll interval.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from django.db import connections

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")

NOTIFY_CHANNEL = "reliable_messaging_outbox"

# Connection parameters Django's PostgreSQL backend adds that are Python objects of the driver,
# not libpq settings: the LISTEN connection has no use for them.
_DRIVER_ONLY_PARAMS = frozenset({"cursor_factory", "context", "prepare_threshold"})


def listen_conninfo(using: str) -> str:
    """A libpq connection string for the LISTEN connection, built from the parameters Django's
    own connection to ``using`` uses, so ``OPTIONS`` (``service``, ``sslmode``, ``options``,
    ``application_name``, ...) apply to it as to every other connection of the project."""
    import psycopg

    params = {
        key: str(value)
        for key, value in connections[using].get_connection_params().items()
        if key not in _DRIVER_ONLY_PARAMS and value is not None
    }
    params.setdefault("connect_timeout", "5")
    return psycopg.conninfo.make_conninfo(**params)


class OutboxListener:
    """A dedicated autocommit psycopg connection LISTENing for committed outbox inserts.

    Raises ImportError without psycopg 3, and the driver's error when it cannot connect."""

    def __init__(self, using: str) -> None:
        import psycopg

        self.connection = psycopg.connect(listen_conninfo(using), autocommit=True)
        self.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def fileno(self) -> int:
        return self.connection.fileno()

    def drain(self) -> int:
        """Read what arrived; returns how many notifications there were. Raises when the
        connection is broken."""
        pgconn = self.connection.pgconn
        pgconn.consume_input()
        count = 0
        while pgconn.notifies() is not None:
            count += 1
        return count

    def close(self) -> None:
        try:
            self.connection.close()
        except Exception:
            logger.debug("error closing the LISTEN connection", exc_info=True)


class Loop(Protocol):
    """The I/O loop a listener's socket is watched by (a :class:`ConfirmingPublisher`)."""

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None: ...

    def unwatch(self, fd: int) -> None: ...


class WakeUps:
    """The relay's LISTEN connection on its I/O loop: opened (and opened again after a failure)
    by :meth:`look_after`, it calls ``wake`` after each batch of notifications. While it is
    down the relay polls; with psycopg 3 missing it says so once and polls for good."""

    def __init__(self, using: str, enabled: bool, poll_interval: float) -> None:
        self.using = using
        self.enabled = enabled
        self.poll_interval = poll_interval
        self._listener: OutboxListener | None = None
        self._loop: Loop | None = None
        self._retry_at = 0.0

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def look_after(self, loop: Loop, wake: Callable[[], None]) -> None:
        """Open the LISTEN connection on ``loop`` if it is not open and its retry is due."""
        if not self.enabled or self._listener is not None or time.monotonic() < self._retry_at:
            return
        try:
            listener = OutboxListener(self.using)
        except ImportError as exc:
            # Not going to change while this process runs: say it once and poll from now on.
            self.enabled = False
            logger.warning(
                "relay: cannot LISTEN for new outbox rows (%s): psycopg 3 is needed for it; "
                'pip install "reliable-messaging[postgres]". Polling every %ss meanwhile',
                exc,
                self.poll_interval,
            )
            return
        except Exception as exc:  # noqa: BLE001 - any failure: poll and try again later
            self._retry_at = time.monotonic() + 5
            logger.warning(
                "relay: cannot LISTEN for new outbox rows (%s); polling every %ss",
                exc,
                self.poll_interval,
            )
            return
        self._listener, self._loop = listener, loop
        loop.watch_readable(listener.fileno(), lambda: self._on_readable(wake))

    def _on_readable(self, wake: Callable[[], None]) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            listener.drain()
        except Exception as exc:  # noqa: BLE001 - the database went away: poll meanwhile
            logger.warning("relay: LISTEN connection lost (%s); polling until it is back", exc)
            self.close()
            self._retry_at = time.monotonic() + 1
            return
        wake()

    def close(self, retry_at_once: bool = False) -> None:
        """Close the LISTEN connection. Each broker connection has its own I/O loop, and the
        socket is watched by the loop it was added to: the relay closes it with the old loop
        (``retry_at_once``) and the new loop opens a fresh one. (Kept, it would sit on a loop
        that no longer runs: no wake-ups, and notifications piling up unread.)"""
        listener, loop, self._listener, self._loop = self._listener, self._loop, None, None
        if retry_at_once:
            self._retry_at = 0.0
        if listener is None:
            return
        if loop is not None:
            loop.unwatch(listener.fileno())
        listener.close()
