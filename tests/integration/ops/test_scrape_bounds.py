"""The scrape never counts a whole table, even when PostgreSQL's statistics lag behind it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import CollectorRegistry

from reliable_messaging import publish
from reliable_messaging.models import OutboxMessage, ProcessedMessage
from reliable_messaging.ops import collectors
from reliable_messaging.storage import partitions
from tests.markers import postgresql_only

pytestmark = [
    pytest.mark.django_db,
    postgresql_only,
]


# Never analyzed yet, or analyzed when it held 3 rows (autovacuum off, or not there yet).
@pytest.mark.parametrize("statistics", [None, 3.0])
def test_an_inbox_grown_past_its_statistics_is_counted_only_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch, statistics: float | None
) -> None:
    monkeypatch.setattr(collectors, "COUNT_INBOX_UP_TO", 5)
    monkeypatch.setattr(collectors.partitions, "estimated_rows", lambda *args: statistics)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="tests.c", message_id=f"m-{n}") for n in range(12)
    )

    with CaptureQueriesContext(connection) as captured:
        rows, estimated = collectors.inbox_rows("default")

    assert (rows, estimated) == (6.0, True)  # "more than 5", not 12 counted
    counts = [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]
    assert counts and all("LIMIT 6" in sql for sql in counts)


def test_a_small_inbox_is_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectors, "COUNT_INBOX_UP_TO", 50)
    monkeypatch.setattr(collectors.partitions, "estimated_rows", lambda *args: None)
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="tests.c", message_id=f"m-{n}") for n in range(12)
    )

    assert collectors.inbox_rows("default") == (12.0, False)


def _schedule(rows: int) -> None:
    for n in range(rows):
        publish("order.remind", {"order": n}, delay=3600 + n)


def _scheduled_gauge() -> float:
    registry = CollectorRegistry()
    registry.register(collectors.DatabaseCollector())
    value = registry.get_sample_value("reliable_messaging_outbox_scheduled_messages")
    assert value is not None
    return value


@pytest.mark.django_db(transaction=True)
def test_many_scheduled_messages_are_estimated_by_the_gauge_not_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scheduled gauge switches to the statistics of the scheduled partition as the inbox
    gauge does (here 30 rows analyzed, then 10 cancelled unseen by the statistics)."""
    monkeypatch.setattr(collectors, "COUNT_SCHEDULED_UP_TO", 20)
    _schedule(30)
    with connection.cursor() as cursor:
        cursor.execute(f'ANALYZE "{partitions.OUTBOX_SCHEDULED}"')
    OutboxMessage.objects.filter(pk__in=OutboxMessage.objects.order_by("pk")[:10]).delete()

    with CaptureQueriesContext(connection) as captured:
        gauge = _scheduled_gauge()
        status = collectors.database_status()

    assert gauge == 30.0  # the statistics, not the 20 left
    assert status.outbox_scheduled == 30
    assert not [
        q for q in captured.captured_queries if "COUNT(" in q["sql"] and "'scheduled'" in q["sql"]
    ]


def test_a_few_scheduled_messages_are_counted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectors, "COUNT_SCHEDULED_UP_TO", 20)
    monkeypatch.setattr(collectors.partitions, "estimated_rows", lambda *args: 15.0)
    _schedule(12)

    assert _scheduled_gauge() == 12.0
    assert collectors.scheduled_rows("default") == (12.0, False)
