"""The dead letter's page: read-only, everything escaped, payload/headers/body/traceback shown,
attempt and replay history, and the replay/discard buttons for those allowed to use them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.conf import settings
from django.test import Client, override_settings

from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage, TaskRun
from reliable_messaging.task_runs.naming import task_consumer_name

from .conftest import change_url, discard_url, replay_url

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]


def test_user_data_renders_as_text_never_as_markup(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(
        message_id="<script>alert('id')</script>",
        payload={"note": "<script>alert('payload')</script>", "amount": "9.99"},
        headers={"x-evil": "<script>alert('header')</script>"},
        exception_message="<script>alert('message')</script>",
        traceback="Traceback (most recent call last):\n<script>alert('traceback')</script>\n",
        history=[{"event": "dead_lettered", "at": "2026-01-01T00:00:00+00:00", "reason": "<b>"}],
    )

    response = admin.get(change_url(letter))

    assert response.status_code == 200
    html = response.content.decode()
    assert "<script>alert" not in html
    for where in ("payload", "header", "message", "traceback", "id"):
        assert f"&lt;script&gt;alert(&#x27;{where}&#x27;)&lt;/script&gt;" in html, where
    assert "<b>" not in html.split('id="content-main"')[1]
    # Pretty-printed JSON.
    assert "&quot;amount&quot;: &quot;9.99&quot;,\n  &quot;note&quot;" in html


def test_a_body_that_is_not_json_or_utf8_is_shown_raw_and_escaped(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(
        reason="invalid_utf8",
        payload=None,
        body=b"\xff\xfe<script>alert('raw')</script>\x00",
        exception_type="",
        exception_message="body is not UTF-8",
        traceback="",
    )

    html = admin.get(change_url(letter)).content.decode()

    assert "<script>alert" not in html
    assert "Raw body" in html
    assert "\\xff\\xfe&lt;script&gt;alert(&#x27;raw&#x27;)&lt;/script&gt;\\x00" in html
    assert "32 bytes" in html


def test_json_nested_deeper_than_the_printer_should_go_is_shown_raw(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """Valid JSON 200 deep: indented, every level would add two spaces to each line below it
    (Python 3.13's printer goes 5,000 deep, into tens of MB); it is shown as its raw text."""
    body = b"[" * 200 + b"]" * 200
    letter = make_dead_letter(payload=None, body=body, reason="permanent")

    html = admin.get(change_url(letter)).content.decode()

    assert "Raw body" in html
    assert "[" * 200 in html
    assert "400 bytes" in html


def test_the_page_is_read_only_and_shows_the_whole_story(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(
        message_id="m-story",
        attempts=3,
        replay_count=1,
        reason="retries_exhausted",
        exception_type="builtins.TimeoutError",
        exception_message="payment gateway timed out",
        history=[
            {
                "event": "dead_lettered",
                "at": "2026-11-20T10:00:00+00:00",
                "reason": "retries_exhausted",
                "attempts": 3,
                "exception_type": "builtins.TimeoutError",
            },
            {"event": "replayed", "at": "2026-11-20T11:00:00+00:00", "by": "bob (admin)"},
            {
                "event": "dead_lettered",
                "at": "2026-11-20T11:00:05+00:00",
                "reason": "retries_exhausted",
                "attempts": 3,
            },
        ],
    )
    make_dead_letter(fingerprint=letter.fingerprint)

    html = admin.get(change_url(letter)).content.decode()

    assert 'name="_save"' not in html and 'name="_continue"' not in html
    assert "<textarea" not in html and 'type="text"' not in html
    assert "2026-11-20 10:00:00" in html and "2026-11-20 11:00:05" in html
    assert "bob (admin)" in html
    assert "attempts: 3" in html
    assert "payment gateway timed out" in html
    assert "File &quot;/srv/app/tests/testapp/consumers.py&quot;, line 44, in alpha" in html
    assert "2 dead letters fail this way" in html
    assert f"?fingerprint={letter.fingerprint}" in html
    assert replay_url(letter) in html and discard_url(letter) in html
    assert 'name="force"' not in html  # not processed yet: nothing to force


def test_the_page_says_when_the_consumer_already_processed_the_message(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(message_id="m-done")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-done")

    html = admin.get(change_url(letter)).content.decode()

    assert "yes, at" in html
    assert 'name="force"' in html


def test_no_replay_button_for_what_cannot_be_replayed(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    resolved = make_dead_letter(status="resolved")
    no_json = make_dead_letter(reason="invalid_json", payload=None, body=b"{oops")

    resolved_html = admin.get(change_url(resolved)).content.decode()
    no_json_html = admin.get(change_url(no_json)).content.decode()

    assert replay_url(resolved) not in resolved_html
    assert discard_url(resolved) not in resolved_html
    assert replay_url(no_json) not in no_json_html
    assert discard_url(no_json) in no_json_html


def test_a_celery_tasks_dead_letter_offers_its_discard_and_says_why_not_a_replay(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    # The replay refuses it whatever its body (no message to publish): no button it refuses.
    task = make_dead_letter(headers={"celery-task": "shop.tasks.charge"}, reason="worker_crashed")

    page = admin.get(change_url(task)).content.decode()

    assert replay_url(task) not in page
    assert 'id="rm-edit-replay"' not in page
    assert discard_url(task) in page
    assert 'id="rm-not-replayable"' in page
    assert "call the task again" in page


def test_a_tasks_dead_letter_whose_row_is_gone_offers_no_replay_and_a_replay_refuses_it(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    # A task's message only names its row: with the row gone (deleted by hand, or another
    # database) the page offered Replay, and the replay became a new dead letter.
    consumer = task_consumer_name("default", "default")
    payload = {"task_id": "gone-1", "task": "shop.tasks.charge"}
    gone = make_dead_letter(consumer=consumer, message_id="gone-1", payload=payload)
    here = make_dead_letter(
        consumer=consumer, message_id="here-1", payload={**payload, "task_id": "here-1"}
    )
    TaskRun.objects.create(id="here-1", task_path="shop.tasks.charge", queue_name="default")

    page = admin.get(change_url(gone)).content.decode()
    assert replay_url(gone) not in page
    assert discard_url(gone) in page
    assert 'id="rm-not-replayable"' in page and "no row of task gone-1" in page
    assert replay_url(here) in admin.get(change_url(here)).content.decode()

    result = replay(DeadLetter.objects.filter(pk__in=[gone.pk, here.pk]), replayed_by="tests")
    assert result.replayed == [here.pk]
    assert "enqueue the task again" in result.refused[gone.pk]
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == ["here-1"]


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
REPLAY_TRACE = "0af7651916cd43dd8448eb211c80319c"


def test_the_trace_of_the_failure_and_of_its_replay_are_linked(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """With TRACE_URL_TEMPLATE the page links the failure's trace and, in the history, the
    trace its replay ended in; an id that is not one (a producer wrote it) is shown, unlinked."""
    letter = make_dead_letter(
        trace_id=TRACE,
        span_id=SPAN,
        history=[
            {"event": "dead_lettered", "at": "2026-01-01T00:00:00+00:00", "trace_id": TRACE},
            {"event": "replayed", "at": "2026-01-01T00:01:00+00:00", "by": "admin"},
            {"event": "resolved", "at": "2026-01-01T00:01:02+00:00", "trace_id": REPLAY_TRACE},
            {"event": "resolved", "at": "2026-01-01T00:01:03+00:00", "trace_id": "<b>x</b>"},
        ],
    )
    template = "https://tempo.example.com/trace/{trace_id}?span={span_id}"
    values = {**settings.RELIABLE_MESSAGING, "TRACE_URL_TEMPLATE": template}

    with override_settings(RELIABLE_MESSAGING=values):
        html = admin.get(change_url(letter)).content.decode()

    assert f'href="https://tempo.example.com/trace/{TRACE}?span={SPAN}"' in html
    assert f'href="https://tempo.example.com/trace/{REPLAY_TRACE}?span="' in html
    assert "&lt;b&gt;x&lt;/b&gt;" in html and "<b>x</b>" not in html
    assert html.count('href="https://tempo.example.com/') == 3  # the field and two events


def test_without_a_template_the_trace_ids_are_shown_unlinked(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(trace_id=TRACE, span_id=SPAN)

    html = admin.get(change_url(letter)).content.decode()

    assert f"<code>{TRACE}</code>" in html and SPAN in html
    assert "tempo.example.com" not in html
