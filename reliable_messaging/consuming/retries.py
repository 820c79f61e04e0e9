"""Where a failed delivery becomes a retry or a dead letter: the whole policy of the consumer
(:func:`decide` and :class:`DeliveryFailures`). What the database does is never a handler's
failure (``docs/delivery-outcomes.md``)."""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from django.db import DatabaseError, InterfaceError, OperationalError

from ..conf import MessagingSettings
from ..core.database_errors import DatabaseTrouble, classify
from ..core.delays import delay_for
from ..core.envelope import (
    ATTEMPT_HEADER,
    BROKER_HEADERS,
    DEFERRALS_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    DecodeError,
    Delivery,
    Message,
)
from ..core.outcomes import (
    Acknowledge,
    FailureReason,
    OutcomeLabel,
    RetryInPlace,
    ScheduleRetry,
)
from ..core.registry import ConsumerSpec
from ..dead_letters.record import record_dead_letter
from ..exceptions import (
    DatabaseConflict,
    DatabaseUnavailable,
    HandlerTimeout,
    PermanentError,
)
from ..storage.inbox import LOCK_TIMEOUT
from .stage import DeliveryOutcome


@dataclasses.dataclass(frozen=True)
class RetryLater:
    """Send a copy back to the consumer's queue after ``delay`` seconds as ``next_attempt``."""

    delay: float
    next_attempt: int


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Stop retrying: the message becomes a dead letter for ``reason``."""

    reason: str


def decide(
    exc: BaseException, *, attempt: int, max_attempts: int, delays: Sequence[float]
) -> RetryLater | GiveUp:
    """What a handler's exception at ``attempt`` makes of the delivery."""
    if isinstance(exc, PermanentError):
        return GiveUp(FailureReason.PERMANENT)
    if attempt >= max_attempts or not delays:
        if isinstance(exc, HandlerTimeout):
            return GiveUp(FailureReason.TIMEOUT)
        return GiveUp(FailureReason.RETRIES_EXHAUSTED)
    return RetryLater(delay=delay_for(attempt, delays), next_attempt=attempt + 1)


def retry_headers(
    delivery: Delivery, message: Message, exc: BaseException, next_attempt: int
) -> dict[str, Any]:
    """Headers of the retried copy: the original's, minus the broker's dead-letter bookkeeping,
    plus the next attempt number and where the message was first published."""
    headers = _copy_headers(delivery, message, next_attempt)
    headers.setdefault(FIRST_FAILED_AT_HEADER, int(time.time() * 1000))
    headers[LAST_ERROR_HEADER] = f"{type(exc).__name__}: {exc}"[:500]
    return headers


def _copy_headers(
    delivery: Delivery, message: Message, attempt: int, deferrals: int | None = None
) -> dict[str, Any]:
    """The original's headers for a copy at ``attempt``, without the broker's bookkeeping (and,
    unless ``deferrals`` is given, without the deferral count)."""
    headers = {
        k: v
        for k, v in delivery.headers.items()
        if k not in BROKER_HEADERS and (deferrals is not None or k != DEFERRALS_HEADER)
    }
    headers[ATTEMPT_HEADER] = attempt
    if deferrals is not None:
        headers[DEFERRALS_HEADER] = deferrals
    headers[ORIGINAL_EXCHANGE_HEADER] = message.exchange
    headers[ORIGINAL_ROUTING_KEY_HEADER] = message.routing_key
    return headers


def raise_for_our_write(exc: DatabaseError, what: str) -> NoReturn:
    """A write of ours for a delivery (its dead letter, its retry copy) failed: the delivery stays
    with the broker, held (:class:`DatabaseUnavailable`), run again (:class:`DatabaseConflict`),
    or, for anything else, our own failure (raised as it is)."""
    trouble = classify(exc)
    if trouble is DatabaseTrouble.CONFLICT:
        raise DatabaseConflict(f"writing {what}: {exc}") from exc
    if trouble is DatabaseTrouble.UNAVAILABLE or isinstance(exc, OperationalError | InterfaceError):
        raise DatabaseUnavailable(f"cannot write {what}: {exc}") from exc
    raise exc


class DeliveryFailures:
    """The failure outcomes of one consumer's deliveries."""

    def __init__(self, spec: ConsumerSpec, settings: MessagingSettings) -> None:
        self.spec = spec
        self.settings = settings

    @property
    def max_attempts(self) -> int:
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def retry_delays(self) -> tuple[float, ...]:
        if self.spec.retry_delays is not None:
            return self.spec.retry_delays
        return self.settings.retry_delays

    def policy_for(self, message: Message) -> tuple[int, tuple[float, ...]]:
        """The max attempts and retry delays of ``message``: its own where the consumer looks
        one up (``ConsumerSpec.retry_policy``: a task's), else the consumer's."""
        own = None if self.spec.retry_policy is None else self.spec.retry_policy(message)
        if own is None:
            return self.max_attempts, self.retry_delays
        delays = self.retry_delays if own.retry_delays is None else own.retry_delays
        return own.max_attempts or self.max_attempts, delays

    def dead_letter(
        self,
        delivery: Delivery,
        message: Message | DecodeError,
        reason: str,
        detail: str = "",
        *,
        error: BaseException | None = None,
        duration: float | None = None,
        label: OutcomeLabel = OutcomeLabel.DEAD_LETTERED,
    ) -> DeliveryOutcome:
        """Record the delivery as a dead letter for ``reason`` (in the caller's transaction)."""
        fields: dict[str, Any] = {}
        if isinstance(message, Message):
            fields = {
                "attempts": message.attempt,
                "payload": message.payload,
                "exchange": message.exchange,
                "routing_key": message.routing_key,
            }
        if error is not None:
            fields["exception"] = error
            fields["traceback_text"] = "".join(traceback.format_exception(error))
        try:
            record_dead_letter(
                consumer=self.spec.name,
                delivery=delivery,
                message_id=message.message_id,
                reason=reason,
                exception_message=detail,
                **({"attempts": 1} | fields),
            )
        except DatabaseError as exc:
            raise_for_our_write(exc, f"the dead letter of message_id={message.message_id}")
        return DeliveryOutcome(
            Acknowledge(OutcomeLabel.DEAD_LETTERED, reason),
            label,
            duration,
            detail=detail,
            error=error,
        )

    def expire(self, delivery: Delivery, message: Message, why: str) -> DeliveryOutcome:
        """The message is past its deadline (``why`` says by how much, see :mod:`.expiry`):
        acked without running the handler, and with ``on_expiry="dead_letter"`` kept as a
        dead letter ``expired``."""
        if self.spec.on_expiry == "dead_letter":
            self.dead_letter(delivery, message, FailureReason.EXPIRED, why)
            why = f"{why}; kept as a dead letter"
        return DeliveryOutcome(Acknowledge(OutcomeLabel.EXPIRED, why), OutcomeLabel.EXPIRED)

    def on_failure(
        self, delivery: Delivery, message: Message, exc: Exception, started: float
    ) -> DeliveryOutcome:
        """The handler raised ``exc``: a dead letter or a retry (:func:`decide`)."""
        duration = time.perf_counter() - started
        max_attempts, delays = self.policy_for(message)
        decision = decide(exc, attempt=message.attempt, max_attempts=max_attempts, delays=delays)
        if isinstance(decision, GiveUp):
            return self.dead_letter(
                delivery, message, decision.reason, str(exc), error=exc, duration=duration
            )
        headers = retry_headers(delivery, message, exc, decision.next_attempt)
        error = f"{type(exc).__name__}: {exc}"
        # An ordered consumer's retry waits in place: through the outbox a later message of the
        # key would overtake it. The delivery stays unacked, holding its partition.
        retry = RetryInPlace if self.spec.ordered else ScheduleRetry
        return DeliveryOutcome(
            retry(decision.delay, decision.next_attempt, headers, error),
            OutcomeLabel.RETRIED,
            duration,
            error=exc,
        )

    def defer(
        self,
        delivery: Delivery,
        message: Message,
        why: str = "another consumer is processing it right now",
        error: str = "lease held",
    ) -> DeliveryOutcome:
        """Another consumer holds this message (its Redis lease, or its inbox row in a
        transaction not yet ended): the copy comes back at the same attempt after the next of
        the retry delays (the settings' for ``retry_delays=()``); an ordered one waits in place."""
        deferrals = _deferrals(delivery.headers)
        delays = self.spec.retry_delays or self.settings.retry_delays
        delay = delays[min(deferrals, len(delays) - 1)]
        headers = _copy_headers(delivery, message, message.attempt, deferrals + 1)
        retry = RetryInPlace if self.spec.ordered else ScheduleRetry
        return DeliveryOutcome(
            retry(delay, message.attempt, headers, error, deferred=True),
            OutcomeLabel.DEFERRED,
            detail=why,
        )

    def busy(self, delivery: Delivery, message: Message) -> DeliveryOutcome:
        """The inbox row is locked past ``storage.inbox.LOCK_TIMEOUT``: deferred."""
        return self.defer(
            delivery,
            message,
            why=f"its inbox row is held by another transaction for over "
            f"{LOCK_TIMEOUT:g}s (a twin delivery running, or a consumer "
            f"cut off mid-batch)",
            error="inbox row locked",
        )


def _deferrals(headers: Any) -> int:
    """How many times this copy was put aside already (0 for a header missing or not a count:
    a producer's value only ever picks one of the declared delays)."""
    value = headers.get(DEFERRALS_HEADER, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
