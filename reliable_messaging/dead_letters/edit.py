"""Edit, then replay: a corrected copy of a dead letter's message under a new message_id, the
original kept unchanged (``docs/operations.md#edit-a-message-then-replay-it``)."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict, Unpack

from django.db import router, transaction
from django.utils import timezone

from ..broker.limits import body_size_refusal, header_frame_refusal
from ..choices import ReplayKind
from ..contracts import consumer_payload_errors
from ..core.envelope import (
    BROKER_HEADERS,
    HEADER_PREFIX,
    REPLAY_ID_HEADER,
    SENDER_ROUTING_HEADERS,
    checked_headers,
    encode_payload,
    user_headers,
)
from ..core.trace_context import TRACE_HEADERS
from ..core.uuid7 import new_message_id
from ..models import DeadLetter, ProcessedMessage, Replay
from ..task_runs.naming import is_task_consumer
from .replay import insert_copies, outbox_row, replay_headers, traced
from .replay import refusal as replay_refusal

logger = logging.getLogger(__name__)

# An operator's reason, kept in the ledger and the history.
MAX_REASON_LENGTH = 1000
# The diff in the dead letter's history is cut past this (the ledger row keeps it whole).
HISTORY_DIFF_CHARS = 20_000
# What the copy's headers get that the edit cannot know yet, at its longest: the operator's
# name (Django's username: up to 150 characters), its ledger row's id and a trace context.
_OPERATOR_ROOM = "x" * 150
_TRACE_ROOM = {"traceparent": "0" * 55, "tracestate": ""}
# Header names the edit may not set (besides ours, x-rm-*), lowercase, with why.
_REFUSED = {
    **dict.fromkeys((n.lower() for n in TRACE_HEADERS), "the replay sets the trace context"),
    **dict.fromkeys((n.lower() for n in BROKER_HEADERS), "it is the broker's dead-letter record"),
    **dict.fromkeys(
        (n.lower() for n in SENDER_ROUTING_HEADERS),
        "the broker would route the copy to more queues than its consumer's",
    ),
}


class EditRefused(ValueError):
    """The edit cannot be replayed; ``problems`` says why, one sentence each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems) or "the edit was refused")


@dataclass
class Edit:
    """An edit as judged: the parsed payload and headers (None when they do not parse), the
    diff against the original, and the problems that refuse it."""

    payload: Any = None
    headers: dict[str, Any] | None = None
    body: str = ""
    diff: str = ""
    problems: list[str] = field(default_factory=list)
    already_processed: bool = False


def pretty(value: Any) -> str:
    """JSON as the edit page shows it and the diff compares it."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


def original_payload_text(dead_letter: DeadLetter) -> str:
    """The original's payload for the edit page: its JSON indented, or else its body as text."""
    raw = bytes(dead_letter.body)
    try:
        return pretty(json.loads(raw))
    except (ValueError, RecursionError):
        return raw.decode("utf-8", errors="replace")


def editable_headers(dead_letter: DeadLetter) -> dict[str, Any]:
    """The original's headers an edit may change: the user's (not ours, the broker's, ...)."""
    headers = user_headers(dead_letter.headers or {})
    return {name: value for name, value in headers.items() if name.lower() not in _REFUSED}


_UNREAD = object()  # what _parse gives for text that is not JSON


def never_editable(dead_letter: DeadLetter) -> str | None:
    """Why no edit of ``dead_letter`` could change what its replay runs (None: one could)."""
    if is_task_consumer(dead_letter.consumer):
        return (
            f"dead letter #{dead_letter.pk} is the message of a django.tasks task, which only "
            "names the task's result row: the row holds the task and its arguments, so an edit "
            "could not change what runs. Replay it as it is, or enqueue the task again with "
            "other arguments"
        )
    return None


def _parse(text: str, what: str, problems: list[str]) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        problems.append(
            f"the {what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(character {exc.pos})"
        )
    except RecursionError:
        problems.append(f"the {what} is nested too deep to read")
    except ValueError as exc:  # an integer literal beyond Python's digit limit
        problems.append(f"the {what} is not valid JSON: {exc}")
    return _UNREAD


def _header_problems(headers: Any) -> list[str]:
    if not isinstance(headers, Mapping):
        return ["the headers must be a JSON object of names and values, such as {}"]
    problems = []
    for name in headers:
        if not isinstance(name, str):
            problems.append(f"header names must be strings, got {name!r}")
            continue
        why = _REFUSED.get(name.lower())
        if name.lower().startswith(HEADER_PREFIX):
            why = "the x-rm-* headers are the app's own bookkeeping"
        if why:
            problems.append(f"header {name!r} is refused: {why}")
        elif not name:
            problems.append("a header has an empty name")
    if problems:
        return problems
    try:
        checked_headers(headers)
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []


def unified_diff(before: str, after: str, what: str) -> str:
    return "\n".join(
        difflib.unified_diff(
            before.splitlines(),
            after.splitlines(),
            fromfile=f"original {what}",
            tofile=f"edited {what}",
            lineterm="",
        )
    )


class EditForm(TypedDict):
    """An edit as the operator gives it: the payload and headers as JSON text (the headers may
    be a mapping), why, and ``force``: even if the original was processed."""

    payload_text: str
    headers: str | Mapping[str, Any]
    reason: str
    force: NotRequired[bool]


def check_edit(dead_letter: DeadLetter, *, now: Any = None, **form: Unpack[EditForm]) -> Edit:
    """Judge an edit of ``dead_letter``, writing nothing: the parsed payload and headers, their
    diff against the original, and every problem that refuses it."""
    edit = Edit()
    problems = edit.problems
    if never := never_editable(dead_letter):
        problems.append(never)
    payload = _parse(form["payload_text"], "payload", problems)
    payload_ok = payload is not _UNREAD
    if payload_ok:
        edit.payload = payload
        try:
            encoded = encode_payload(payload)
        except TypeError as exc:
            problems.append(str(exc))
        else:
            if refusal := body_size_refusal(len(encoded)):
                problems.append(refusal)
            edit.body = encoded.decode("utf-8")
        # Its consumer's declared type would refuse it before the handler: said here instead.
        for error in consumer_payload_errors(dead_letter.consumer, payload) or ():
            problems.append(
                f"the payload does not match the consumer's declared type at "
                f"{error['path'] or '(payload)'}: {error['message']}"
            )
    headers = form["headers"]
    parsed = _parse(headers or "{}", "headers", problems) if isinstance(headers, str) else headers
    if parsed is not _UNREAD:
        header_problems = _header_problems(parsed)
        problems.extend(header_problems)
        if not header_problems:
            edit.headers = dict(parsed)
            if refusal := _frame_refusal(dead_letter, edit.headers):
                problems.append(refusal)
    cleaned = (form["reason"] or "").strip()
    if not cleaned:
        problems.append("a reason is required: say why the message is edited")
    elif len(cleaned) > MAX_REASON_LENGTH:
        problems.append(
            f"the reason is {len(cleaned)} characters long; at most {MAX_REASON_LENGTH}"
        )
    edit.already_processed = original_processed(dead_letter)
    now = now or timezone.now()
    # The replay's rule on what an edit keeps of the original: its status and what it is, not
    # its body nor the inbox (the copy has its own message_id).
    found = replay_refusal(
        dead_letter, already_processed=False, force=True, now=now, body_replaced=True
    )
    if found is not None:
        problems.append(f"dead letter #{dead_letter.pk} cannot be replayed: {found.text}")
    if edit.already_processed and not form.get("force", False):
        problems.append(
            f"consumer {dead_letter.consumer} already processed the original message "
            f"{dead_letter.message_id}: the edited copy would run its handler once more for "
            f"the same event. Tick force to send it anyway (the copy has a new message_id, so "
            f"no inbox row is deleted)"
        )
    diffs = []
    if payload_ok:
        diffs.append(unified_diff(original_payload_text(dead_letter), pretty(payload), "payload"))
    if edit.headers is not None:
        diffs.append(
            unified_diff(pretty(editable_headers(dead_letter)), pretty(edit.headers), "headers")
        )
    edit.diff = "\n".join(d for d in diffs if d)
    return edit


def _frame_refusal(dead_letter: DeadLetter, edited: dict[str, Any]) -> str | None:
    """Why the copy's headers can never be sent (over the broker's frame size), or None."""
    headers = {**_copy_headers(dead_letter, edited, _OPERATOR_ROOM, 2**62), **_TRACE_ROOM}
    return header_frame_refusal(new_message_id(), headers)


def original_processed(dead_letter: DeadLetter) -> bool:
    """Whether the consumer already processed the original message."""
    if not dead_letter.message_id:
        return False
    rows = ProcessedMessage.objects.using(
        dead_letter._state.db or router.db_for_read(ProcessedMessage)
    )
    return rows.has(dead_letter.consumer, dead_letter.message_id)


def replay_edited(dead_letter: DeadLetter, *, replayed_by: str, **form: Unpack[EditForm]) -> Replay:
    """Replay an edited copy of ``dead_letter`` in one transaction, judged again on the locked
    original (:class:`EditRefused`); ``force``: even if the original was processed. Returns its
    ledger row (with the copy's message_id); the caller wakes the relay after the commit."""
    using = router.db_for_write(DeadLetter)
    with transaction.atomic(using=using):
        original = DeadLetter.objects.using(using).select_for_update().get(pk=dead_letter.pk)
        now = timezone.now()
        edit = check_edit(original, now=now, **form)
        if edit.problems:
            raise EditRefused(edit.problems)
        assert edit.headers is not None  # no problem: they parsed
        message_id = new_message_id()
        entry = Replay.objects.using(using).create(
            dead_letter=original,
            consumer=original.consumer,
            message_id=message_id,
            kind=ReplayKind.EDITED,
            replayed_by=replayed_by,
            replayed_at=now,
            reason=form["reason"].strip(),
            edit={"payload": edit.payload, "headers": edit.headers, "diff": edit.diff},
        )
        copy_headers = _copy_headers(original, edit.headers, replayed_by, entry.pk)
        copy_headers = traced(copy_headers, original, replayed_by, message_id)
        insert_copies(using, [outbox_row(original, message_id, edit.body, copy_headers)])
        diff = edit.diff
        if len(diff) > HISTORY_DIFF_CHARS:
            diff = diff[:HISTORY_DIFF_CHARS] + f"\n... (cut: the replay #{entry.pk} has all of it)"
        DeadLetter.objects.using(using).mark_edited_replay(
            original,
            at=now,
            by=replayed_by,
            reason=form["reason"].strip(),
            message_id=message_id,
            diff=diff,
        )
    logger.info(
        "edited replay of dead letter #%s (message_id=%s) queued by %s as message_id=%s",
        original.pk,
        original.message_id,
        replayed_by,
        message_id,
    )
    return entry


def _copy_headers(
    original: DeadLetter, edited: dict[str, Any], replayed_by: str, replay_id: int
) -> dict[str, Any]:
    """The replay's headers (of ledger row ``replay_id``), with the original's user headers
    replaced by the edited ones."""
    headers = replay_headers(original, replayed_by)
    for name in editable_headers(original):
        headers.pop(name, None)
    return {**headers, **edited, REPLAY_ID_HEADER: replay_id}
