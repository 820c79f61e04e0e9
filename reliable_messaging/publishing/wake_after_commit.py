"""Wake the relay after a publishing transaction commits, from outside that transaction
(``docs/design.md#waking-the-relay-after-a-commit``)."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from django.apps import apps
from django.db import connections

from .listener import NOTIFY_CHANNEL, listen_conninfo, quietly

logger = logging.getLogger("reliable_messaging.publish")

# After a failure an alias's wake-ups are dropped this long: one failed attempt per pause.
RETRY_PAUSE = 5.0
# A hung database must not keep the sender from noticing a dead connection.
CONNECT_TIMEOUT = 2
STATEMENT_TIMEOUT_MS = 2000
# The pause after each NOTIFY, doubling up to MAX_SPACING while commits keep coming in it.
SPACING = 0.005
MAX_SPACING = 0.1
# A process that stopped publishing gives its connection back after this long.
IDLE_CLOSE = 30.0
# How long a process's exit waits for the wake-ups it asked for.
EXIT_WAIT = 1.0


class WakeUpSender:
    """The process's sender of wake-ups: :meth:`request` is cheap, thread-safe, never raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the connections: the thread's, or close()'s
        self._due: set[str] = set()
        self._event = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit_hook = False
        self._pid = 0
        self._conninfo: dict[str, str] = {}
        self._connections: dict[str, Any] = {}
        self._retry_at: dict[str, float] = {}
        self._probes: dict[str, list[str]] = {}  # probe payloads to send, by alias
        self._keys: dict[str, set[str]] = {}  # keys of rows publish() wrote parked, by alias
        self.pause = SPACING  # after the next NOTIFY
        # Counters for tests and the benchmark: wake-ups asked for, NOTIFYs sent, failures.
        self.requested = 0
        self.sent = 0
        self.failed = 0

    def request(self, using: str) -> None:
        """Ask for one ``NOTIFY`` on ``using`` soon. Called after the commit it announces."""
        try:
            if using not in self._conninfo:
                # Read on a thread that has the alias's settings at hand.
                self._conninfo[using] = listen_conninfo(using)
            with self._lock:
                self.requested += 1
                self._due.add(using)
                self._ensure_thread()
            self._event.set()
        except Exception:  # a wake-up is never worth failing a caller for
            logger.debug("publish: could not ask for a wake-up of the relay", exc_info=True)

    def probe(self, using: str, token: str) -> None:
        """Ask for a ``NOTIFY`` carrying ``token``, sent as every wake-up is (a relay's probe)."""
        if not token.isalnum():
            raise ValueError(f"a probe token is letters and digits, got {token!r}")
        with self._lock:
            self._probes.setdefault(using, []).append(token)
        self.request(using)

    def release(self, using: str, key: str) -> None:
        """Ask for the key's first unsent row to be made due if it is parked, with the next
        ``NOTIFY``: after the commit of a row written parked behind rows sent meanwhile."""
        with self._lock:
            self._keys.setdefault(using, set()).add(key)
        self.request(using)

    def _ensure_thread(self) -> None:
        # After a fork the parent's thread and connections are not this process's.
        pid = os.getpid()
        if self._thread is not None and self._pid == pid and self._thread.is_alive():
            return
        if self._pid != pid:
            self._connections = {}
            self._retry_at = {}
        self._pid = pid
        self._thread = threading.Thread(
            target=self._run, name="reliable-messaging-wake-ups", daemon=True
        )
        self._thread.start()
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self._send_before_exit)

    def _send_before_exit(self) -> None:
        """At the process's exit: the wake-ups asked for go out first (bounded by EXIT_WAIT)."""
        with self._lock:
            pending = bool(self._due) or self._event.is_set()
            thread = self._thread
        if pending and thread is not None and thread.is_alive() and self._pid == os.getpid():
            self.flush(EXIT_WAIT)

    def _run(self) -> None:
        while True:
            if not self._event.wait(IDLE_CLOSE):
                self.close()
                continue
            with self._send_lock:
                with self._lock:
                    self._event.clear()
                    due, self._due = self._due, set()
                    probes, self._probes = self._probes, {}
                    keys, self._keys = self._keys, {}
                for using in due | set(probes):
                    self._notify(using, probes.get(using, ()), keys.get(using, ()))
            if due:
                time.sleep(self.pause)
                busy = self._event.is_set()  # commits came in during the pause
                self.pause = min(MAX_SPACING, self.pause * 2) if busy else SPACING

    def _notify(self, using: str, probes: Sequence[str] = (), keys: Iterable[str] = ()) -> None:
        # Keys dropped in a pause are released by the relay's sweep of parked rows.
        if time.monotonic() < self._retry_at.get(using, 0.0) and not probes:
            return
        try:
            connection = self._connections.get(using)
            if connection is None or connection.closed:
                connection = self._connections[using] = self._connect(using)
            from psycopg import ClientCursor
            from psycopg.errors import SerializationFailure

            release = ""
            if keys:
                table = apps.get_model("reliable_messaging", "OutboxMessage")._meta.db_table
                release = ClientCursor(connection).mogrify(release_next_sql(table), [sorted(keys)])
            try:
                connection.execute(notify_sql(probes, release))
            except SerializationFailure:
                # A row of those keys was sent meanwhile: the relay that sent it releases the
                # next one.
                connection.execute("ROLLBACK")
                connection.execute(notify_sql(probes))
        except Exception as exc:  # noqa: BLE001 - any failure: the relay's poll covers it
            self.failed += 1
            self._retry_at[using] = time.monotonic() + RETRY_PAUSE
            broken = self._connections.pop(using, None)
            if broken is not None:
                quietly(broken.close, "closing the wake-up connection")
            logger.warning(
                "publish: could not wake the relay on %r (%s); it finds the new rows on its "
                "next poll. Trying again in %ss",
                using,
                exc,
                RETRY_PAUSE,
            )
            return
        self.sent += 1

    def _connect(self, using: str) -> Any:
        import psycopg

        # Nothing prepared: behind a transaction-pooling PgBouncer the next server has none.
        return psycopg.connect(
            self._conninfo.get(using) or listen_conninfo(using),  # close() may have cleared it
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            prepare_threshold=None,
        )

    def flush(self, timeout: float = 5.0) -> bool:
        """Whether every wake-up asked for so far was sent or dropped within ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                idle = not self._due and not self._event.is_set()
            if idle:
                with self._send_lock:  # the thread is past the last batch it took
                    pass
                with self._lock:
                    if not self._due and not self._event.is_set():
                        return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Close the sender's connections; the idle thread reconnects if asked."""
        with self._send_lock:
            connections_, self._connections = self._connections, {}
            self._conninfo = {}
        for connection in connections_.values():
            quietly(connection.close, "closing the wake-up connection")


def release_next_sql(table: str) -> str:
    """The statement that makes the first unsent row of each key due if it is parked, the keys
    its one parameter (an array): the relay's after a send (``claims.release_next_of_keys``),
    and this sender's after a commit."""
    return (
        f'UPDATE "{table}" SET next_attempt_at = now() WHERE id IN ('  # noqa: S608
        f'SELECT (SELECT o.id FROM "{table}" o WHERE o.ordering_key = k.key'
        " AND o.status IN ('pending', 'failed') ORDER BY o.id LIMIT 1)"
        " FROM unnest(%s::text[]) AS k(key))"
        " AND status = 'pending' AND next_attempt_at IS NULL"
    )


def notify_sql(probes: Sequence[str] = (), release: str = "") -> str:
    """The wake-up and a NOTIFY per probe token, after ``release`` (a statement) if given, with
    ``SET LOCAL`` settings (for a pooler)."""
    statements = [release] if release else []
    statements.append(f"NOTIFY {NOTIFY_CHANNEL}")
    statements += [f"NOTIFY {NOTIFY_CHANNEL}, '{token}'" for token in probes]
    return (
        f"BEGIN; SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}; "
        f"SET LOCAL synchronous_commit = off; {'; '.join(statements)}; COMMIT"
    )


sender = WakeUpSender()

_can_notify: dict[str, bool] = {}


@functools.cache
def _callback(using: str) -> Any:
    """One callback per alias: a transaction's on-commit callbacks are searched for it."""
    return lambda: sender.request(using)


def _supported(using: str) -> bool:
    if using not in _can_notify:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            _can_notify[using] = False
        else:
            _can_notify[using] = connections[using].vendor == "postgresql"
    return _can_notify[using]


def release_after_commit(using: str, key: str) -> None:
    """Have :meth:`WakeUpSender.release` asked for ``key`` once the current transaction on
    ``using`` commits: its row was written parked, and the rows it waited behind may be sent
    before then, their release not seeing it (``docs/concepts.md``)."""
    if not _supported(using):
        return  # the relay's sweep of parked rows releases it
    connection = connections[using]
    if connection.in_atomic_block:
        connection.on_commit(functools.partial(sender.release, using, key))
    else:
        sender.release(using, key)


def wake_relay_after_commit(using: str) -> None:
    """Have the relay woken once the current transaction on ``using`` commits (one callback
    per transaction)."""
    if not _supported(using):
        return
    connection = connections[using]
    if connection.in_atomic_block:
        callback = _callback(using)
        for entry in connection.run_on_commit:
            if entry[1] is callback:
                return
        connection.on_commit(callback)
    else:
        sender.request(using)
