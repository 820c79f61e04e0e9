"""Migrations match the models, and the app migrates to zero and back on PostgreSQL."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.db import connection

from reliable_messaging.models import DeadLetter, ProcessedMessage


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
    with pytest.raises(Exception, match="rm_inbox_consumer_message_uniq"):
        ProcessedMessage.objects.create(consumer="c", message_id="m")
    DeadLetter.objects.create(consumer="c", message_id="", queue="q", body=b"", reason="x")
    DeadLetter.objects.create(consumer="c", message_id="", queue="q", body=b"", reason="x")
