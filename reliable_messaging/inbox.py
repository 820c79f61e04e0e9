"""The idempotent consumer: one delivery, one transaction, one inbox row.

``DeliveryProcessor.process`` runs on a worker thread with its own database connection and
never touches pika; it returns an :mod:`outcome <.outcomes>` that the connection's thread
carries out (ack, publish a retry copy then ack, or give the delivery back).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from django.db import (
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)

from .conf import MessagingSettings, messaging_settings
from .dead_letters import record_dead_letter
from .envelope import (
    ATTEMPT_HEADER,
    BROKER_HEADERS,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    REPLAY_HEADER,
    DecodeError,
    Delivery,
    Message,
    decode_delivery,
)
from .exceptions import DatabaseUnavailable
from .models import ProcessedMessage
from .outcomes import Acknowledge, Outcome, ScheduleRetry
from .registry import ConsumerSpec
from .replay import mark_resolved
from .retry import GiveUp, decide

logger = logging.getLogger(__name__)


def database_reachable(alias: str) -> bool:
    """Open a fresh connection to ``alias``; False when the server cannot be reached."""
    connection = connections[alias]
    try:
        connection.close()
        connection.ensure_connection()
    except DatabaseError:
        return False
    return True


def retry_headers(
    delivery: Delivery, message: Message, exc: BaseException, next_attempt: int
) -> dict[str, Any]:
    """Headers of the retried copy: the original's, minus the broker's dead-letter bookkeeping,
    plus the next attempt number and where the message was first published."""
    headers = {k: v for k, v in delivery.headers.items() if k not in BROKER_HEADERS}
    headers[ATTEMPT_HEADER] = next_attempt
    headers[ORIGINAL_EXCHANGE_HEADER] = message.exchange
    headers[ORIGINAL_ROUTING_KEY_HEADER] = message.routing_key
    headers.setdefault(FIRST_FAILED_AT_HEADER, int(time.time() * 1000))
    headers[LAST_ERROR_HEADER] = f"{type(exc).__name__}: {exc}"[:500]
    return headers


class DeliveryProcessor:
    """Runs ``spec``'s handler for deliveries, exactly once per (consumer, message_id)."""

    def __init__(self, spec: ConsumerSpec, settings: MessagingSettings = messaging_settings):
        self.spec = spec
        self.settings = settings
        self.using = router.db_for_write(ProcessedMessage)

    @property
    def max_attempts(self) -> int:
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def retry_delays(self) -> tuple[float, ...]:
        if self.spec.retry_delays is not None:
            return self.spec.retry_delays
        return self.settings.retry_delays

    def process(self, delivery: Delivery) -> Outcome:
        """Handle one delivery. Raises :class:`DatabaseUnavailable` when the database cannot be
        reached: the caller must hold the delivery unacked and call again later."""
        decoded = decode_delivery(
            delivery,
            max_body_bytes=self.settings.max_body_bytes,
            derive_message_id=self.settings.derive_message_id,
        )
        if isinstance(decoded, DecodeError):
            return self._reject_undecodable(delivery, decoded)
        return self._handle(delivery, decoded)

    def _reject_undecodable(self, delivery: Delivery, error: DecodeError) -> Outcome:
        logger.error(
            "dead-lettering message_id=%s consumer=%s: %s (%s)",
            error.message_id or "-",
            self.spec.name,
            error.reason,
            error.detail,
        )
        self._write_dead_letter(
            delivery=delivery,
            message_id=error.message_id,
            reason=error.reason,
            attempts=1,
            exception_message=error.detail,
        )
        return Acknowledge("dead_lettered", error.reason)

    def _handle(self, delivery: Delivery, message: Message) -> Outcome:
        started = time.perf_counter()
        inserted = False
        try:
            with transaction.atomic(using=self.using):
                # The insert comes first: on a duplicate it fails before the handler runs, and
                # with a concurrent twin it waits on the unique index until that one commits or
                # rolls back; so the unique constraint alone decides who takes effect.
                ProcessedMessage.objects.using(self.using).create(
                    consumer=self.spec.name, message_id=message.message_id
                )
                inserted = True
                self.spec.handler(message)
                if REPLAY_HEADER in delivery.headers:
                    mark_resolved(self.spec.name, message.message_id, self.using)
        except IntegrityError as exc:
            if not inserted:
                logger.info(
                    "duplicate message_id=%s consumer=%s attempt=%d: already processed, "
                    "acked without running the handler",
                    message.message_id,
                    self.spec.name,
                    message.attempt,
                )
                return Acknowledge("duplicate")
            return self._on_failure(delivery, message, exc, started)
        except (OperationalError, InterfaceError) as exc:
            if not inserted or not database_reachable(self.using):
                raise DatabaseUnavailable(
                    f"database error on message_id={message.message_id}: {exc}"
                ) from exc
            return self._on_failure(delivery, message, exc, started)
        except Exception as exc:  # noqa: BLE001 - any handler error is an outcome to decide on
            return self._on_failure(delivery, message, exc, started)
        logger.info(
            "processed message_id=%s consumer=%s attempt=%d outcome=processed duration_ms=%.1f",
            message.message_id,
            self.spec.name,
            message.attempt,
            (time.perf_counter() - started) * 1000,
        )
        return Acknowledge("processed")

    def _on_failure(
        self, delivery: Delivery, message: Message, exc: Exception, started: float
    ) -> Outcome:
        duration_ms = (time.perf_counter() - started) * 1000
        decision = decide(
            exc, attempt=message.attempt, max_attempts=self.max_attempts, delays=self.retry_delays
        )
        if isinstance(decision, GiveUp):
            logger.error(
                "dead-lettering message_id=%s consumer=%s attempt=%d outcome=dead_lettered "
                "reason=%s duration_ms=%.1f: %s: %s",
                message.message_id,
                self.spec.name,
                message.attempt,
                decision.reason,
                duration_ms,
                type(exc).__name__,
                exc,
            )
            self._write_dead_letter(
                delivery=delivery,
                message_id=message.message_id,
                reason=decision.reason,
                attempts=message.attempt,
                payload=message.payload,
                exchange=message.exchange,
                routing_key=message.routing_key,
                exception=exc,
                traceback_text="".join(traceback.format_exception(exc)),
            )
            return Acknowledge("dead_lettered", decision.reason)
        logger.warning(
            "retrying message_id=%s consumer=%s attempt=%d outcome=retry next_attempt=%d "
            "in %.3gs duration_ms=%.1f: %s: %s",
            message.message_id,
            self.spec.name,
            message.attempt,
            decision.next_attempt,
            decision.delay,
            duration_ms,
            type(exc).__name__,
            exc,
        )
        return ScheduleRetry(
            delay=decision.delay,
            next_attempt=decision.next_attempt,
            headers=retry_headers(delivery, message, exc, decision.next_attempt),
            error=f"{type(exc).__name__}: {exc}",
        )

    def _write_dead_letter(self, **kwargs: Any) -> None:
        try:
            record_dead_letter(consumer=self.spec.name, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            # Without the row the message must stay with the broker: nothing is lost.
            raise DatabaseUnavailable(
                f"cannot record the dead letter of message_id={kwargs.get('message_id')}: {exc}"
            ) from exc
