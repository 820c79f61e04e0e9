"""``publish()``: the transactional outbox's write side.

``publish`` only inserts a row, on the caller's database connection and so inside the caller's
transaction: the message exists exactly when the business change it announces exists. The relay
(:mod:`.relay`) sends committed rows later. Called with no transaction open (autocommit), the
row commits at once, like any other ORM write.

Once the transaction commits (at once in autocommit), the relay is woken from outside it
(:mod:`.wake_after_commit`): nothing in the caller's commit path takes PostgreSQL's instance-wide
notification lock.

The row's times are the database's clock, not this host's: the relay compares them with the
database's clock, and a publisher whose clock runs ahead would otherwise hold its own messages
back by the skew.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

from django.db import IntegrityError, connections, router, transaction
from django.db.models import Field
from django.db.models.functions import Now

from .. import tracing
from ..broker.limits import body_size_refusal
from ..choices import OutboxStatus
from ..conf import messaging_settings
from ..core.envelope import MAX_MESSAGE_ID_LENGTH, encode_payload
from ..core.envelope import check_short_string as _check_short_string
from ..core.envelope import checked_headers as _json_headers
from ..core.uuid7 import new_message_id
from ..models import OutboxMessage
from ..storage.partitions import IDEMPOTENCY_LOCK_CLASS
from .wake_after_commit import wake_relay_after_commit


def publish(
    routing_key: str,
    payload: Any,
    *,
    exchange: str | None = None,
    message_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    idempotency_key: str | None = None,
    using: str | None = None,
) -> str:
    """Write a message to the outbox in the current transaction of ``using``; return its id.

    ``using`` defaults to the alias the database routers give for writing ``OutboxMessage``
    (``"default"`` without routers), which is where the relay reads: publish inside a
    transaction on that alias. The relay sends the message once the transaction commits; a
    rollback discards it. A payload JSON cannot encode raises ``TypeError`` here; a body larger
    than ``MAX_BODY_BYTES`` (or than the broker's ``max_message_size``, once this process has
    learned it) raises ``ValueError``. With an ``idempotency_key`` already in the
    outbox this is a no-op that returns the first message's id.
    """
    if not isinstance(routing_key, str) or not routing_key:
        raise ValueError("routing_key must be a non-empty string")
    if using is None:
        using = router.db_for_write(OutboxMessage)
    encoded = encode_payload(payload)
    # Consumers of this app dead-letter larger bodies unread (body_too_large): refuse them here,
    # where the caller can still do something about it, rather than after the commit.
    # The broker's own limit too, when this process has learned it (the relay and consume ask
    # at start; the deploy check compares it with MAX_BODY_BYTES): it would refuse the message.
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
    # With tracing on: a "publish" span in the caller's trace, whose context the row keeps (a
    # traceparent the caller gave is kept instead).
    span, trace_headers = tracing.start_publish(exchange, routing_key, message_id, len(encoded))
    if "traceparent" not in headers:
        headers.update(trace_headers)
    try:
        written = _write(
            using, message_id, exchange, routing_key, body, headers, ordering_key, idempotency_key
        )
    except BaseException as exc:
        tracing.end(span, exc)
        raise
    if span is not None and written != message_id:
        span.set_attribute("reliable_messaging.published_before_as", written)
    tracing.end(span)
    wake_relay_after_commit(using)
    return written


def _write(
    using: str,
    message_id: str,
    exchange: str,
    routing_key: str,
    body: str,
    headers: dict[str, Any],
    ordering_key: str | None,
    idempotency_key: str | None,
) -> str:
    """Insert the row; returns its message_id (an earlier message's, for an idempotency key
    published before)."""
    if connections[using].vendor == "postgresql":
        headers_json = json.dumps(headers) if headers else "{}"
        values = [
            message_id,
            exchange,
            routing_key,
            body,
            headers_json,
            ordering_key,
            idempotency_key,
        ]
        if idempotency_key is None:
            _insert_pg(using, values)
            return message_id
        return _publish_once_pg(values, idempotency_key, using)
    row = OutboxMessage(
        message_id=message_id,
        exchange=exchange,
        routing_key=routing_key,
        body=body,
        headers=headers,
        ordering_key=ordering_key,
        idempotency_key=idempotency_key,
        next_attempt_at=Now(),
        created_at=Now(),
    )
    if idempotency_key is None:
        row.save(using=using, force_insert=True)
        return message_id
    return _publish_once(row, idempotency_key, using)


def _insert_sql(ordering_key: bool, idempotency_key: bool) -> str:
    """One INSERT of a new pending row, its times the database's clock (``Now()`` is
    ``STATEMENT_TIMESTAMP()`` on PostgreSQL). A key the call has none of is left out rather than
    written as NULL (the column's value then): PostgreSQL parses, checks and plans every column
    an INSERT names, and most publishes have neither key."""
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
    columns = [cast("Field[Any, Any]", meta.get_field(name)).column for name in [*given, *fixed]]
    placeholders = ["%s"] * len(given) + list(fixed.values())
    placeholders[given.index("headers")] = "%s::jsonb"
    quoted = ", ".join(f'"{column}"' for column in columns)
    return f'INSERT INTO "{meta.db_table}" ({quoted}) VALUES ({", ".join(placeholders)})'  # noqa: S608


# Built once, one per combination of keys given: on PostgreSQL publish() writes its row with
# these statements rather than through Model.save(), whose SQL compiler costs as much Python
# time per call as the rest of publish(). So no pre_save/post_save signal is sent for
# outbox rows there (the changelog says so); this app never connected one.
_INSERT_PG = {
    (ordering, once): _insert_sql(ordering, once)
    for ordering in (False, True)
    for once in (False, True)
}


def _insert_pg(using: str, values: list[Any]) -> None:
    """``values``: message_id, exchange, routing_key, body, headers (JSON text), ordering_key,
    idempotency_key (the keys None when not given, and then left out)."""
    *row, ordering_key, idempotency_key = values
    statement = _INSERT_PG[ordering_key is not None, idempotency_key is not None]
    given = [key for key in (ordering_key, idempotency_key) if key is not None]
    with connections[using].cursor() as cursor:
        cursor.execute(statement, [*row, *given])


def _earlier(idempotency_key: str, using: str) -> str | None:
    return OutboxMessage.objects.using(using).message_id_of(idempotency_key)


def _publish_once_pg(values: list[Any], idempotency_key: str, using: str) -> str:
    """On PostgreSQL a unique index spans one partition of the outbox, and a message sent leaves the
    unsent partition (``storage/partitions.py``): an earlier message of the key is looked for in
    every partition, under an advisory lock on the key held to the end of the transaction. A second
    publish of the key waits there until the first commits (or rolls back), then, in READ COMMITTED,
    its lookup sees the first's row."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            [IDEMPOTENCY_LOCK_CLASS, idempotency_key],
        )
        existing = _earlier(idempotency_key, using)
        if existing is not None:
            return existing
        _insert_pg(using, values)
    return str(values[0])


def _publish_once(row: OutboxMessage, idempotency_key: str, using: str) -> str:
    message_id = str(row.message_id)
    for _ in range(3):
        try:
            # A savepoint, so a duplicate key leaves the caller's transaction usable. Under
            # concurrency the second insert waits on the unique index until the first commits.
            with transaction.atomic(using=using):
                row.save(using=using, force_insert=True)
        except IntegrityError:
            existing = _earlier(idempotency_key, using)
            if existing is not None:
                return existing
            row.pk = None  # the other insert rolled back meanwhile: ours may go now
            continue
        return message_id
    raise IntegrityError(f"could not publish with idempotency_key={idempotency_key!r}")
