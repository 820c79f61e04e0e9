"""Every admin page of the app costs the database a bounded amount, and a GET writes nothing.

The outbox and the inbox get 20,000 rows each across their partitions (written with
``generate_series``, then analyzed); each list and search is fetched with its SQL captured, and
every query on the table must be one its indexes answer in every partition (its ``EXPLAIN``
with sequential scans priced out shows none), with none of the shapes that read everything
(``SELECT DISTINCT``, ``MIN``/``MAX``, a ``COUNT`` without ``LIMIT``, ``UPPER()``). The
timings are ``bench/admin.py``'s.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from django.contrib import admin as django_admin
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from reliable_messaging.admin import scaling
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterGroupDelta,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
    SuspectDelivery,
)
from tests.markers import postgresql_only

from .conftest import CHANGELIST, GROUPS, staff_user

pytestmark = postgresql_only

OUTBOX = OutboxMessage._meta.db_table
INBOX = ProcessedMessage._meta.db_table
ROWS = 20_000
UNSENT = 500  # pending and failed: the relay's working set, small


@pytest.fixture
def big_outbox(db: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {OUTBOX} (message_id, exchange, routing_key, body, headers,
                idempotency_key, status, attempts, last_error, next_attempt_at, created_at,
                sent_at)
            SELECT 'out-' || i, 'x', 'order.placed.' || (i %% 50), '{{"n": 1}}', '{{}}',
                   CASE WHEN i %% 3 = 0 THEN 'idem-' || i END,
                   CASE WHEN i <= {UNSENT} THEN (CASE WHEN i %% 2 = 0 THEN 'failed'
                        ELSE 'pending' END) ELSE 'sent' END,
                   1, CASE WHEN i <= {UNSENT} AND i %% 2 = 0 THEN 'refused' ELSE '' END,
                   now(), now() - i * interval '1 second',
                   CASE WHEN i > {UNSENT} THEN now() - i * interval '1 second' END
            FROM generate_series(1, %s) AS i
            """,
            [ROWS],
        )
        cursor.execute(f"ANALYZE {OUTBOX}")


@pytest.fixture
def big_inbox(db: None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {INBOX} (consumer, message_id, processed_at)
            SELECT 'inbox.consumer-' || (i %% 5), 'in-' || i, now() - i * interval '1 second'
            FROM generate_series(1, %s) AS i
            """,
            [ROWS],
        )
        cursor.execute(f"ANALYZE {INBOX}")


def _reads_every_row(sql: str, table: str) -> str | None:
    """Why ``sql`` reads every row of ``table`` (any of its partitions), or None."""
    if f'"{table}"' not in sql or sql.lstrip().upper().startswith(("EXPLAIN", "SELECT SET_")):
        return None
    upper = sql.upper()
    for shape, pattern in (
        ("SELECT DISTINCT", r"SELECT DISTINCT"),
        ("MIN/MAX", r"\b(MIN|MAX)\("),
        ("UPPER()", r"\bUPPER\("),
    ):
        if re.search(pattern, upper):
            return shape
    if "COUNT(" in upper and "LIMIT" not in upper:
        return "COUNT without LIMIT"
    if not upper.lstrip().startswith("SELECT"):
        return None
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # the test's transaction only
        cursor.execute(f"EXPLAIN {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("SET LOCAL enable_seqscan = on")
    # The outbox's unsent partition has no message_id index, on purpose (every publish would
    # pay for it); its rows are the relay's working set, few.
    scans = [
        line
        for line in re.findall(rf"Seq Scan on ({table}\w*)", plan)
        if line != f"{OUTBOX}_unsent"
    ]
    return f"a sequential scan of {scans}:\n{plan}" if scans else None


def fetched(client: Client, url: str, table: str, **query: str) -> Any:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, query)
    assert response.status_code == 200
    found = [
        (q["sql"], why)
        for q in captured.captured_queries
        if (why := _reads_every_row(q["sql"], table))
    ]
    assert not found, "\n\n".join(f"{why}\n  in {sql}" for sql, why in found)
    return response


def shown(response: Any) -> list[str]:
    return [row.message_id for row in response.context["cl"].result_list]


def test_the_outbox_list_filters_and_searches(admin: Client, big_outbox: None) -> None:
    url = reverse("admin:reliable_messaging_outboxmessage_changelist")

    listed = fetched(admin, url, OUTBOX)
    failed = fetched(admin, url, OUTBOX, status__exact="failed")
    by_id = fetched(admin, url, OUTBOX, q="out-12345")
    by_key = fetched(admin, url, OUTBOX, q="idem-333")
    unsent = fetched(admin, url, OUTBOX, q="out-7")

    assert shown(listed)[:2] == [f"out-{ROWS}", f"out-{ROWS - 1}"]  # the latest id first
    assert "about 20" in listed.content.decode()  # the planner's estimate, not a count
    assert failed.context["cl"].result_count == UNSENT // 2
    assert shown(by_id) == ["out-12345"]
    assert shown(by_key) == ["out-333"]
    assert shown(unsent) == ["out-7"]
    assert "routing_key" not in str(listed.context["cl"].list_filter)  # no DISTINCT filter


def test_the_inbox_list_filters_and_searches(admin: Client, big_inbox: None) -> None:
    url = reverse("admin:reliable_messaging_processedmessage_changelist")
    today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)

    listed = fetched(admin, url, INBOX)
    answer = fetched(admin, url, INBOX, q="in-4242 inbox.consumer-2")
    wrong_consumer = fetched(admin, url, INBOX, q="in-4242 inbox.consumer-3")
    dated = fetched(
        admin,
        url,
        INBOX,
        processed_at__gte=str(today),
        processed_at__lt=str(today + dt.timedelta(days=1)),
        consumer="inbox.consumer-1",
    )

    assert shown(listed)[:2] == ["in-1", "in-2"]
    assert shown(answer) == ["in-4242"]
    assert shown(wrong_consumer) == []
    assert shown(dated)[0] == "in-1"


def test_a_search_word_too_short_for_the_index_is_refused(
    admin: Client, make_dead_letter: Any
) -> None:
    make_dead_letter(message_id="ab")
    make_dead_letter(message_id="m-2", exception_message="xy is broken")

    with CaptureQueriesContext(connection) as captured:
        refused = admin.get(CHANGELIST, {"q": "xy"})
    exact = admin.get(CHANGELIST, {"q": "ab"})

    assert next(str(m) for m in refused.context["messages"]).startswith(
        "Search words of at least 3 characters"
    )
    assert list(refused.context["cl"].result_list) == []
    assert not [q for q in captured.captured_queries if "LIKE" in q["sql"]]
    assert [d.message_id for d in exact.context["cl"].result_list] == ["ab"]


def test_a_search_past_the_timeout_is_stopped_with_a_message(
    admin: Client, big_outbox: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL stops the search (SET LOCAL: the request's transaction only), and the page
    says so and shows the list without it."""
    monkeypatch.setattr(scaling.BoundedListAdmin, "search_timeout_ms", 1)
    url = reverse("admin:reliable_messaging_outboxmessage_changelist")
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        before = cursor.fetchone()[0]
    # A search that sleeps on every row it reads: well past 1 ms.
    monkeypatch.setattr(
        scaling.BoundedListAdmin,
        "get_search_results",
        lambda self, request, queryset, term: (
            queryset.extra(where=["pg_sleep(0.05) IS NOT NULL"]),
            False,
        ),
    )

    with CaptureQueriesContext(connection) as captured:
        response = admin.get(url, {"q": "out-1"})

    assert response.status_code == 200
    messages = [str(m) for m in response.context["messages"]]
    assert any("“out-1” was stopped after 1 ms" in m for m in messages), messages
    assert len(shown(response)) == 100  # the unsearched list
    assert any("set_config('statement_timeout'" in q["sql"] for q in captured.captured_queries)
    assert not [q for q in captured.captured_queries if q["sql"].upper().startswith("SET ")]
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        assert cursor.fetchone()[0] == before  # nothing left on the connection


@pytest.mark.django_db(transaction=True)
def test_no_get_of_an_admin_page_writes(make_dead_letter: Any) -> None:
    """Outside a transaction, as in production: the failure groups' deltas are left to the
    relay's fold, and no list, page, confirmation or download writes a row."""
    user = User.objects.create_superuser("root", "root@example.com", None)
    client = Client()
    client.force_login(user)
    letter = make_dead_letter(message_id="m-1")
    make_dead_letter(message_id="m-2", fingerprint="b2b2b2b2b2b2b2b2")
    outbox = OutboxMessage.objects.create(message_id="o-1", routing_key="r", body='{"a": 1}')
    inbox = ProcessedMessage.objects.create(consumer="tests.alpha", message_id="i-1")
    suspect = SuspectDelivery.objects.create(consumer="tests.alpha", message_id="s-1")
    operation = DeadLetterOperation.objects.create(kind="replay", requested_by="root")
    assert DeadLetterGroupDelta.objects.exists()  # a fold on GET would write
    objects = {
        DeadLetter: letter,
        OutboxMessage: outbox,
        ProcessedMessage: inbox,
        SuspectDelivery: suspect,
        DeadLetterOperation: operation,
    }
    urls = [
        GROUPS,
        f"{GROUPS}?all=1",
        f"{CHANGELIST}?consumer=tests.alpha",
        f"{CHANGELIST}?fingerprint=b2b2b2b2b2b2b2b2",
        f"{CHANGELIST}?q=refuses",
        reverse("admin:reliable_messaging_deadletter_replay_matching") + "?consumer=tests.alpha",
        reverse("admin:reliable_messaging_deadletter_discard_matching"),
        reverse("admin:reliable_messaging_deadletter_body", args=[letter.pk]),
        reverse("admin:reliable_messaging_outboxmessage_body", args=[outbox.pk]),
        reverse("admin:reliable_messaging_deadletter_operation", args=[operation.pk]),
        reverse("admin:reliable_messaging_deadletter_operation_status", args=[operation.pk]),
    ]
    for model, model_admin in django_admin.site._registry.items():
        if model._meta.app_label != "reliable_messaging":
            continue
        info = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        urls.append(reverse(f"{info}_changelist"))
        if model in objects:
            urls.append(reverse(f"{info}_change", args=[objects[model].pk]))
            urls.append(reverse(f"{info}_history", args=[objects[model].pk]))

    writes = []
    for url in urls:
        with CaptureQueriesContext(connection) as captured:
            response = client.get(url)
        assert response.status_code == 200, url
        writes += [
            (url, q["sql"])
            for q in captured.captured_queries
            if re.match(
                r"\s*(INSERT|UPDATE|DELETE|WITH\b.*\b(DELETE|INSERT|UPDATE)\b)",
                q["sql"],
                re.S | re.I,
            )
        ]
    assert not writes, "\n".join(f"{url}: {sql[:200]}" for url, sql in writes)
    assert DeadLetterGroupDelta.objects.exists()


def test_the_body_download_asks_the_permission_of_the_page(make_dead_letter: Any, db: None) -> None:
    letter = make_dead_letter(body=b"\xff\x00raw")
    url = reverse("admin:reliable_messaging_deadletter_body", args=[letter.pk])
    viewer, stranger = Client(), Client()
    viewer.force_login(staff_user("viewer", "view_deadletter"))
    stranger.force_login(staff_user("stranger", "view_outboxmessage"))

    allowed = viewer.get(url)
    refused = stranger.get(url)

    assert allowed.status_code == 200
    assert allowed.content == b"\xff\x00raw"
    assert allowed["Content-Disposition"] == f'attachment; filename="deadletter-{letter.pk}.bin"'
    assert refused.status_code == 403
