"""What the database may do to a delivery without charging it an attempt: :func:`classify`
sorts an error into UNAVAILABLE, CONFLICT or None (the handler's failure), without a database
(``docs/design.md#database-errors-that-charge-nothing``)."""

from __future__ import annotations

import enum
import logging
import random
import threading
import time

from .backoff import exponential

logger = logging.getLogger(__name__)


class DatabaseTrouble(enum.Enum):
    UNAVAILABLE = "unavailable"
    CONFLICT = "conflict"


# Runs of a delivery after a conflict, beyond the first, before it is charged: about 5 s of
# pauses in all (0.05 s doubling to 1 s, jittered).
CONFLICT_RETRIES = 8
CONFLICT_BASE_DELAY = 0.05
CONFLICT_MAX_DELAY = 1.0

UNAVAILABLE_CLASSES = ("08", "53")
UNAVAILABLE_STATES = frozenset({"25006", "57P01", "57P02", "57P03", "57P04", "57P05", "3D000"})
CONFLICT_STATES = frozenset({"40001", "40P01"})
# A row for a day no inbox or outbox partition holds: a check violation told apart by its text.
CHECK_VIOLATION = "23514"
NO_PARTITION_TEXT = "no partition of relation"
SQLITE_CONFLICT_TEXTS = ("database is locked", "database table is locked")
_POSTGRESQL_DRIVERS = ("psycopg", "psycopg2")
_NO_ANSWER_TYPES = ("OperationalError", "InterfaceError")


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of ``exc`` or of the driver error it wraps (``None`` when there is none)."""
    for error in _chain(exc):
        code = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if isinstance(code, str) and code:
            return code
    return None


def classify(exc: BaseException) -> DatabaseTrouble | None:
    """What ``exc`` (a database error, possibly wrapped by Django) is, for a delivery:
    unavailable, a conflict to run again, or ``None`` (the handler's own failure)."""
    code = sqlstate(exc)
    if code is not None:
        if code in CONFLICT_STATES:
            return DatabaseTrouble.CONFLICT
        if code in UNAVAILABLE_STATES or code[:2] in UNAVAILABLE_CLASSES:
            return DatabaseTrouble.UNAVAILABLE
        if code == CHECK_VIOLATION and NO_PARTITION_TEXT in str(exc):
            return DatabaseTrouble.UNAVAILABLE
        return None
    for error in _chain(exc):
        module = type(error).__module__.split(".")[0]
        if module == "sqlite3":
            text = str(error).lower()
            if any(locked in text for locked in SQLITE_CONFLICT_TEXTS):
                return DatabaseTrouble.CONFLICT
            return None
        if module in _POSTGRESQL_DRIVERS:
            # A driver error with no SQLSTATE: the server never answered.
            if any(cls.__name__ in _NO_ANSWER_TYPES for cls in type(error).__mro__):
                return DatabaseTrouble.UNAVAILABLE
            return None
    # Django's own InterfaceError ("connection already closed") wraps nothing.
    if type(exc).__module__.startswith("django.db") and type(exc).__name__ == "InterfaceError":
        return DatabaseTrouble.UNAVAILABLE
    return None


def describe(exc: BaseException) -> str:
    """One line for a log: the innermost error's class (the driver's) and its first line."""
    innermost = _chain(exc)[-1]
    text = str(innermost).strip()
    return f"{type(innermost).__name__}: {text.splitlines()[0] if text else ''}"


def conflict_delay(retry: int) -> float:
    """Seconds before run ``retry`` (0-based) after a conflict: small, doubling, jittered so
    that the two sides of a deadlock do not meet again in step."""
    return exponential(CONFLICT_BASE_DELAY, retry, CONFLICT_MAX_DELAY) * random.uniform(0.5, 1.5)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (``raise ... from``), outermost first."""
    seen: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in seen and len(seen) < 10:
        seen.append(error)
        error = error.__cause__
    return seen


class OutageLog:
    """Says once per process that the database is unavailable (:meth:`held`, a WARNING, then
    DEBUG), and once that it is back (:meth:`recovered`: how long, how many held)."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._since: float | None = None
        self._held = 0
        self._ids: set[str] = set()

    @property
    def ongoing(self) -> bool:
        return self._since is not None

    def held(self, message_ids: list[str], error: BaseException, retry_in: float) -> None:
        """``message_ids`` are held unacked because of ``error``; tried again in ``retry_in``s."""
        with self._lock:
            first = self._since is None
            if first:
                self._since = time.monotonic()
            fresh = [m for m in message_ids if m not in self._ids]
            self._ids.update(fresh)
            self._held += len(fresh)
        if first:
            self._log.warning(
                "database unavailable (%s); message_id=%s%s: holding deliveries unacked "
                "and retrying with backoff, nothing is charged to the handlers; said once until "
                "it is back",
                describe(error),
                message_ids[0] if message_ids else "-",
                f" and {len(message_ids) - 1} more" if len(message_ids) > 1 else "",
            )
        else:
            self._log.debug(
                "database still unavailable (%s); message_id=%s: holding it, retrying in %.1fs",
                describe(error),
                message_ids[0] if message_ids else "-",
                retry_in,
            )

    def recovered(self) -> None:
        """A database operation succeeded: ends the outage, if one was going on."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            lasted = time.monotonic() - self._since
            held = self._held
            self._since = None
            self._held = 0
            self._ids.clear()
        self._log.info(
            "database available again after %.1fs; %d deliveries were held meanwhile, none "
            "charged an attempt",
            lasted,
            held,
        )
