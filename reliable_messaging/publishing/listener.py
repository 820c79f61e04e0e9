"""LISTEN for committed outbox rows, so that the relay wakes at once instead of polling
(``docs/design.md#when-the-relay-claims``)."""

from __future__ import annotations

import logging
import select
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from django.db import connections

from ..core.liveness import HealthState

logger = logging.getLogger("reliable_messaging.relay")

NOTIFY_CHANNEL = "reliable_messaging_outbox"
# A listener's probe must arrive this soon; one is sent when it opens and this often after.
PROBE_TIMEOUT = 5.0
PROBE_INTERVAL = 300.0

# Parameters Django's backend adds that are driver objects, not libpq settings.
_DRIVER_ONLY_PARAMS = frozenset({"cursor_factory", "context", "prepare_threshold"})


def listen_conninfo(using: str, dsn: str | None = None) -> str:
    """A libpq connection string from Django's parameters for ``using``, ``dsn``'s overriding."""
    import psycopg

    params = {
        key: str(value)
        for key, value in connections[using].get_connection_params().items()
        if key not in _DRIVER_ONLY_PARAMS and value is not None
    }
    if dsn:
        given = psycopg.conninfo.conninfo_to_dict(dsn).items()
        params.update({key: str(value) for key, value in given if value is not None})
    params.setdefault("connect_timeout", "5")
    return psycopg.conninfo.make_conninfo(**params)


def quietly(call: Callable[[], object], what: str) -> None:
    """Best effort: a failure of ``call`` (closing a broken connection, say) is logged at DEBUG."""
    try:
        call()
    except Exception:
        logger.debug("error %s", what, exc_info=True)


class OutboxListener:
    """An autocommit psycopg connection LISTENing; ImportError without psycopg 3."""

    def __init__(self, using: str, dsn: str | None = None) -> None:
        import psycopg

        # Nothing prepared (see wake_after_commit): the connection may go through a pooler.
        self.connection = psycopg.connect(
            listen_conninfo(using, dsn), autocommit=True, prepare_threshold=None
        )
        self.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")
        # Kept: once the server is gone psycopg raises for it, and the loop must still unwatch it.
        self._fd = self.connection.fileno()

    def fileno(self) -> int:
        return self._fd

    def drain(self) -> list[str]:
        """The payloads of the notifications that arrived (``""`` for a plain wake-up)."""
        pgconn = self.connection.pgconn
        pgconn.consume_input()
        payloads = []
        while (notify := pgconn.notifies()) is not None:
            payloads.append(notify.extra.decode(errors="replace"))
        return payloads

    def unlisten(self) -> None:
        """Best effort: through a pooler this reaches the server connection holding the LISTEN."""
        quietly(lambda: self.connection.execute(f"UNLISTEN {NOTIFY_CHANNEL}"), "sending UNLISTEN")

    def close(self) -> None:
        quietly(self.connection.close, "closing the LISTEN connection")


def listen_hears_notify(using: str, dsn: str | None, timeout: float = 3.0) -> bool | None:
    """Whether the relay's LISTEN hears the publishers' NOTIFY; None when it cannot tell."""
    if connections[using].vendor != "postgresql":
        return None
    try:
        import psycopg

        channel = f"{NOTIFY_CHANNEL}_probe_{uuid.uuid4().hex[:16]}"  # < 64 bytes
        with (
            psycopg.connect(listen_conninfo(using, dsn), autocommit=True) as listening,
            psycopg.connect(listen_conninfo(using), autocommit=True) as sending,
        ):
            listening.execute(f"LISTEN {channel}")
            sending.execute(f"NOTIFY {channel}")
            end = time.monotonic() + timeout
            heard = False
            while not heard and (left := end - time.monotonic()) > 0:
                if select.select([listening.fileno()], [], [], left)[0]:
                    listening.pgconn.consume_input()
                    while listening.pgconn.notifies() is not None:
                        heard = True
            listening.execute(f"UNLISTEN {channel}")
            return heard
    except Exception:  # a status report says "cannot tell", it does not fail
        logger.debug("the LISTEN probe could not run", exc_info=True)
        return None


class Loop(Protocol):
    """The I/O loop a listener's socket is watched by (a :class:`ConfirmingPublisher`)."""

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None: ...

    def unwatch(self, fd: int) -> None: ...


@dataclass(eq=False)
class WakeUps:
    """The relay's LISTEN connection on its I/O loop, :attr:`listening` once a probe reached it
    (a pooler's LISTEN hears nothing)."""

    using: str
    enabled: bool
    poll_interval: float
    _: KW_ONLY
    dsn: str | None = None
    send_probe: Callable[[str, str], None] | None = None
    health: HealthState | None = None

    def __post_init__(self) -> None:
        self._listener: OutboxListener | None = None
        self._loop: Loop | None = None
        self._retry_at = 0.0
        self._heard = False  # the last probe arrived
        self._probe: str | None = None  # the token awaited
        self._probe_deadline = 0.0
        self._next_probe = 0.0
        self._warned = False
        self._ever_heard = False  # a probe reached a listener of this process

    @property
    def listening(self) -> bool:
        """A LISTEN connection is open and heard its last probe: NOTIFY wakes the relay."""
        return self._listener is not None and (self._heard or self.send_probe is None)

    def look_after(self, loop: Loop, wake: Callable[[], None]) -> None:
        """Open the LISTEN connection on ``loop`` when due; send and judge the probes."""
        if self._listener is not None:
            self._look_after_probe()
            return
        if not self.enabled or time.monotonic() < self._retry_at:
            return
        try:
            listener = OutboxListener(self.using, self.dsn)
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
        self._heard, self._probe, self._next_probe = False, None, 0.0
        loop.watch_readable(listener.fileno(), lambda: self._on_readable(wake))
        self._look_after_probe()

    def _look_after_probe(self) -> None:
        if self.send_probe is None:
            return
        now = time.monotonic()
        if self._probe is not None and now >= self._probe_deadline:
            self._probe = None
            self._on_probe_lost()
            # Deaf: take the LISTEN back; one that never heard is behind a pooler: poll for good.
            if self._listener is not None:
                self._listener.unlisten()
            self.close()
            if not self._ever_heard:
                self.enabled = False
            self._retry_at = now + PROBE_INTERVAL
            return
        if self._probe is None and now >= self._next_probe:
            self._probe = uuid.uuid4().hex
            self._probe_deadline = now + PROBE_TIMEOUT
            self._next_probe = now + PROBE_INTERVAL
            self.send_probe(self.using, self._probe)

    def _on_probe_lost(self) -> None:
        self._heard = False
        note = (
            f"LISTEN on database {self.using!r} hears no NOTIFY (a transaction-pooling "
            f"PgBouncer in between?): polling every {self.poll_interval}s; set "
            f"RELAY_LISTEN_DSN to a direct connection"
        )
        if self.health is not None:
            self.health.note("listen", note)
        if self._warned:
            logger.debug("relay: the LISTEN probe was not heard again")
            return
        self._warned = True
        logger.warning(
            "relay: LISTEN on database %r hears nothing: a NOTIFY sent the way publish() sends "
            "its wake-ups did not arrive within %ss. A transaction-pooling PgBouncer between "
            "the relay and PostgreSQL does this (the LISTEN stays on a server connection it "
            "hands to others). The relay polls every %ss (RELAY_POLL_INTERVAL) instead of "
            "waking at once. To fix it, give the relay's LISTEN a direct session to "
            "PostgreSQL: RELIABLE_MESSAGING['RELAY_LISTEN_DSN'] (see the PgBouncer section of "
            "docs/deploy.md)",
            self.using,
            PROBE_TIMEOUT,
            self.poll_interval,
        )

    def _on_probe_heard(self) -> None:
        self._probe = None
        if self._heard:
            return
        self._heard = self._ever_heard = True
        if self._warned:
            logger.info("relay: LISTEN on database %r hears NOTIFY again", self.using)
        if self.health is not None:
            self.health.note("listen", None)

    def _on_readable(self, wake: Callable[[], None]) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            payloads = listener.drain()
        except Exception as exc:  # noqa: BLE001 - the database went away: poll meanwhile
            logger.warning("relay: LISTEN connection lost (%s); polling until it is back", exc)
            self.close()
            self._retry_at = time.monotonic() + 1
            return
        if self._probe is not None and self._probe in payloads:
            self._on_probe_heard()
        wake()

    def close(self, retry_at_once: bool = False) -> None:
        """Close the LISTEN connection; each broker connection's loop opens a fresh one."""
        listener, loop, self._listener, self._loop = self._listener, self._loop, None, None
        if retry_at_once:
            self._retry_at = 0.0
        if listener is None:
            return
        if loop is not None:
            loop.unwatch(listener.fileno())
        listener.close()
