"""LISTEN for committed outbox rows, so that the relay wakes at once instead of polling.

A trigger on the outbox table NOTIFYs ``NOTIFY_CHANNEL`` on every committed insert (migration
0002). The relay keeps one autocommit psycopg connection LISTENing and watches its socket from
its own I/O loop; a notification only wakes it to claim, it carries nothing the claim relies on,
so a lost one costs at most a poll interval.
"""

from __future__ import annotations

import logging

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
