"""The dead-letter pages read no whole table, whatever its size.

Twenty thousand dead letters are written with ``generate_series`` and analyzed. Each page is
fetched with its SQL captured, and every captured query on the dead letters must be one an
index can answer (its ``EXPLAIN`` with sequential scans priced out shows none of them),
besides carrying none of the shapes that read everything: ``SELECT DISTINCT``, ``MIN``/``MAX``
(``date_hierarchy``) or a ``COUNT`` not bounded by a ``LIMIT``. The timings themselves are
``bench/admin.py``'s.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from reliable_messaging.models import DeadLetter, LiveDeadLetterGroup
from reliable_messaging.ops.collectors import DatabaseCollector, database_status
from tests.markers import postgresql_only

from .conftest import CHANGELIST, GROUPS

TABLE = DeadLetter._meta.db_table
QUOTED = f'"{TABLE}"'  # not the groups table, whose name starts with the same letters
ROWS = 20_000
CONSUMERS = 40  # a consumer's share is small, as one of many after an outage

# PostgreSQL's planner, its statistics and its trigram indexes are what is tested.
pytestmark = postgresql_only


@pytest.fixture
def many_dead_letters(db: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {TABLE} (
                message_id, consumer, queue, exchange, routing_key, headers, payload, body,
                content_type, reason, exception_type, exception_message, traceback, attempts,
                first_failed_at, last_failed_at, status, replay_count, fingerprint, history,
                created_at, updated_at)
            SELECT 'scale-' || i, 'scale.consumer-' || (i %% {CONSUMERS}),
                   'scale.queue-' || (i %% {CONSUMERS}), 'x', 'order.placed', '{{}}',
                   jsonb_build_object('order_id', i, 'customer', 'cust-' || i), '\\x00',
                   'application/json', 'retries_exhausted', 'billing.Error' || (i %% 4),
                   'gateway answered 503 for order ' || i, 'Traceback', 6,
                   now() - i * interval '1 second', now() - i * interval '1 second',
                   CASE WHEN i %% 10 = 0 THEN 'resolved' ELSE 'dead' END, 0,
                   'fp' || (i %% 4), '[]', now(), now()
            FROM generate_series(1, %s) AS i
            """,
            [ROWS],
        )
        cursor.execute(f"ANALYZE {TABLE}")


def _reads_every_row(sql: str) -> str | None:
    """Why ``sql`` reads the whole dead-letter table, or None."""
    if QUOTED not in sql or sql.lstrip().upper().startswith("EXPLAIN"):
        return None
    upper = sql.upper()
    if "SELECT DISTINCT" in upper:
        return "SELECT DISTINCT"
    if re.search(r"\b(MIN|MAX)\(", upper):
        return "MIN/MAX"
    if "COUNT(" in upper and "LIMIT" not in upper:
        return "COUNT without LIMIT"
    if not upper.lstrip().startswith("SELECT"):
        return None
    with connection.cursor() as cursor:
        # Asked "can an index answer it?", not "does the planner prefer one on this small
        # table?": sequential scans only cost more (a query no index answers still shows one),
        # and the choice does not flip with the dead tuples earlier tests left behind.
        cursor.execute("SET enable_seqscan = off")
        try:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET enable_seqscan")
    if re.search(rf"Seq Scan on {TABLE}\b(?!group)", plan):
        return f"a sequential scan:\n{plan}"
    return None


def assert_no_whole_table_read(queries: list[dict[str, Any]]) -> None:
    found = [(query["sql"], why) for query in queries if (why := _reads_every_row(query["sql"]))]
    assert not found, "\n\n".join(f"{why}\n  in {sql}" for sql, why in found)


def fetched(admin: Client, url: str, **query: str) -> tuple[Any, list[dict[str, Any]]]:
    with CaptureQueriesContext(connection) as captured:
        response = admin.get(url, query)
    assert response.status_code == 200
    return response, captured.captured_queries


def shown(response: Any) -> list[str]:
    return [letter.message_id for letter in response.context["cl"].result_list]


def test_the_list_unfiltered(admin: Client, many_dead_letters: None) -> None:
    response, queries = fetched(admin, CHANGELIST)

    assert shown(response)[:2] == ["scale-1", "scale-2"]  # the latest first
    assert "about 20" in response.content.decode()  # the planner's estimate, not a count
    assert_no_whole_table_read(queries)


def test_the_list_filtered_by_consumer(admin: Client, many_dead_letters: None) -> None:
    response, queries = fetched(admin, CHANGELIST, consumer="scale.consumer-7")

    assert shown(response)[:2] == ["scale-7", "scale-47"]
    assert response.context["cl"].result_count == ROWS // CONSUMERS
    assert "?consumer=scale.consumer-39" in response.content.decode()  # offered, from groups
    assert_no_whole_table_read(queries)


def test_an_exact_message_id(admin: Client, many_dead_letters: None) -> None:
    response, queries = fetched(admin, CHANGELIST, q="scale-12345")

    assert shown(response) == ["scale-12345"]
    assert_no_whole_table_read(queries)
    # Compared as it is: no UPPER() that the message_id index cannot answer.
    assert not [q for q in queries if "UPPER" in q["sql"] and "message_id" in q["sql"]]


def test_words_of_the_exception_or_payload(admin: Client, many_dead_letters: None) -> None:
    by_message, message_queries = fetched(admin, CHANGELIST, q="order 1234")
    by_payload, payload_queries = fetched(admin, CHANGELIST, q='"cust-1999"')

    assert set(shown(by_message)) >= {"scale-1234", "scale-12340"}
    assert all("1234" in m for m in shown(by_message))
    assert shown(by_payload)[0] == "scale-1999"  # the latest first
    assert set(shown(by_payload)) == {"scale-1999", *(f"scale-1999{n}" for n in range(10))}
    assert_no_whole_table_read(message_queries + payload_queries)


def test_a_filtered_count_is_bounded(
    admin: Client, many_dead_letters: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reliable_messaging.admin import scaling

    monkeypatch.setattr(scaling, "COUNT_UP_TO", 100)
    monkeypatch.setattr(scaling.BoundedCountPaginator, "COUNT_UP_TO", 100)
    # As when the planner expects few rows: the count runs, up to its bound.
    monkeypatch.setattr(
        scaling.BoundedCountPaginator, "_estimate", staticmethod(lambda queryset: None)
    )
    response, queries = fetched(admin, CHANGELIST, q="gateway")

    assert response.context["cl"].paginator.capped
    assert "more than 100 dead letters" in response.content.decode()
    assert_no_whole_table_read(queries)


def test_the_failure_groups_and_a_detail_page(admin: Client, many_dead_letters: None) -> None:
    groups, group_queries = fetched(admin, GROUPS, all="1")
    letter = DeadLetter.objects.get(message_id="scale-8")
    detail, detail_queries = fetched(
        admin, reverse("admin:reliable_messaging_deadletter_change", args=[letter.pk])
    )

    rows = groups.context["rows"]
    assert len(rows) == CONSUMERS  # one fingerprint each; 4 of them with nothing left dead
    assert sum(row["dead"] for row in rows) == ROWS - ROWS // 10
    assert sum(row["total"] for row in rows) == ROWS
    assert "5000 dead letters fail this way" in detail.content.decode()
    assert not [q for q in group_queries if "GROUP BY" in q["sql"] and QUOTED in q["sql"]]
    assert_no_whole_table_read(group_queries + detail_queries)


def test_the_scrape_and_messaging_status_count_no_dead_letter(many_dead_letters: None) -> None:
    with CaptureQueriesContext(connection) as captured:
        status = database_status()
        families = {family.name: family for family in DatabaseCollector().collect()}

    assert sum(count.count for count in status.dead_letters) == ROWS - ROWS // 10
    samples = families["reliable_messaging_dead_letters"].samples
    assert sum(s.value for s in samples if s.labels["status"] == "resolved") == ROWS // 10
    assert not [q["sql"] for q in captured.captured_queries if QUOTED in q["sql"]]
    assert LiveDeadLetterGroup.objects.count() == CONSUMERS
