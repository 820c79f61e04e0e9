"""Which dead letters a bulk operation takes: the changelist's filter frozen as JSON, applied
again batch after batch by :func:`targets`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, TypeVar

from django.core.exceptions import FieldDoesNotExist
from django.db.models import Q, QuerySet, TextField
from django.db.models.functions import Cast
from django.utils.text import smart_split, unescape_string_literal

from ..choices import OperationKind
from ..managers import DeadLetterQuerySet
from ..models import DeadLetter
from .replay import UNREPLAYABLE_REASONS, discardable, replayable

# Query parameters of the admin's changelist that are not filters.
NOT_FILTERS = frozenset({"o", "p", "e", "q", "_facets", "all", "_changelist_filters"})
# How a selection's search term reads (its "search_mode").
BY_MESSAGE_ID = "message_id"
BY_WORDS = "words"
SEARCH_MODES = (BY_MESSAGE_ID, BY_WORDS)
Rows = TypeVar("Rows", bound=QuerySet[Any])


class SelectionError(ValueError):
    """A query that does not make a selection (an unknown field, a filter given twice)."""


def selection_from_query(
    params: Mapping[str, Any], description: str = "", *, search_mode: str | None = None
) -> dict[str, Any]:
    """The selection of a changelist query string, its search read as ``search_mode`` says
    (None: decided now). A filter given twice is refused: the changelist reads some as "any of"
    and others as "the last one" (``status__in=a,b`` says "any of" for all)."""
    lists = params.lists() if hasattr(params, "lists") else ((k, [params[k]]) for k in params)
    for key, values in lists:
        if len(values) > 1 and (key == "q" or key not in NOT_FILTERS):
            raise SelectionError(
                f"{key} is given {len(values)} times ({', '.join(map(str, values))}): a bulk "
                f"operation takes one value per filter; to take several, use one filter "
                f"with a comma-separated list, e.g. {key.split('__', 1)[0]}__in=a,b"
            )
    lookups: dict[str, str] = {}
    for key in params:
        if key in NOT_FILTERS:
            continue
        field_name = key.split("__", 1)[0]
        try:
            DeadLetter._meta.get_field(field_name)
        except FieldDoesNotExist as exc:
            raise SelectionError(f"unknown filter {key!r}") from exc
        lookups[key] = str(params[key])
    term = str(params.get("q", "") or "").strip()
    if search_mode is None:
        search_mode = how_search_reads(_filtered(lookups), term)
    elif term and search_mode not in SEARCH_MODES:
        raise SelectionError(f"unknown search mode {search_mode!r}")
    return {
        "lookups": dict(sorted(lookups.items())),
        "search": term,
        "search_mode": search_mode if term else "",
        "status_chosen": any(key.startswith("status") for key in lookups),
        "description": description,
    }


def _value(lookup: str, value: str) -> Any:
    if lookup.endswith("__isnull"):
        return value.lower() not in ("", "0", "false")
    if lookup.endswith("__in"):
        return value.split(",")
    return value


def _filtered(lookups: Mapping[str, str]) -> DeadLetterQuerySet:
    return DeadLetter.objects.filter(**{k: _value(k, v) for k, v in lookups.items()})


def matching(selection: Mapping[str, Any]) -> DeadLetterQuerySet:
    """Every dead letter the selection's filter and search match (as its ``search_mode`` says),
    whatever its status."""
    term = selection.get("search") or ""
    mode = selection.get("search_mode") or ""
    if term.strip() and mode not in SEARCH_MODES:
        raise SelectionError("this selection does not say how its search reads (search_mode)")
    return search(_filtered(selection.get("lookups") or {}), term, mode=mode or None)


def how_search_reads(queryset: QuerySet[DeadLetter], term: str) -> str:
    """How :func:`search` reads ``term`` over ``queryset`` now: :data:`BY_MESSAGE_ID` for
    ``=ID``, or for a single word that is the message_id of some of them (one probe of the
    message_id index); :data:`BY_WORDS` otherwise; "" for no term."""
    term = term.strip()
    if not term:
        return ""
    if term.startswith("="):
        return BY_MESSAGE_ID
    one_word = not any(character.isspace() for character in term)
    return BY_MESSAGE_ID if one_word and queryset.filter(message_id=term).exists() else BY_WORDS


def search(queryset: Rows, term: str, *, mode: str | None = None) -> Rows:
    """The dead letters of ``queryset`` that ``term`` finds, read as ``mode`` says (None:
    decided now): the exact message_id, or every word (quotes group words) in the exception
    message or the payload's JSON, case-insensitively (trigram indexes on PostgreSQL)."""
    term = term.strip()
    if not term:
        return queryset
    if mode is None:
        mode = how_search_reads(queryset, term)
    if mode == BY_MESSAGE_ID:
        return queryset.filter(message_id=term.removeprefix("=").strip())
    # alias(), not annotate(): the cast is needed in the WHERE clause only. Django writes
    # UPPER(("payload")::text) for it, the expression the trigram index is built on.
    queryset = queryset.alias(payload_text=Cast("payload", output_field=TextField()))
    for word in search_words(term):
        queryset = queryset.filter(
            Q(exception_message__icontains=word) | Q(payload_text__icontains=word)
        )
    return queryset


def search_words(term: str) -> list[str]:
    """The words of a search term as Django's admin splits them (quotes group words)."""
    words = smart_split(term)
    unquoted = (unescape_string_literal(w) if w[0] in "\"'" and w[0] == w[-1] else w for w in words)
    return [word for word in unquoted if word]


def wanted(kind: str, selection: Mapping[str, Any], now: dt.datetime | None = None) -> Q:
    """Which of the matching dead letters an operation of ``kind`` takes, by status: without a
    status filter only dead ones (and replays presumed lost), not those discarded on purpose."""
    if kind == OperationKind.REPLAY and selection.get("status_chosen"):
        return replayable(now)
    return discardable(now)


def unreplayable(kind: str) -> list[str]:
    """Reasons an operation of ``kind`` leaves out from the start (they would fail again)."""
    return [str(reason) for reason in UNREPLAYABLE_REASONS] if kind == OperationKind.REPLAY else []


def targets(
    kind: str, selection: Mapping[str, Any], now: dt.datetime | None = None
) -> DeadLetterQuerySet:
    """The dead letters an operation of ``kind`` over ``selection`` takes (the replay's
    refusal rules still judge each one in its batch)."""
    return (
        matching(selection)
        .filter(wanted(kind, selection, now))
        .exclude(reason__in=unreplayable(kind))
    )
