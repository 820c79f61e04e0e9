"""Writing dead letters: one row per (consumer, message_id), updated when it fails again."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from django.db import DataError, router, transaction
from django.utils import timezone

from .. import tracing
from ..choices import DeadLetterStatus, ReplayOutcome
from ..core.envelope import (
    FIRST_FAILED_AT_HEADER,
    MAX_STORED_NESTING,
    ORDERING_KEY_HEADER,
    Delivery,
    bounded_repr,
    jsonable,
    nesting_depth,
    safe_text,
)
from ..core.fingerprints import exception_fingerprint, reason_fingerprint
from ..models import DeadLetter
from ..task_runs.failures import fail_task_of
from . import ledger

logger = logging.getLogger(__name__)


def _clip(value: str, length: int = 255) -> str:
    value = safe_text(value)
    return value if len(value) <= length else value[: length - 1] + "…"


def _first_failed_at(headers: Mapping[str, Any], now: dt.datetime) -> dt.datetime:
    raw = headers.get(FIRST_FAILED_AT_HEADER)
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        try:
            return dt.datetime.fromtimestamp(raw / 1000, tz=dt.UTC)
        except (OverflowError, OSError, ValueError):
            return now
    return now


def record_dead_letter(
    *,
    consumer: str,
    delivery: Delivery,
    message_id: str,
    reason: str,
    attempts: int,
    payload: Any = None,
    exchange: str | None = None,
    routing_key: str | None = None,
    exception: BaseException | None = None,
    exception_message: str = "",
    traceback_text: str = "",
) -> DeadLetter:
    """Store (or update) the dead letter of ``message_id`` for ``consumer``; raises the
    database's error when the row cannot be written (the caller must then not ack)."""
    now = timezone.now()
    exception_type = ""
    fingerprint = reason_fingerprint(reason)
    if exception is not None:
        exception_type = f"{type(exception).__module__}.{type(exception).__qualname__}"
        exception_message = exception_message or str(exception)
        fingerprint = exception_fingerprint(exception)
    ordering_key = delivery.headers.get(ORDERING_KEY_HEADER)
    message_id = _clip(message_id)
    if payload is not None and nesting_depth(payload) > MAX_STORED_NESTING:
        # json's recursive encoder would pass Python's recursion limit: the body keeps it all.
        logger.warning(
            "dead letter payload of message_id=%s nests deeper than %d levels; "
            "storing the raw body only",
            message_id,
            MAX_STORED_NESTING,
        )
        payload = None
    fields: dict[str, Any] = {
        "queue": _clip(delivery.queue),
        "ordering_key": _clip(ordering_key) if isinstance(ordering_key, str) else None,
        "exchange": _clip(exchange if exchange is not None else delivery.exchange),
        "routing_key": _clip(routing_key if routing_key is not None else delivery.routing_key),
        "headers": jsonable(dict(delivery.headers), max_depth=MAX_STORED_NESTING),
        "payload": jsonable(payload),
        "body": bytes(delivery.body),
        "content_type": _clip(delivery.content_type or ""),
        "reason": reason,
        "exception_type": _clip(exception_type),
        "exception_message": safe_text(exception_message),
        "traceback": safe_text(traceback_text),
        "attempts": attempts,
        "last_failed_at": now,
        "status": DeadLetterStatus.DEAD,
        "fingerprint": fingerprint,
        "trace_id": "",
        "span_id": "",
    }
    event = {
        "event": "dead_lettered",
        "at": now.isoformat(),
        "reason": reason,
        "attempts": attempts,
        "exception_type": exception_type,
    }
    traced = tracing.ids_of(delivery)
    if traced is not None:
        fields["trace_id"], fields["span_id"] = traced
        event["trace_id"] = traced[0]
    using = router.db_for_write(DeadLetter)
    row = _store(using, consumer, message_id, fields, event, delivery, now)
    # A replayed copy that failed again: its replay's ledger row says so.
    ledger.settle(
        delivery,
        consumer,
        message_id,
        ReplayOutcome.FAILED_AGAIN,
        using=using,
        failed_as=row,
        trace_id=traced[0] if traced else None,
    )
    return row


def _store(
    using: str,
    consumer: str,
    message_id: str,
    fields: dict[str, Any],
    event: dict[str, Any],
    delivery: Delivery,
    now: dt.datetime,
) -> DeadLetter:
    first = _first_failed_at(delivery.headers, now)

    def upsert() -> DeadLetter:
        with transaction.atomic(using=using):
            row = DeadLetter.objects.using(using).record_failure(
                consumer, message_id, fields=fields, event=event, first_failed_at=first
            )
            # A task's message: its TaskRun is FAILED with the dead letter.
            fail_task_of(row, using)
            return row

    try:
        return upsert()
    except DataError:
        # A payload the database's JSON type refuses: keep the raw body, which always survives
        # byte for byte, and drop the decoded copy; then, if need be, the headers' too.
        logger.warning(
            "dead letter payload of message_id=%s refused by the database; "
            "storing the raw body only",
            message_id,
        )
        fields["payload"] = None
        try:
            return upsert()
        except DataError:
            fields["headers"] = {"unstorable_headers": safe_text(bounded_repr(delivery.headers))}
            return upsert()
