"""Test your handlers without a broker.

``deliver`` runs a registered handler through the same code path ``manage.py consume`` uses
(decode, inbox row, ``transaction.atomic()``, retry decision, dead letter), against your test
database, and returns what the consumer would have done::

    from reliable_messaging.testing import deliver

    def test_charge_is_taken_once(db):
        first = deliver("billing.charge-order", {"order_id": 1}, message_id="m-1")
        again = deliver("billing.charge-order", {"order_id": 1}, message_id="m-1")
        assert (first.result, again.result) == ("processed", "duplicate")
        assert Payment.objects.count() == 1
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .conf import messaging_settings
from .envelope import ATTEMPT_HEADER, CONTENT_TYPE, Delivery, encode_payload
from .inbox import DeliveryProcessor
from .outcomes import Acknowledge, Outcome, Release, ScheduleRetry
from .registry import ConsumerRegistry, ConsumerSpec, registry

__all__ = ["Acknowledge", "Release", "ScheduleRetry", "deliver", "find_consumer"]


def find_consumer(
    consumer: str | Callable[..., Any], consumers: ConsumerRegistry = registry
) -> ConsumerSpec:
    """A registered consumer by name, queue name or handler function."""
    for spec in consumers:
        if consumer in (spec.name, spec.queue, spec.handler):
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
) -> Outcome:
    """Deliver one message to ``consumer`` as the consume command would, and return the outcome:
    ``Acknowledge("processed" | "duplicate" | "dead_lettered")``, ``ScheduleRetry`` (what the
    broker would redeliver later: call ``deliver`` again with ``attempt=outcome.next_attempt``),
    or ``Release``. ``body`` sends raw bytes instead of encoding ``payload``."""
    spec = consumer if isinstance(consumer, ConsumerSpec) else find_consumer(consumer)
    all_headers = dict(headers or {})
    if attempt != 1:
        all_headers[ATTEMPT_HEADER] = attempt
    delivery = Delivery(
        body=encode_payload(payload) if body is None else body,
        queue=spec.queue,
        exchange=spec.exchange or messaging_settings.exchange,
        routing_key=routing_key if routing_key is not None else (spec.bindings or ("",))[0],
        redelivered=redelivered,
        message_id=str(uuid.uuid4()) if message_id is None else message_id,
        content_type=content_type,
        timestamp=int(time.time()),
        headers=all_headers,
    )
    return DeliveryProcessor(spec).process(delivery)
