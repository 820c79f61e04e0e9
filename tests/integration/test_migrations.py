"""Migrations match the models, and the app migrates to zero and back on PostgreSQL."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests.support import MANAGE


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:  # --check exits 1 when a model change has no migration
        pytest.fail(
            f"makemigrations --check found changes without a migration:\n"
            f"{out.getvalue()} (exit {exc.code})"
        )


def rm_tables() -> set[str]:
    with connection.cursor() as cursor:
        names = connection.introspection.table_names(cursor)
    return {n for n in names if n.startswith("reliable_messaging_")}


@pytest.mark.django_db(transaction=True)
def test_migrate_to_zero_and_back() -> None:
    assert {"reliable_messaging_processedmessage", "reliable_messaging_deadletter"} <= rm_tables()
    out = io.StringIO()
    call_command("migrate", "reliable_messaging", "zero", verbosity=1, stdout=out)
    assert rm_tables() == set(), out.getvalue()
    call_command("migrate", "reliable_messaging", verbosity=1, stdout=out)
    assert {"reliable_messaging_processedmessage", "reliable_messaging_deadletter"} <= rm_tables()
    # The constraints are back too.
    ProcessedMessage.objects.create(consumer="c", message_id="m")
    with pytest.raises(Exception, match="duplicate key value violates unique constraint"):
        ProcessedMessage.objects.create(consumer="c", message_id="m")
    DeadLetter.objects.create(consumer="c", message_id="", queue="q", body=b"", reason="x")
    DeadLetter.objects.create(consumer="c", message_id="", queue="q", body=b"", reason="x")


def migrate_sqlite(database: Path, *target: str) -> None:
    """``manage.py migrate TARGET`` on the SQLite file ``database``, in a process of its own."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{database}",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    env.pop("RM_TEST_DB_NAME", None)
    subprocess.run(
        [sys.executable, str(MANAGE), "migrate", *target, "--verbosity", "0"],
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
    )


def test_0008_migrates_forwards_and_back_on_sqlite(tmp_path: Path) -> None:
    """The online operations fall back to the usual ones on SQLite."""
    database = tmp_path / "inbox.sqlite3"

    def migrate(*target: str) -> None:
        migrate_sqlite(database, *target)

    def indexes() -> set[str]:
        """The table's index names, and its unique constraint as written in its SQL."""
        with sqlite3.connect(database) as db:
            rows = db.execute(
                "SELECT name, sql FROM sqlite_master WHERE tbl_name = ?",
                ["reliable_messaging_processedmessage"],
            ).fetchall()
        names = {name for name, _ in rows if not name.startswith("sqlite_autoindex")}
        unique = {
            unique
            for _, sql in rows
            for unique in ('UNIQUE ("message_id", "consumer")', 'UNIQUE ("consumer", "message_id")')
            if sql and unique in sql
        }
        return names | unique

    migrate()
    after = indexes()
    assert after == {
        "reliable_messaging_processedmessage",
        "rm_inbox_consumer_idx",
        "rm_inbox_processed_at_idx",
        'UNIQUE ("message_id", "consumer")',
    }
    migrate("reliable_messaging", "0007")
    before = indexes()
    assert before == {
        "reliable_messaging_processedmessage",
        "rm_inbox_message_id_idx",
        "rm_inbox_processed_at_idx",
        'UNIQUE ("consumer", "message_id")',
    }
    migrate()
    assert indexes() == after
    with sqlite3.connect(database) as db:
        db.execute(
            "INSERT INTO reliable_messaging_processedmessage (consumer, message_id, processed_at)"
            " VALUES ('c', 'm', '2024-01-01')"
        )
        with pytest.raises(sqlite3.IntegrityError):
            db.execute(
                "INSERT INTO reliable_messaging_processedmessage"
                " (consumer, message_id, processed_at) VALUES ('c', 'm', '2024-01-02')"
            )


def test_0014_makes_the_idempotency_key_partially_unique_on_sqlite(tmp_path: Path) -> None:
    """Elsewhere than PostgreSQL, 0014 is Django's own AlterField and AddConstraint: the column
    loses UNIQUE, a unique index of the keys that are not NULL takes its place; and back."""
    database = tmp_path / "outbox.sqlite3"
    table = "reliable_messaging_outboxmessage"

    def schema() -> dict[str, str]:
        with sqlite3.connect(database) as db:
            rows = db.execute(
                "SELECT name, sql FROM sqlite_master WHERE tbl_name = ? AND sql IS NOT NULL",
                [table],
            ).fetchall()
        return {name: sql for name, sql in rows}

    partial = (
        'CREATE UNIQUE INDEX "rm_outbox_idem_uniq" ON "reliable_messaging_outboxmessage" '
        '("idempotency_key") WHERE "idempotency_key" IS NOT NULL'
    )
    migrate_sqlite(database)
    assert schema()["rm_outbox_idem_uniq"] == partial
    assert '"idempotency_key" varchar(255) NULL' in schema()[table]
    assert '"idempotency_key" varchar(255) NULL UNIQUE' not in schema()[table]
    migrate_sqlite(database, "reliable_messaging", "0013")
    assert "rm_outbox_idem_uniq" not in schema()
    assert '"idempotency_key" varchar(255) NULL UNIQUE' in schema()[table]
    migrate_sqlite(database)
    assert schema()["rm_outbox_idem_uniq"] == partial

    insert = (
        f"INSERT INTO {table} (message_id, exchange, routing_key, body, headers, status, "
        "attempts, last_error, created_at, idempotency_key) "
        "VALUES (?, '', 'a.b', '{}', '{}', 'pending', 0, '', '2024-01-01', ?)"
    )
    with sqlite3.connect(database) as db:
        db.executemany(insert, [("a", None), ("b", None), ("c", "k")])
        with pytest.raises(sqlite3.IntegrityError):
            db.execute(insert, ["d", "k"])
