"""The scrape never counts a whole table, even when PostgreSQL's statistics lag behind it."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from reliable_messaging.models import ProcessedMessage
from reliable_messaging.ops import collectors
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
