"""``purge_messages`` (retention of inbox and sent outbox rows) and the retention-horizon check."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage, ProcessedMessage
from reliable_messaging.storage import partitions
from tests.markers import ON_POSTGRESQL

pytestmark = pytest.mark.django_db

DAY = dt.timedelta(days=1)


def outbox_row(name: str, status: str, *, age: dt.timedelta) -> OutboxMessage:
    """A row created, tried and (if sent) sent ``age`` ago."""
    when = timezone.now() - age
    # The sent side has a partition per day and no default one: make the row's day.
    partitions.ensure_partitions("default", now=when, spec=partitions.OUTBOX)
    row = OutboxMessage.objects.create(
        message_id=name,
        routing_key="r.k",
        body="{}",
        status=status,
        attempts=0 if status != OutboxStatus.FAILED else 10,
        sent_at=when if status in (OutboxStatus.SENT, OutboxStatus.UNROUTED) else None,
    )
    # Backdate every timestamp, so only the status can protect pending and failed rows.
    OutboxMessage.objects.filter(pk=row.pk).update(
        created_at=when, next_attempt_at=when, sent_at=when
    )
    return row


def inbox_row(name: str, *, age: dt.timedelta) -> ProcessedMessage:
    partitions.ensure_partitions("default", now=timezone.now() - age)  # the row's day
    row = ProcessedMessage.objects.create(consumer="tests.c", message_id=name)
    ProcessedMessage.objects.filter(pk=row.pk).update(processed_at=timezone.now() - age)
    return row


def purge(*args: str) -> str:
    out = io.StringIO()
    call_command("purge_messages", *args, stdout=out)
    return out.getvalue()


def remaining() -> tuple[set[str], set[str]]:
    return (
        set(OutboxMessage.objects.values_list("message_id", flat=True)),
        set(ProcessedMessage.objects.values_list("message_id", flat=True)),
    )


@pytest.fixture
def mixed_rows() -> None:
    # Test settings: DEDUP_RETENTION = 1 day, OUTBOX_RETENTION = 7 days (the default).
    outbox_row("sent-old", OutboxStatus.SENT, age=8 * DAY)
    outbox_row("sent-recent", OutboxStatus.SENT, age=6 * DAY)
    outbox_row("pending-old", OutboxStatus.PENDING, age=60 * DAY)
    outbox_row("failed-old", OutboxStatus.FAILED, age=60 * DAY)
    inbox_row("inbox-old", age=2 * DAY)
    inbox_row("inbox-recent", age=recent_inbox_age())


def recent_inbox_age() -> dt.timedelta:
    """An hour, or less when today (UTC) began less than an hour ago: the inbox is purged a
    whole day at a time, and "recent" must mean "in today's partition" at any time of day
    (at 00:40 a row an hour old is in yesterday's, which a 30-minute retention drops whole)."""
    now = timezone.now()
    since_midnight = now - now.replace(hour=0, minute=0, second=0, microsecond=0)
    return min(dt.timedelta(hours=1), since_midnight / 2)


def test_purge_deletes_old_sent_outbox_and_old_inbox_rows_only(mixed_rows: None) -> None:
    output = purge()
    assert "deleted 1 inbox row(s)" in output
    assert "1 sent outbox row(s)" in output
    assert remaining() == (
        {"sent-recent", "pending-old", "failed-old"},
        {"inbox-recent"},
    )
    # Nothing left to do the second time.
    assert "deleted 0 inbox row(s)" in purge() and remaining()[0] == {
        "sent-recent",
        "pending-old",
        "failed-old",
    }


def test_dry_run_reports_counts_and_deletes_nothing(mixed_rows: None) -> None:
    before = remaining()
    output = purge("--dry-run")
    assert "would delete 1 inbox row(s)" in output
    assert "and 1 sent outbox row(s)" in output
    assert remaining() == before


def test_purge_works_in_batches(mixed_rows: None) -> None:
    for n in range(10):
        outbox_row(f"batch-sent-{n}", OutboxStatus.SENT, age=30 * DAY)
        inbox_row(f"batch-inbox-{n}", age=3 * DAY)
    with CaptureQueriesContext(connection) as queries:
        output = purge("--batch-size", "3")
    assert "deleted 11 inbox row(s)" in output
    assert "and 11 sent outbox row(s)" in output
    assert remaining() == ({"sent-recent", "pending-old", "failed-old"}, {"inbox-recent"})
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    outbox_deletes = [sql for sql in deletes if "outboxmessage" in sql]
    inbox_deletes = [sql for sql in deletes if "processedmessage" in sql]
    if ON_POSTGRESQL:
        # Every expired row sits in a day partition (there is no default one): the days are
        # dropped whole, no row is deleted.
        assert not outbox_deletes and not inbox_deletes, deletes
    else:
        # 11 rows 3 at a time: 4 bounded deletes per table, never one big one.
        assert len(outbox_deletes) == 4 and len(inbox_deletes) == 4, deletes


def test_purge_follows_the_retention_settings(mixed_rows: None) -> None:
    values = {
        **settings.RELIABLE_MESSAGING,
        "OUTBOX_RETENTION": dt.timedelta(days=5),
        "DEDUP_RETENTION": dt.timedelta(minutes=30),
    }
    with override_settings(RELIABLE_MESSAGING=values):
        output = purge()
    # The inbox goes a whole day at a time: the recent row is in today's partition, kept until
    # the day has expired (up to a day past DEDUP_RETENTION), even when older than 30 minutes.
    assert "deleted 1 inbox row(s) older than 0:30:00" in output
    assert "and 2 sent outbox row(s) older than 5 days" in output
    assert remaining() == ({"pending-old", "failed-old"}, {"inbox-recent"})


def test_batch_size_must_be_positive() -> None:
    with pytest.raises(CommandError, match="--batch-size"):
        purge("--batch-size", "0")


def check_ids() -> set[str]:
    return {str(message.id) for message in run_checks()}


def test_check_warns_when_dedup_retention_is_shorter_than_the_retry_horizon() -> None:
    assert "reliable_messaging.W002" not in check_ids()
    values = {
        **settings.RELIABLE_MESSAGING,
        "RETRY_DELAYS": [60, 300, 900],
        "MAX_ATTEMPTS": 5,  # horizon 60 + 300 + 900 + 900 s = 36 min
        "DEDUP_RETENTION": dt.timedelta(minutes=30),
    }
    with override_settings(RELIABLE_MESSAGING=values):
        messages = [m for m in run_checks() if m.id == "reliable_messaging.W002"]
        assert len(messages) == 1
        assert "DEDUP_RETENTION" in messages[0].msg and "0:36:00" in messages[0].msg
    with override_settings(RELIABLE_MESSAGING={**values, "DEDUP_RETENTION": dt.timedelta(hours=1)}):
        assert "reliable_messaging.W002" not in check_ids()
