"""The dead letter changelist: columns, each filter, search, ordering; the failure groups page;
the inbox page that answers "was message X processed by consumer Y, and when?"."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from unittest import mock

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.testing import deliver
from tests.markers import postgresql_only

from .conftest import BETA_QUEUE, CHANGELIST, GROUPS, shown

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]


@pytest.fixture
def three_kinds(make_dead_letter: MakeDeadLetter) -> list[DeadLetter]:
    now = timezone.now()
    return [
        make_dead_letter(message_id="perm-alpha", last_failed_at=now - dt.timedelta(hours=1)),
        make_dead_letter(
            message_id="keyerror-beta",
            consumer="tests.beta",
            queue=BETA_QUEUE,
            routing_key="order.shipped",
            reason="retries_exhausted",
            exception_type="builtins.KeyError",
            exception_message="'customer_email'",
            attempts=3,
            status="resolved",
            fingerprint="b2b2b2b2b2b2b2b2",
            payload={"order_id": 7, "note": "gift wrap, blue ribbon"},
            last_failed_at=now - dt.timedelta(days=3),
        ),
        make_dead_letter(
            message_id="badjson-alpha",
            reason="invalid_json",
            exception_type="",
            exception_message="body is not JSON: Expecting value: line 1 column 1 (char 0)",
            payload=None,
            body=b"not json at all",
            fingerprint="c3c3c3c3c3c3c3c3",
            last_failed_at=now - dt.timedelta(days=40),
        ),
    ]


def test_the_list_shows_the_columns_of_a_failure(admin: Client, three_kinds: list) -> None:
    response = admin.get(CHANGELIST)

    assert response.status_code == 200
    html = response.content.decode()
    for header in (
        "When",
        "Consumer and queue",
        "Routing key",
        "Message ID",
        "Reason",
        "Exception and message",
        "Attempts",
        "Status",
    ):
        assert f">{header}<" in html, header
    for text in (
        "perm-alpha",
        "tests.beta",
        BETA_QUEUE,
        "order.shipped",
        "retries exhausted",
        'title="builtins.KeyError">KeyError<',
        "&#x27;customer_email&#x27;",
        "resolved",
    ):
        assert text in html, text
    # Newest failure first.
    assert [d.message_id for d in response.context["cl"].result_list] == [
        "perm-alpha",
        "keyerror-beta",
        "badjson-alpha",
    ]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status__exact=resolved", ["keyerror-beta"]),
        ("status__exact=dead", ["badjson-alpha", "perm-alpha"]),
        ("consumer=tests.beta", ["keyerror-beta"]),
        (f"queue={BETA_QUEUE}", ["keyerror-beta"]),
        ("reason__exact=invalid_json", ["badjson-alpha"]),
        ("exception_type=builtins.KeyError", ["keyerror-beta"]),
        ("fingerprint=c3c3c3c3c3c3c3c3", ["badjson-alpha"]),
        ("consumer=tests.alpha&status__exact=dead", ["badjson-alpha", "perm-alpha"]),
    ],
    # Ids without the namespace: parallel workers (pytest-xdist) must collect the same tests.
    ids=lambda value: value.replace(BETA_QUEUE, "QUEUE") if isinstance(value, str) else None,
)
def test_each_filter(admin: Client, three_kinds: list, query: str, expected: list[str]) -> None:
    response = admin.get(f"{CHANGELIST}?{query}")

    assert response.status_code == 200
    assert shown(response) == expected


def test_date_filter_and_day_lookups(admin: Client, three_kinds: list) -> None:
    # No date hierarchy (it read the first and last date of every dead letter, and each day's
    # DISTINCT): the date filter's ranges, and a day's lookups in the URL, still work.
    midnight = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    response = admin.get(
        CHANGELIST,
        {
            "last_failed_at__gte": (midnight - dt.timedelta(days=7)).isoformat(),
            "last_failed_at__lt": (midnight + dt.timedelta(days=1)).isoformat(),
        },
    )
    assert shown(response) == ["keyerror-beta", "perm-alpha"]

    old = three_kinds[2].last_failed_at
    response = admin.get(
        f"{CHANGELIST}?last_failed_at__year={old.year}&last_failed_at__month={old.month}"
        f"&last_failed_at__day={old.day}"
    )
    assert shown(response) == ["badjson-alpha"]
    assert "toplinks" not in response.content.decode()  # the date hierarchy's links


def test_the_filter_sidebar_offers_the_values(admin: Client, three_kinds: list) -> None:
    html = admin.get(CHANGELIST).content.decode()

    assert "?consumer=tests.beta" in html
    assert "?exception_type=builtins.KeyError" in html
    assert "?reason__exact=invalid_json" in html
    assert "Past 7 days" in html


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("keyerror-beta", ["keyerror-beta"]),  # message_id, exactly
        ("keyerror", []),  # ... not a part of it
        ("customer_email", ["keyerror-beta"]),  # the exception message
        ("ribbon", ["keyerror-beta"]),  # the payload's text
        ("sku-1", ["perm-alpha"]),
        ("Expecting value", ["badjson-alpha"]),
    ],
)
def test_search(admin: Client, three_kinds: list, term: str, expected: list[str]) -> None:
    response = admin.get(CHANGELIST, {"q": term})

    assert response.status_code == 200
    assert shown(response) == expected


def test_the_list_pages(admin: Client, make_dead_letter: MakeDeadLetter) -> None:
    for _ in range(55):
        make_dead_letter()

    first = admin.get(CHANGELIST)
    second = admin.get(CHANGELIST, {"p": 2})

    assert len(first.context["cl"].result_list) == 50
    assert len(second.context["cl"].result_list) == 5


def test_failure_groups_count_and_link_to_their_dead_letters(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    now = timezone.now()
    for hours in (5, 3, 1):
        make_dead_letter(
            fingerprint="f1f1f1f1f1f1f1f1", last_failed_at=now - dt.timedelta(hours=hours)
        )
    make_dead_letter(fingerprint="f1f1f1f1f1f1f1f1", status="resolved")
    make_dead_letter(
        fingerprint="f2f2f2f2f2f2f2f2",
        exception_type="builtins.KeyError",
        exception_message="'sku'",
        message_id="lonely",
    )
    make_dead_letter(fingerprint="f3f3f3f3f3f3f3f3", status="discarded")

    response = admin.get(GROUPS)

    assert response.status_code == 200
    rows = response.context["rows"]
    assert [(r["fingerprint"], r["dead"], r["total"]) for r in rows] == [
        ("f1f1f1f1f1f1f1f1", 3, 4),
        ("f2f2f2f2f2f2f2f2", 1, 1),
    ]
    big = rows[0]
    assert big["first_seen"] <= now - dt.timedelta(hours=5)
    assert big["last_seen"] >= now - dt.timedelta(hours=1, seconds=5)
    assert big["exception_name"] == "PermanentError"
    assert rows[1]["example"].message_id == "lonely"
    html = response.content.decode()
    assert "replay group…" in html and "discard group…" in html

    listed = admin.get(big["list_url"])
    assert len(listed.context["cl"].result_list) == 4
    assert "failure group" in listed.content.decode()  # the active filter is shown

    # Every group, also the one with nothing left dead.
    everything = admin.get(GROUPS, {"all": "1"})
    assert {r["fingerprint"] for r in everything.context["rows"]} == {
        "f1f1f1f1f1f1f1f1",
        "f2f2f2f2f2f2f2f2",
        "f3f3f3f3f3f3f3f3",
    }


def test_the_list_links_to_the_groups_and_to_replay_all_matching(
    admin: Client, three_kinds: list
) -> None:
    html = admin.get(CHANGELIST, {"consumer": "tests.alpha"}).content.decode()

    assert GROUPS in html
    assert "replay-matching/?consumer=tests.alpha" in html
    assert "discard-matching/?consumer=tests.alpha" in html


def test_processed_messages_answer_was_x_processed_by_y_and_when(admin: Client) -> None:
    at = timezone.now() - dt.timedelta(minutes=3)
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-42", processed_at=at)
    ProcessedMessage.objects.create(consumer="tests.beta", message_id="m-42")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-43")
    url = reverse("admin:reliable_messaging_processedmessage_changelist")

    both = admin.get(url, {"q": "m-42 tests.alpha"})
    by_id = admin.get(url, {"q": "m-42"})
    by_consumer = admin.get(url, {"consumer": "tests.beta"})

    assert [(r.consumer, r.processed_at) for r in both.context["cl"].result_list] == [
        ("tests.alpha", at)
    ]
    assert sorted(r.consumer for r in by_id.context["cl"].result_list) == [
        "tests.alpha",
        "tests.beta",
    ]
    assert [r.message_id for r in by_consumer.context["cl"].result_list] == ["m-42"]
    assert "?consumer=tests.alpha" in both.content.decode()  # registered consumers offered


def test_real_failures_are_grouped_by_their_fingerprint(admin: Client) -> None:
    # Two messages failing the same way (KeyError in the handler, retries exhausted at the
    # third attempt), one failing another way (PermanentError): two groups.
    for message_id in ("k-1", "k-2"):
        deliver("tests.alpha", {"require": "email", "fields": {}}, message_id=message_id, attempt=3)
    deliver("tests.alpha", {"permanent": {"alpha": 1}}, message_id="p-1")

    rows = admin.get(GROUPS).context["rows"]

    assert sorted((r["exception_name"], r["dead"]) for r in rows) == [
        ("KeyError", 2),
        ("PermanentError", 1),
    ]
    key_errors = next(r for r in rows if r["exception_name"] == "KeyError")
    listed = admin.get(key_errors["list_url"])
    assert shown(listed) == ["k-1", "k-2"]


@postgresql_only
def test_the_inbox_list_shows_the_planners_estimate_of_a_large_inbox(admin: Client) -> None:
    """Counting a billion inbox rows (or one consumer's share) takes minutes: past
    COUNT_UP_TO rows the list shows PostgreSQL's estimate (here 300 rows analyzed, then 100
    deleted unseen by the statistics), and a small result is counted up to the bound."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from reliable_messaging.admin import scaling

    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="tests.alpha", message_id=f"e-{n}") for n in range(300)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {ProcessedMessage._meta.db_table}")
    ProcessedMessage.objects.filter(message_id__in=[f"e-{n}" for n in range(100)]).delete()
    url = reverse("admin:reliable_messaging_processedmessage_changelist")
    with (
        mock.patch.object(scaling, "COUNT_UP_TO", 50),
        CaptureQueriesContext(connection) as queries,
    ):
        listed = admin.get(url)
        one = admin.get(url, {"q": "e-150"})
    # The planner's figure (its statistics scaled to the table's current size), not the 200 rows.
    assert 250 <= listed.context["cl"].result_count <= 350
    assert "about 2" in listed.content.decode() or "about 3" in listed.content.decode()
    inbox = ProcessedMessage._meta.db_table
    counts = [
        q["sql"] for q in queries.captured_queries if "COUNT(" in q["sql"] and inbox in q["sql"]
    ]
    assert len(counts) == 1, counts  # the search's, estimated at one row: counted, bounded
    assert "LIMIT 51" in counts[0]
    assert one.context["cl"].result_count == 1
