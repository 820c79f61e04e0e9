"""Which dead letters a bulk operation takes: a selection frozen as JSON, resolved here.

An operation is carried out by the relay process, long after the admin request that started
it, so what it takes cannot be a queryset: it is the changelist's filter as data (field lookups
and a search term), resolved again batch after batch by :func:`targets`. The same function
gives the admin's confirmation page its counts, so what the page announces is what runs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.utils.text import smart_split, unescape_string_literal

from ..choices import OperationKind
from ..models import DeadLetter, DeadLetterStatus
from .replay import UNREPLAYABLE_REASONS, replayable, stale_replays

# Query parameters of the admin's changelist that are not filters.
NOT_FILTERS = frozenset({"o", "p", "e", "q", "_facets", "all", "_changelist_filters"})


class SelectionError(ValueError):
    """A filter that does not name a field of the dead letters."""

    def __init__(self, message: str = "this filter does not name a dead letter's field") -> None:
        super().__init__(message)


def selection_from_query(params: Mapping[str, Any], description: str = "") -> dict[str, Any]:
    """The selection of a changelist query string (a ``QueryDict``, or a plain mapping)."""
    lookups: dict[str, str] = {}
    for key in params:
        if key in NOT_FILTERS:
            continue
        value = params[key]  # a QueryDict gives the last value, as the changelist uses
        field_name = key.split("__", 1)[0]
        try:
            DeadLetter._meta.get_field(field_name)
        except FieldDoesNotExist as exc:
            raise SelectionError(f"unknown filter {key!r}") from exc
        lookups[key] = str(value)
    return {
        "lookups": dict(sorted(lookups.items())),
        "search": str(params.get("q", "") or ""),
        "status_chosen": any(key.startswith("status") for key in lookups),
        "description": description,
    }


def _value(lookup: str, value: str) -> Any:
    if lookup.endswith("__isnull"):
        return value.lower() not in ("", "0", "false")
    if lookup.endswith("__in"):
        return value.split(",")
    return value


def matching(selection: Mapping[str, Any]) -> QuerySet[DeadLetter]:
    """Every dead letter the selection's filter and search match, whatever its status.

    The search is the admin's: :func:`search`."""
    rows = DeadLetter.objects.all()
    lookups = {k: _value(k, v) for k, v in (selection.get("lookups") or {}).items()}
    if lookups:
        rows = rows.filter(**lookups)
    return search(rows, selection.get("search") or "")


def search(queryset: QuerySet[DeadLetter], term: str) -> QuerySet[DeadLetter]:
    """The dead letters of ``queryset`` that ``term`` finds.

    ``=ID`` is an exact message_id. A single word that is the message_id of some of them finds
    those (one probe of the message_id index); otherwise every word (quotes group words) must
    be in the exception message or in the payload's JSON text, case-insensitively: trigram
    GIN indexes answer that on PostgreSQL for words of three characters or more.
    """
    term = term.strip()
    if not term:
        return queryset
    if term.startswith("="):
        return queryset.filter(message_id=term[1:].strip())
    if not any(character.isspace() for character in term):
        exact = queryset.filter(message_id=term)
        if exact.exists():
            return exact
    # alias(), not annotate(): the cast is needed in the WHERE clause only. Django writes
    # UPPER(("payload")::text) for it, the expression the trigram index is built on.
    queryset = queryset.alias(payload_text=Cast("payload", output_field=TextField()))
    for word in smart_split(term):
        if word[0] in "\"'" and word[0] == word[-1]:
            word = unescape_string_literal(word)
        queryset = queryset.filter(
            Q(exception_message__icontains=word) | Q(payload_text__icontains=word)
        )
    return queryset


def wanted(kind: str, selection: Mapping[str, Any], now: dt.datetime | None = None) -> Q:
    """Which of the matching dead letters an operation of ``kind`` takes, by status.

    Without a status filter only dead ones (and replays presumed lost): "replay everything
    from billing" should not wake up what someone discarded on purpose."""
    if kind == OperationKind.REPLAY and selection.get("status_chosen"):
        return replayable(now)
    return Q(status=DeadLetterStatus.DEAD) | stale_replays(now)


def unreplayable(kind: str) -> list[str]:
    """Reasons an operation of ``kind`` leaves out from the start (they would fail again)."""
    return [str(reason) for reason in UNREPLAYABLE_REASONS] if kind == OperationKind.REPLAY else []


def targets(
    kind: str, selection: Mapping[str, Any], now: dt.datetime | None = None
) -> QuerySet[DeadLetter]:
    """The dead letters an operation of ``kind`` over ``selection`` takes (the replay's
    refusal rules still judge each one in its batch)."""
    return (
        matching(selection)
        .filter(wanted(kind, selection, now))
        .exclude(reason__in=unreplayable(kind))
    )
