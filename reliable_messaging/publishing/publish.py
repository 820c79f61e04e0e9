"""``publish()``: the outbox's write side, a row in the caller's transaction that the relay
sends once committed, woken after the commit (:mod:`.wake_after_commit`)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.db import IntegrityError, connections, router, transaction
from django.db.models import DateTimeField, DurationField, Field, Value
from django.db.models.expressions import Combinable
from django.db.models.functions import Now

from .. import tracing
from ..broker.limits import body_size_refusal, header_frame_refusal
from ..choices import OutboxStatus
from ..conf import messaging_settings
from ..contracts import contract_for
from ..core.advisory_locks import IDEMPOTENCY_LOCK_CLASS
from ..core.envelope import (
    EXPIRES_AT_HEADER,
    MAX_MESSAGE_ID_LENGTH,
    ORDERING_KEY_HEADER,
    encode_payload,
)
from ..core.envelope import check_short_string as _check_short_string
from ..core.envelope import checked_headers as _json_headers
from ..core.uuid7 import new_message_id
from ..models import OutboxMessage
from .scheduled import cancel as _cancel
from .wake_after_commit import release_after_commit, wake_relay_after_commit

# The largest deadline (milliseconds since 1970) a long header carries.
_MAX_LONG = 2**63 - 1


def publish(
    routing_key: str,
    payload: Any,
    *,
    exchange: str | None = None,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    idempotency_key: str | None = None,
    deliver_at: dt.datetime | None = None,
    delay: dt.timedelta | float | None = None,
    expires: dt.timedelta | float | None = None,
    using: str | None = None,
) -> str:
    """Write a message to the outbox in the current transaction of ``using`` (by default the
    outbox model's write alias, where the relay reads); return its id.

    ``deliver_at`` (an aware datetime) or ``delay`` (a timedelta or seconds, by the database's
    clock) schedules it; ``expires`` (a timedelta or seconds, from the publish or the later due
    time) is its deadline. An ``idempotency_key`` already in the outbox returns the first
    message's id. A payload JSON cannot encode raises ``TypeError``, what AMQP or the broker
    cannot carry ``ValueError``, and a payload its routing key's declared type refuses
    :class:`~reliable_messaging.contracts.PayloadInvalid` (docs/reference/api.md).
    """
    if not isinstance(routing_key, str) or not routing_key:
        raise ValueError("routing_key must be a non-empty string")
    if using is None:
        using = router.db_for_write(OutboxMessage)
    encoded = _encoded(routing_key, payload)
    # Refused here, where the caller can still do something, not dead-lettered after the commit.
    refusal = body_size_refusal(len(encoded))
    if refusal is not None:
        raise ValueError(refusal)
    body = encoded.decode("utf-8")
    message_id = new_message_id() if message_id is None else str(message_id)
    if not message_id or len(message_id) > MAX_MESSAGE_ID_LENGTH:
        raise ValueError(f"message_id must be 1 to {MAX_MESSAGE_ID_LENGTH} characters long")
    _check_short_string("message_id", message_id)
    _check_short_string("routing_key", routing_key)
    if exchange is not None:
        _check_short_string("exchange", exchange)
    exchange = messaging_settings.exchange if exchange is None else exchange
    headers = _json_headers(headers)
    due = _due(deliver_at, delay)
    if expires is not None:
        headers[EXPIRES_AT_HEADER] = _deadline_ms(expires, deliver_at, delay)
    # With tracing on: a "publish" span, whose context the row keeps (unless the caller gave one).
    span, trace_headers = tracing.start_publish(exchange, routing_key, message_id, len(encoded))
    if "traceparent" not in headers:
        headers.update(trace_headers)
    if headers or ordering_key is not None:
        sent = headers if ordering_key is None else {**headers, ORDERING_KEY_HEADER: ordering_key}
        refusal = header_frame_refusal(message_id, sent)
        if refusal is not None:
            tracing.end(span, ValueError(refusal))
            raise ValueError(refusal)
    try:
        written = _write(
            using,
            message_id,
            exchange,
            routing_key,
            body,
            headers,
            ordering_key,
            idempotency_key,
            due,
        )
    except BaseException as exc:
        tracing.end(span, exc)
        raise
    if span is not None and written != message_id:
        span.set_attribute("reliable_messaging.published_before_as", written)
    tracing.end(span)
    wake_relay_after_commit(using)
    return written


async def apublish(
    routing_key: str,
    payload: Any,
    *,
    exchange: str | None = None,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    idempotency_key: str | None = None,
    deliver_at: dt.datetime | None = None,
    delay: dt.timedelta | float | None = None,
    expires: dt.timedelta | float | None = None,
    using: str | None = None,
) -> str:
    """:func:`publish` for async code (the same arguments, checks and errors), written on the
    connection Django's async ORM uses: an async view's row commits at once, an async handler's
    joins its delivery's transaction (docs/concepts.md#async-handlers-and-apublish)."""
    return await _publish_on_sync_thread(
        routing_key,
        payload,
        exchange=exchange,
        message_id=message_id,
        headers=headers,
        ordering_key=ordering_key,
        idempotency_key=idempotency_key,
        deliver_at=deliver_at,
        delay=delay,
        expires=expires,
        using=using,
    )


_publish_on_sync_thread = sync_to_async(publish, thread_sensitive=True)


def _encoded(routing_key: str, payload: Any) -> bytes:
    """The body: ``payload`` checked against and encoded by its declared type, if any."""
    contract = contract_for(routing_key)
    if contract is None:
        return encode_payload(payload)
    return contract.encode(contract.validate(payload))


def cancel_scheduled(message_id: str, *, using: str | None = None) -> bool:
    """Cancel a scheduled message not sent yet, in the current transaction of ``using``; False
    when none was waiting (never scheduled, cancelled before, or already due). A consumer's
    retry is not one; a deferred task's result goes with its message."""
    if using is None:
        using = router.db_for_write(OutboxMessage)
    return _cancel(str(message_id), using)


def _seconds(name: str, value: dt.timedelta | float) -> float:
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a timedelta or a number of seconds, got {value!r}")
    return float(value)


def _due(deliver_at: dt.datetime | None, delay: dt.timedelta | float | None) -> Combinable | None:
    """The due time of a scheduled message as a database value, by the database's clock."""
    if deliver_at is not None and delay is not None:
        raise ValueError("give deliver_at or delay, not both")
    if deliver_at is not None:
        if not isinstance(deliver_at, dt.datetime):
            raise TypeError(f"deliver_at must be a datetime, got {deliver_at!r}")
        if deliver_at.utcoffset() is None:
            raise ValueError("deliver_at must be timezone-aware (a naive time is ambiguous)")
        if deliver_at.timestamp() < 0:
            raise ValueError(
                f"deliver_at {deliver_at.isoformat()} is before 1970-01-01T00:00:00Z: AMQP's "
                f"timestamp property counts unsigned seconds from then, so no message can "
                f"carry it"
            )
        return Value(deliver_at, output_field=DateTimeField())
    if delay is None:
        return None
    seconds = _seconds("delay", delay)
    if seconds < 0:
        raise ValueError(f"delay must not be negative, got {seconds} s")
    return Now() + Value(dt.timedelta(seconds=seconds), output_field=DurationField())


def _deadline_ms(
    expires: dt.timedelta | float,
    deliver_at: dt.datetime | None,
    delay: dt.timedelta | float | None,
) -> int:
    """The deadline in Unix milliseconds (this host's clock): ``expires`` after due or now."""
    seconds = _seconds("expires", expires)
    if not seconds > 0:  # NaN too
        raise ValueError(f"expires must be positive, got {seconds} s")
    now = time.time()
    if deliver_at is not None:
        start = max(deliver_at.timestamp(), now)
    else:
        start = now + (_seconds("delay", delay) if delay is not None else 0.0)
    deadline = (start + seconds) * 1000
    if not math.isfinite(deadline) or int(deadline) > _MAX_LONG:
        raise ValueError(
            f"expires={expires!r} puts the deadline past {_MAX_LONG} ms after 1970, the "
            f"largest time the {EXPIRES_AT_HEADER} header (a signed 64-bit integer) can carry"
        )
    return int(deadline)


def _write(
    using: str,
    message_id: str,
    exchange: str,
    routing_key: str,
    body: str,
    headers: dict[str, Any],
    ordering_key: str | None,
    idempotency_key: str | None,
    due: Combinable | None = None,
) -> str:
    """Insert the row; returns its message_id (or the idempotency key's earlier one)."""
    postgresql = connections[using].vendor == "postgresql"
    if due is None and postgresql:
        values = [message_id, exchange, routing_key, body, json.dumps(headers) if headers else "{}"]
        insert = functools.partial(_insert_pg, using, values, ordering_key, idempotency_key)
    else:
        row = OutboxMessage(
            message_id=message_id,
            exchange=exchange,
            routing_key=routing_key,
            body=body,
            headers=headers,
            ordering_key=ordering_key,
            idempotency_key=idempotency_key,
            next_attempt_at=Now() if due is None else due,
            created_at=Now(),
        )
        if due is not None:
            row.status = OutboxStatus.SCHEDULED
            row.deliver_at = due
        if idempotency_key is not None and not postgresql:
            return _publish_once(row, idempotency_key, using)
        insert = functools.partial(row.save, using=using, force_insert=True)
    if idempotency_key is None:
        insert()
        return message_id
    return _publish_once_pg(insert, idempotency_key, using, message_id)


def _insert_sql(ordering_key: bool, idempotency_key: bool) -> str:
    """One INSERT of a new pending row; a key not given is left out rather than written as
    NULL (PostgreSQL plans every column an INSERT names, and most publishes have neither)."""
    meta = OutboxMessage._meta
    given = ["message_id", "exchange", "routing_key", "body", "headers"]
    if ordering_key:
        given.append("ordering_key")
    if idempotency_key:
        given.append("idempotency_key")
    fixed = {
        "status": f"'{OutboxStatus.PENDING.value}'",
        "attempts": "0",
        "last_error": "''",
        "next_attempt_at": "STATEMENT_TIMESTAMP()",
        "created_at": "STATEMENT_TIMESTAMP()",
    }
    returning = ""
    if ordering_key:
        # Written parked behind any unsent row of its key, so that no claim has to find it due
        # and park it (docs/concepts.md); whether it was comes back.
        fixed["next_attempt_at"] = (
            f'CASE WHEN EXISTS (SELECT FROM "{meta.db_table}" u '
            "WHERE u.ordering_key = %s AND u.status IN ('pending', 'failed')) "
            "THEN NULL ELSE STATEMENT_TIMESTAMP() END"
        )
        returning = f' RETURNING "{meta.get_field("next_attempt_at").column}" IS NULL'
    columns = [cast("Field[Any, Any]", meta.get_field(name)).column for name in [*given, *fixed]]
    placeholders = ["%s"] * len(given) + list(fixed.values())
    placeholders[given.index("headers")] = "%s::jsonb"
    quoted = ", ".join(f'"{column}"' for column in columns)
    values = ", ".join(placeholders)
    return f'INSERT INTO "{meta.db_table}" ({quoted}) VALUES ({values}){returning}'  # noqa: S608


# On PostgreSQL, not Model.save(), whose compiler costs as much as the rest of publish().
_INSERT_PG = {
    (ordering, once): _insert_sql(ordering, once)
    for ordering in (False, True)
    for once in (False, True)
}


def _insert_pg(
    using: str, row: list[Any], ordering_key: str | None, idempotency_key: str | None
) -> None:
    """``row``: message_id, exchange, routing_key, body, headers (JSON); keys not given left out
    (the ordering key is given twice: its column, and the look at its key's unsent rows). A row
    written parked is released after the commit if its key has emptied meanwhile."""
    statement = _INSERT_PG[ordering_key is not None, idempotency_key is not None]
    given = [key for key in (ordering_key, idempotency_key, ordering_key) if key is not None]
    with connections[using].cursor() as cursor:
        cursor.execute(statement, [*row, *given])
        if ordering_key is not None and cursor.fetchone()[0]:
            release_after_commit(using, ordering_key)


def _publish_once_pg(
    insert: Callable[[], None], idempotency_key: str, using: str, message_id: str
) -> str:
    """A unique index spans one partition: the key is looked for in every partition, under an
    advisory lock on it held to the end of the transaction (``docs/concepts.md``)."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            [IDEMPOTENCY_LOCK_CLASS, idempotency_key],
        )
        existing = OutboxMessage.objects.using(using).message_id_of(idempotency_key)
        if existing is not None:
            return existing
        insert()
    return message_id


def _publish_once(row: OutboxMessage, idempotency_key: str, using: str) -> str:
    message_id = str(row.message_id)
    for _ in range(3):
        try:
            # A savepoint, so a duplicate key leaves the caller's transaction usable.
            with transaction.atomic(using=using):
                row.save(using=using, force_insert=True)
        except IntegrityError:
            existing = OutboxMessage.objects.using(using).message_id_of(idempotency_key)
            if existing is not None:
                return existing
            row.pk = None  # the other insert rolled back meanwhile: ours may go now
            continue
        return message_id
    raise IntegrityError(f"could not publish with idempotency_key={idempotency_key!r}")
