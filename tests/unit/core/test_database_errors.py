"""The classification of database errors (:mod:`reliable_messaging.core.database_errors`):
which ones hold a delivery, which ones run it again in place, which ones are the handler's."""

from __future__ import annotations

import logging
import sqlite3

import psycopg
import psycopg.errors
import pytest
from django.db import utils as django_db

from reliable_messaging.core.database_errors import (
    CONFLICT_BASE_DELAY,
    CONFLICT_MAX_DELAY,
    CONFLICT_RETRIES,
    DatabaseTrouble,
    OutageLog,
    classify,
    conflict_delay,
    sqlstate,
)

UNAVAILABLE = DatabaseTrouble.UNAVAILABLE
CONFLICT = DatabaseTrouble.CONFLICT


def wrapped(django_class: type[Exception], driver_error: BaseException) -> Exception:
    """What Django raises: its own class, ``from`` the driver's error."""
    try:
        raise django_class(str(driver_error)) from driver_error
    except django_class as exc:
        return exc


class _Psycopg2Error(Exception):
    def __init__(self, pgcode: str | None) -> None:
        super().__init__("psycopg2 error")
        self.pgcode = pgcode


# Stand-ins for psycopg2's errors (not installed here): the SQLSTATE is ``pgcode``.
Psycopg2Error = type("OperationalError", (_Psycopg2Error,), {"__module__": "psycopg2"})


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            wrapped(django_db.InternalError, psycopg.errors.ReadOnlySqlTransaction("ro")),
            UNAVAILABLE,
        ),
        (wrapped(django_db.OperationalError, psycopg.errors.AdminShutdown("bye")), UNAVAILABLE),
        (
            wrapped(
                django_db.IntegrityError,
                psycopg.errors.CheckViolation(
                    'no partition of relation "reliable_messaging_processedmessage" found for row'
                ),
            ),
            UNAVAILABLE,
        ),
        (
            wrapped(
                django_db.IntegrityError,
                psycopg.errors.CheckViolation('new row violates check constraint "positive"'),
            ),
            None,
        ),
        (wrapped(django_db.OperationalError, psycopg.errors.CrashShutdown("crash")), UNAVAILABLE),
        (
            wrapped(django_db.OperationalError, psycopg.errors.CannotConnectNow("start")),
            UNAVAILABLE,
        ),
        (
            wrapped(django_db.OperationalError, psycopg.errors.TooManyConnections("53300")),
            UNAVAILABLE,
        ),
        (wrapped(django_db.OperationalError, psycopg.errors.DiskFull("53100")), UNAVAILABLE),
        (
            wrapped(django_db.OperationalError, psycopg.errors.ConnectionFailure("08006")),
            UNAVAILABLE,
        ),
        # No SQLSTATE: the server never answered.
        (wrapped(django_db.OperationalError, psycopg.OperationalError("lost")), UNAVAILABLE),
        (wrapped(django_db.InterfaceError, psycopg.InterfaceError("closed")), UNAVAILABLE),
        (django_db.InterfaceError("connection already closed"), UNAVAILABLE),
        (wrapped(django_db.OperationalError, Psycopg2Error(None)), UNAVAILABLE),
        (wrapped(django_db.InternalError, Psycopg2Error("25006")), UNAVAILABLE),
        (wrapped(django_db.OperationalError, Psycopg2Error("40P01")), CONFLICT),
        (
            wrapped(django_db.OperationalError, psycopg.errors.DeadlockDetected("deadlock")),
            CONFLICT,
        ),
        (
            wrapped(django_db.OperationalError, psycopg.errors.SerializationFailure("40001")),
            CONFLICT,
        ),
        (
            wrapped(django_db.OperationalError, sqlite3.OperationalError("database is locked")),
            CONFLICT,
        ),
        # The handler's own failures.
        (wrapped(django_db.IntegrityError, psycopg.errors.UniqueViolation("dup")), None),
        (wrapped(django_db.OperationalError, psycopg.errors.QueryCanceled("timeout")), None),
        (wrapped(django_db.OperationalError, psycopg.errors.LockNotAvailable("55P03")), None),
        (wrapped(django_db.ProgrammingError, psycopg.errors.UndefinedTable("42P01")), None),
        (wrapped(django_db.DataError, psycopg.errors.DivisionByZero("22012")), None),
        (wrapped(django_db.OperationalError, sqlite3.OperationalError("no such table: x")), None),
        (django_db.OperationalError("raised by hand"), None),
        (RuntimeError("a handler's bug"), None),
        (KeyError("field"), None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_classify(error: BaseException, expected: DatabaseTrouble | None) -> None:
    assert classify(error) is expected


def test_a_handler_error_raised_from_a_deadlock_is_still_a_conflict() -> None:
    deadlock = wrapped(django_db.OperationalError, psycopg.errors.DeadlockDetected("deadlock"))
    try:
        raise ValueError("could not move the stock") from deadlock
    except ValueError as exc:
        assert classify(exc) is CONFLICT
        assert sqlstate(exc) == "40P01"


def test_an_error_merely_raised_while_handling_another_is_not_looked_through() -> None:
    read_only = wrapped(django_db.InternalError, psycopg.errors.ReadOnlySqlTransaction("ro"))
    try:
        try:
            raise read_only
        except django_db.InternalError:
            raise KeyError("the handler's own bug") from None
    except KeyError as exc:
        assert classify(exc) is None


def test_conflict_delays_are_small_growing_and_jittered() -> None:
    for retry in range(CONFLICT_RETRIES):
        delays = {conflict_delay(retry) for _ in range(20)}
        middle = min(CONFLICT_MAX_DELAY, CONFLICT_BASE_DELAY * 2**retry)
        assert all(middle * 0.5 <= d <= middle * 1.5 for d in delays)
        assert len(delays) > 1
    # The whole bound: a few seconds, not a hold.
    assert (
        sum(min(CONFLICT_MAX_DELAY, CONFLICT_BASE_DELAY * 2**r) for r in range(CONFLICT_RETRIES))
        < 6
    )


def test_an_outage_is_said_once_then_its_end_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outage = OutageLog(logging.getLogger("tests.outage"))
    error = wrapped(django_db.InternalError, psycopg.errors.ReadOnlySqlTransaction("read-only"))
    with caplog.at_level(logging.DEBUG, logger="tests.outage"):
        outage.recovered()  # nothing going on: says nothing
        for batch in (["a", "b"], ["c"], ["a"], ["d"]):
            outage.held(batch, error, 0.5)
        assert outage.ongoing
        outage.recovered()
        outage.recovered()
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert [r.levelname for r in loud] == ["WARNING", "INFO"], caplog.text
    assert "database unavailable" in loud[0].getMessage()
    assert "ReadOnlySqlTransaction" in loud[0].getMessage()
    assert "message_id=a and 1 more" in loud[0].getMessage()
    assert "4 deliveries were held" in loud[1].getMessage()
    assert "none charged" in loud[1].getMessage()
    assert not any(r.exc_info for r in caplog.records)
    assert not outage.ongoing
