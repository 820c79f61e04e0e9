"""Test your handlers without a broker: ``deliver`` runs a handler through the code path
``manage.py consume`` uses, ``published()`` lists what ``publish()`` wrote and ``run_outbox()``
delivers it (``docs/testing-handlers.md``)."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, is_typeddict

from django.db import router
from django.utils import timezone

from .broker.topology import consumer_exchange, consumer_queues
from .choices import OutboxStatus
from .consuming.processing import DeliveryProcessor
from .consuming.retry_rows import copy_key
from .core.envelope import (
    ATTEMPT_HEADER,
    CONTENT_TYPE,
    ORDERING_KEY_HEADER,
    Delivery,
    Message,
    encode_payload,
)
from .core.outcomes import Acknowledge, Outcome, Release, RetryInPlace, ScheduleRetry
from .core.registry import ConsumerRegistry, ConsumerSpec, registry
from .core.routing import topic_matches
from .core.uuid7 import new_message_id
from .managers import OutboxMessageQuerySet
from .models import OutboxMessage
from .publishing.scheduled import promote_due

__all__ = [
    "Acknowledge",
    "Release",
    "RetryInPlace",
    "ScheduleRetry",
    "deliver",
    "find_consumer",
    "published",
    "run_outbox",
    "scheduled",
]


def find_consumer(
    consumer: str | Callable[..., Any], consumers: ConsumerRegistry = registry
) -> ConsumerSpec:
    """A registered consumer by name, queue name or handler function."""
    for spec in consumers:
        if consumer in (spec.name, spec.queue, spec.function):
            return spec
    known = ", ".join(s.name for s in consumers) or "none"
    raise LookupError(f"no registered consumer matches {consumer!r}; registered: {known}")


def deliver(
    consumer: str | Callable[..., Any] | ConsumerSpec,
    payload: Any = None,
    *,
    message_id: str | None = None,
    routing_key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    attempt: int = 1,
    body: bytes | None = None,
    content_type: str | None = CONTENT_TYPE,
    redelivered: bool = False,
    exchange: str | None = None,
) -> Outcome:
    """Deliver one message to ``consumer`` as ``consume`` would (call it from a sync test for
    an ``async def`` handler too) and return the outcome; after a ``ScheduleRetry`` or
    ``RetryInPlace``, deliver again with ``attempt=outcome.next_attempt``."""
    spec = consumer if isinstance(consumer, ConsumerSpec) else find_consumer(consumer)
    all_headers = dict(headers or {})
    if attempt != 1:
        all_headers[ATTEMPT_HEADER] = attempt
    exchange = consumer_exchange(spec) if exchange is None else exchange
    if routing_key is None:
        routing_key = (spec.bindings or ("",))[0]
    queues = consumer_queues(spec)
    delivery = Delivery(
        body=_body_of(spec, payload) if body is None else body,
        queue=routing_key if exchange == "" and routing_key in queues else queues[0],
        exchange=exchange,
        routing_key=routing_key,
        redelivered=redelivered,
        message_id=new_message_id() if message_id is None else message_id,
        content_type=content_type,
        timestamp=int(time.time()),
        headers=all_headers,
    )
    return DeliveryProcessor(spec).process(delivery)


def _body_of(spec: ConsumerSpec, payload: Any) -> bytes:
    """``payload`` encoded as ``publish()`` encodes it; an object of the consumer's declared type
    (a pydantic model or a dataclass) in that type's JSON form."""
    contract = spec.payload
    declared = None if contract is None or is_typeddict(contract.type) else contract.type
    if isinstance(declared, type) and isinstance(payload, declared):
        return contract.encode(payload)  # type: ignore[union-attr]
    return encode_payload(payload)


def published(routing_key: str | None = None, *, using: str | None = None) -> list[Message]:
    """Messages ``publish()`` wrote and no relay has sent yet, oldest first, as handlers would
    see them; optionally only those with ``routing_key``. Retry copies are not among them."""
    rows = _outbox(using).pending().filter(raw_properties__isnull=True).order_by("id")
    if routing_key is not None:
        rows = rows.filter(routing_key=routing_key)
    return [_message_of(row) for row in rows]


def _outbox(using: str | None) -> OutboxMessageQuerySet:
    return OutboxMessage.objects.using(using or router.db_for_write(OutboxMessage))


def _message_of(row: OutboxMessage) -> Message:
    """An outbox row as its handlers would see it."""
    return Message(
        message_id=row.message_id,
        routing_key=row.routing_key,
        exchange=row.exchange,
        payload=json.loads(row.body),
        headers=dict(row.headers),
        published_at=row.deliver_at or row.created_at,
        ordering_key=row.ordering_key,
    )


def scheduled(*, using: str | None = None) -> list[tuple[dt.datetime, Message]]:
    """Scheduled messages waiting for their due time, earliest first: ``(due, message)``; retry
    copies are not among them."""
    rows = _outbox(using).filter(status=OutboxStatus.SCHEDULED, raw_properties__isnull=True)
    rows = rows.order_by("next_attempt_at", "id")
    return [(row.deliver_at or row.created_at, _message_of(row)) for row in rows]


def _routes_to(row: OutboxMessage, spec: ConsumerSpec) -> bool:
    if row.exchange == "":  # the default exchange: straight to the queue of that name
        return row.routing_key in consumer_queues(spec)
    return row.exchange == consumer_exchange(spec) and any(
        topic_matches(binding, row.routing_key) for binding in spec.bindings
    )


def run_outbox(
    *,
    consumers: ConsumerRegistry = registry,
    using: str | None = None,
    max_rounds: int = 100,
    due_by: dt.datetime | None = None,
) -> list[tuple[str, str, Outcome]]:
    """Deliver pending outbox rows (and scheduled ones due by ``due_by``, default now) to every
    consumer bound to them, retries at once, until none is left; mark them sent and return
    ``(consumer, message_id, outcome)`` in delivery order."""
    using = using or router.db_for_write(OutboxMessage)
    results: list[tuple[str, str, Outcome]] = []
    for _ in range(max_rounds):
        while promote_due(using, due_by=due_by):  # as the relay does when they fall due
            pass
        rows = list(OutboxMessage.objects.using(using).pending().order_by("id"))
        if not rows:
            return results
        for row in rows:
            for spec in consumers:
                if not _routes_to(row, spec):
                    continue
                headers: dict[str, Any] = dict(row.headers)
                if row.ordering_key is not None:
                    headers[ORDERING_KEY_HEADER] = row.ordering_key
                attempt = 1
                while True:
                    outcome = deliver(
                        spec,
                        body=row.body.encode("utf-8"),
                        message_id=row.message_id,
                        routing_key=row.routing_key,
                        headers=headers,
                        attempt=attempt,
                        exchange=row.exchange,
                    )
                    results.append((spec.name, row.message_id, outcome))
                    if not isinstance(outcome, ScheduleRetry | RetryInPlace):
                        break
                    if isinstance(outcome, ScheduleRetry):
                        # Delivered again here at once: its copy in the outbox is not needed.
                        key = copy_key(spec.name, row.message_id, outcome)
                        OutboxMessage.objects.using(using).filter(idempotency_key=key).delete()
                    attempt = outcome.next_attempt
            row.status = OutboxStatus.SENT
            row.sent_at = timezone.now()
            row.save(using=using, update_fields=["status", "sent_at"])
    raise RuntimeError(
        f"the outbox was still not empty after {max_rounds} rounds: do handlers publish in a loop?"
    )
