"""System checks about the databases the app's models live in: routers that split the inbox
from the outbox or from the handlers' database, isolation levels above READ COMMITTED, and
SQLite (too old for RETURNING, or without IMMEDIATE transactions).

The aliases these tests add to ``DATABASES`` are never connected to: the checks read settings
only. Routers are classes of this module, installed with ``override_settings``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import Error, Tags, Warning, run_checks
from django.db.backends.postgresql.psycopg_any import IsolationLevel
from django.test import override_settings

from reliable_messaging.checks import check_database_routing, check_isolation_level, check_sqlite

APP = "reliable_messaging"
SQLITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}


def app_checks() -> list[Any]:
    """Every check registered under the app's tag, as ``manage.py check`` runs them. Not the
    model checks: from Django 6.1 on they ask each alias's features, which opens the test's
    extra SQLite alias outside the test database."""
    return run_checks(tags=[Tags.compatibility])


def ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages if (m.id or "").startswith("reliable_messaging."))


class AppTo:
    """A router that sends every model of the app to ``alias`` (and says nothing of others)."""

    alias = "default"

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == APP else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == APP else None


class AppToDefault(AppTo):
    alias = "default"


class AppToOther(AppTo):
    alias = "other"


class AppToLite(AppTo):
    alias = "lite"


class DeadLettersApart:
    """Dead letters to an archive database, the inbox and outbox left where they were."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "archive" if model.__name__ == "DeadLetter" else None


@pytest.fixture
def databases(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``databases(alias, settings_dict)`` adds an alias to DATABASES for one test."""

    def add(alias: str, config: dict[str, Any]) -> None:
        monkeypatch.setitem(settings.DATABASES, alias, config)

    yield add


def test_the_suite_settings_pass() -> None:
    messages = run_checks()
    assert not [m for m in ids(messages) if m[-3:] in {"030", "031", "032", "033"}]
    assert check_database_routing() == check_isolation_level() == check_sqlite() == []


# --------------------------------------------------------------------------- routing


def test_models_of_the_app_on_different_databases_are_reported(databases: Any) -> None:
    databases("archive", dict(SQLITE))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.DeadLettersApart"]):
        messages = check_database_routing()
        assert "reliable_messaging.W030" in ids(app_checks())
    assert ids(messages) == ["reliable_messaging.W030"]
    (warning,) = messages
    assert isinstance(warning, Warning)
    assert "DeadLetter to 'archive'" in warning.msg
    assert "ProcessedMessage to 'default'" in warning.msg
    assert "same alias" in (warning.hint or "")


def test_app_models_on_another_alias_than_default_are_reported(databases: Any) -> None:
    databases("other", dict(SQLITE, ENGINE="django.db.backends.postgresql"))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToOther"]):
        messages = check_database_routing()
    assert ids(messages) == ["reliable_messaging.W031"]
    assert "'other'" in messages[0].msg
    assert "the database the handlers write to" in (messages[0].hint or "")


def test_a_router_that_keeps_the_app_on_default_passes(databases: Any) -> None:
    databases("other", dict(SQLITE))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToDefault"]):
        assert check_database_routing() == []


def test_one_database_under_another_name_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only one alias: the handlers cannot write anywhere else.
    monkeypatch.setattr(settings, "DATABASES", {"other": dict(settings.DATABASES["default"])})
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToOther"]):
        assert check_database_routing() == []


# --------------------------------------------------------------------------- isolation


@pytest.mark.parametrize(
    ("engine", "level", "expected"),
    [
        ("django.db.backends.postgresql", IsolationLevel.SERIALIZABLE, ["W032"]),
        ("django.db.backends.postgresql", IsolationLevel.REPEATABLE_READ, ["E034"]),
        ("django.db.backends.postgresql", IsolationLevel.READ_COMMITTED, []),
        ("django.db.backends.postgresql", int(IsolationLevel.SERIALIZABLE), ["W032"]),
        ("django.db.backends.mysql", "repeatable read", ["W032"]),
        ("django.db.backends.mysql", "read committed", []),
    ],
)
def test_isolation_above_read_committed_is_reported(
    databases: Any, engine: str, level: Any, expected: list[str]
) -> None:
    databases("other", {"ENGINE": engine, "NAME": "x", "OPTIONS": {"isolation_level": level}})
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToOther"]):
        messages = check_isolation_level()
    assert ids(messages) == [f"reliable_messaging.{id_}" for id_ in expected]
    for message in messages:
        if message.id == "reliable_messaging.E034":
            assert "both copies would take effect" in message.msg
        else:
            assert "serialization failure" in message.msg and "IntegrityError" in message.msg
        assert "READ COMMITTED" in (message.hint or "")


def test_isolation_of_a_database_the_app_does_not_use_is_not_its_business(
    databases: Any,
) -> None:
    databases(
        "reports",
        {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "x",
            "OPTIONS": {"isolation_level": IsolationLevel.SERIALIZABLE},
        },
    )
    assert check_isolation_level() == []


# --------------------------------------------------------------------------- SQLite


def test_sqlite_too_old_for_returning_is_an_error(
    databases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    databases("lite", dict(SQLITE, OPTIONS={"transaction_mode": "IMMEDIATE"}))
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.31.1")
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToLite"]):
        messages = check_sqlite()
    assert ids(messages) == ["reliable_messaging.E030"]
    assert isinstance(messages[0], Error)
    assert "3.31.1" in messages[0].msg and "RETURNING" in messages[0].msg


def test_sqlite_without_immediate_transactions_is_reported(databases: Any) -> None:
    databases("lite", dict(SQLITE, OPTIONS={"timeout": 20}))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToLite"]):
        messages = check_sqlite()
        assert "reliable_messaging.W033" in ids(app_checks())
    assert ids(messages) == ["reliable_messaging.W033"]
    assert "database is locked" in messages[0].msg
    assert "'transaction_mode': 'IMMEDIATE'" in (messages[0].hint or "")


@pytest.mark.parametrize("mode", ["IMMEDIATE", "immediate"])
def test_sqlite_with_immediate_transactions_passes(databases: Any, mode: str) -> None:
    databases("lite", dict(SQLITE, OPTIONS={"transaction_mode": mode}))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.AppToLite"]):
        assert check_sqlite() == []


def test_the_demo_settings_pass_the_sqlite_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    import importlib.util
    from pathlib import Path

    # Read from its file, with DATABASE_URL unset (the SQLite database): importing the
    # demo_project package would create the demo's Celery app and make it this process's
    # current app, which other tests of this worker would then meet.
    path = Path(__file__).resolve().parents[2] / "demo_project" / "settings.py"
    spec = importlib.util.spec_from_file_location("demo_settings_read_by_a_test", path)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.setattr(settings, "DATABASES", demo.DATABASES)
    assert "sqlite3" in demo.DATABASES["default"]["ENGINE"]
    assert check_sqlite() == []
