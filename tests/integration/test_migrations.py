"""The migration matches the models, and the app migrates to zero and back, on PostgreSQL (the
partitioned inbox and outbox, the failure groups' triggers) and on SQLite."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.models import (
    DeadLetter,
    LiveDeadLetterGroup,
    OutboxMessage,
    ProcessedMessage,
)
from reliable_messaging.storage import partitions
from tests.markers import postgresql_only
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


@postgresql_only
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
    # The triggers count them into their failure group, read through the view.
    assert LiveDeadLetterGroup.objects.get(consumer="c").total == 2
    # Partitioned again, with the coming days made.
    now = timezone.now()
    for spec in (partitions.INBOX, partitions.OUTBOX):
        assert partitions.is_partitioned("default", spec)
        assert (partitions.days_ahead("default", now, spec) or 0) >= partitions.AHEAD_DAYS
    with transaction.atomic():
        publish("a.b", {"n": 1})
    assert OutboxMessage.objects.pending().count() == 1


@postgresql_only
@pytest.mark.django_db
def test_a_task_run_has_no_index_nothing_reads() -> None:
    """Django gives a character primary key a second index for LIKE: the task's id is only
    looked up whole, and each enqueue and status change would write that index too."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'reliable_messaging_taskrun'"
        )
        found = sorted(row[0].split(" USING ")[1] for row in cursor.fetchall())
    assert found == ["btree (enqueued_at DESC)", "btree (id)", "btree (status, enqueued_at DESC)"]


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


def test_the_app_migrates_to_zero_and_back_on_sqlite(tmp_path: Path) -> None:
    """Plain tables, with the models' constraints and indexes, and none left at zero."""
    database = tmp_path / "messaging.sqlite3"

    def schema() -> dict[str, str]:
        with sqlite3.connect(database) as db:
            rows = db.execute(
                "SELECT name, sql FROM sqlite_master "
                "WHERE tbl_name LIKE 'reliable_messaging_%' AND sql IS NOT NULL"
            ).fetchall()
        return {name: sql for name, sql in rows}

    migrate_sqlite(database)
    made = schema()
    assert {
        "reliable_messaging_processedmessage",
        "reliable_messaging_outboxmessage",
        "reliable_messaging_deadletter",
        "reliable_messaging_deadlettergroup",
        "reliable_messaging_deadlettergroupdelta",
        "reliable_messaging_deadletteroperation",
        "reliable_messaging_suspectdelivery",
        "rm_inbox_consumer_idx",
        "rm_outbox_due_idx",
    } <= set(made)
    assert "reliable_messaging_livedeadlettergroup" not in made  # a view on PostgreSQL only
    assert 'UNIQUE ("message_id", "consumer")' in made["reliable_messaging_processedmessage"]
    assert made["rm_outbox_idem_uniq"] == (
        'CREATE UNIQUE INDEX "rm_outbox_idem_uniq" ON "reliable_messaging_outboxmessage" '
        '("idempotency_key") WHERE "idempotency_key" IS NOT NULL'
    )
    migrate_sqlite(database, "reliable_messaging", "zero")
    assert schema() == {}
    migrate_sqlite(database)
    assert schema() == made

    insert = (
        "INSERT INTO reliable_messaging_outboxmessage (message_id, exchange, routing_key, body, "
        "headers, status, attempts, last_error, created_at, idempotency_key) "
        "VALUES (?, '', 'a.b', '{}', '{}', 'pending', 0, '', '2024-01-01', ?)"
    )
    with sqlite3.connect(database) as db:
        db.executemany(insert, [("a", None), ("b", None), ("c", "k")])
        with pytest.raises(sqlite3.IntegrityError):
            db.execute(insert, ["d", "k"])
