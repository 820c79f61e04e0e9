"""Dead letters for deliveries whose handler never decided anything: ``worker_crashed`` and
``timeout`` (:mod:`.crash_guard`), ``consumer_error`` and ``delivery_limit``; a duplicate instead
when the inbox holds the message (``docs/design.md#the-crash-guard``)."""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Mapping
from typing import Any

from django.db import transaction

from .. import metrics
from ..choices import DeadLetterReason
from ..core.database_errors import classify
from ..core.envelope import DecodeError, Delivery, Message, safe_text
from ..core.outcomes import Acknowledge, OutcomeLabel, Release
from ..dead_letters.record import record_dead_letter
from ..models import ProcessedMessage
from .stage import Processor

logger = logging.getLogger(__name__)


def dead_letter_delivery(
    processor: Processor,
    delivery: Delivery,
    *,
    reason: str,
    attempts: int,
    detail: str,
    traceback_text: str = "",
) -> Acknowledge:
    """Record ``delivery`` as a dead letter of ``processor``'s consumer for ``reason``, unless
    the inbox shows it processed already (then it is a duplicate)."""
    try:
        decoded: Message | DecodeError | None = processor.decode(delivery)
    except Exception:  # noqa: BLE001 - decoding may be the very thing that failed
        decoded = None
    message = decoded if isinstance(decoded, Message) else None
    message_id = decoded.message_id if decoded is not None else safe_text(delivery.message_id or "")
    consumer = processor.spec.name
    with transaction.atomic(using=processor.using):
        if message_id and ProcessedMessage.objects.using(processor.using).has(consumer, message_id):
            metrics.consumer_outcome(consumer, OutcomeLabel.DUPLICATE)
            logger.info(
                "duplicate message_id=%s consumer=%s outcome=duplicate: already processed, "
                "acked without running the handler",
                message_id,
                consumer,
            )
            return Acknowledge(OutcomeLabel.DUPLICATE)
        record_dead_letter(
            consumer=consumer,
            delivery=delivery,
            message_id=message_id,
            reason=reason,
            attempts=max(1, attempts),
            payload=message.payload if message is not None else None,
            exchange=message.exchange if message is not None else None,
            routing_key=message.routing_key if message is not None else None,
            exception_message=detail,
            traceback_text=traceback_text,
        )
    metrics.consumer_outcome(consumer, OutcomeLabel.DEAD_LETTERED)
    logger.error(
        "dead-lettering message_id=%s consumer=%s outcome=dead_lettered reason=%s: %s",
        message_id or "-",
        consumer,
        reason,
        detail,
    )
    return Acknowledge(OutcomeLabel.DEAD_LETTERED, reason)


def consumer_error(
    processor: Processor, delivery: Delivery, exc: Exception, errors: int
) -> Acknowledge | Release:
    """Our own code failed on ``delivery`` ``errors`` times: dead-letter it with the traceback,
    or give it back when even that cannot be written."""
    try:
        return dead_letter_delivery(
            processor,
            delivery,
            reason=DeadLetterReason.CONSUMER_ERROR,
            attempts=errors,
            detail=(
                f"the consumer itself (not the handler) failed on it {errors} times: "
                f"{type(exc).__name__}: {exc}"
            ),
            traceback_text="".join(traceback.format_exception(exc)),
        )
    except Exception as error:
        logger.error(
            "message_id=%s: cannot record it as a dead letter either; giving it back",
            delivery.message_id,
            # The database's own trouble (see core.database_errors) needs no traceback.
            exc_info=classify(error) is None,
        )
        return Release("the consumer fails on it and cannot dead-letter it")


def _first_death(headers: Mapping[str, Any], queues: list[str]) -> Mapping[str, Any]:
    """The ``x-death`` entry of the consumer's own queue, else the newest."""
    deaths = headers.get("x-death")
    if not isinstance(deaths, list):
        return {}
    entries = [death for death in deaths if isinstance(death, Mapping)]
    ours = [death for death in entries if death.get("queue") in queues]
    return (ours or entries or [{}])[0]


def ingest_delivery_limit(
    processor: Processor, delivery: Delivery, queues: list[str]
) -> Acknowledge:
    """A message the broker dead-lettered from one of ``queues`` at its delivery limit, recorded
    as it was in the consumer's queue (from ``x-death``), so a replay goes back there."""
    death = _first_death(delivery.headers, queues)
    counts = (delivery.headers.get("x-delivery-count"), death.get("count"))
    count = next((n for n in counts if isinstance(n, int) and not isinstance(n, bool)), 0)
    why = death.get("reason")
    queue, exchange = death.get("queue"), death.get("exchange")
    routing_keys = death.get("routing-keys")
    routing_key = routing_keys[0] if isinstance(routing_keys, list) and routing_keys else None
    original = dataclasses.replace(
        delivery,
        queue=queue if isinstance(queue, str) and queue in queues else queues[0],
        exchange=exchange if isinstance(exchange, str) else delivery.exchange,
        routing_key=routing_key if isinstance(routing_key, str) else delivery.routing_key,
    )
    return dead_letter_delivery(
        processor,
        original,
        reason=DeadLetterReason.DELIVERY_LIMIT,
        attempts=count or 1,
        detail=(
            f"the broker gave up on it after {count or 'too many'} deliveries without an "
            f"outcome (quorum queue x-delivery-limit; dead-lettering reason {why!r}) and "
            f"dead-lettered it to {delivery.queue}"
        ),
    )
