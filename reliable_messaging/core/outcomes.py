"""What processing a delivery decided; the connection's thread carries it out on the broker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class OutcomeLabel(StrEnum):
    """How a delivery ended, for logs, metrics and tests; equal to its plain word."""

    PROCESSED = "processed"  # the handler ran and its transaction committed
    DUPLICATE = "duplicate"  # the inbox already held it: acked, the handler did not run
    RETRIED = "retried"  # failed; a copy waits in the outbox for the next attempt
    DEAD_LETTERED = "dead_lettered"  # stored as a dead letter for a person; acked
    RELEASED = "released"  # given back to the broker undecided (nack + requeue)
    PARKED = "parked"  # held behind an earlier dead letter of its ordering key
    DEFERRED = "deferred"  # another consumer holds its processing lease: comes back later
    # Past its deadline (``publish(expires=...)``, ``@consumer(max_age=...)``): acked unhandled.
    EXPIRED = "expired"


class FailureReason(StrEnum):
    """Why a delivery became a dead letter (``choices.DeadLetterReason`` labels each)."""

    PERMANENT = "permanent"  # the handler raised PermanentError
    RETRIES_EXHAUSTED = "retries_exhausted"
    TIMEOUT = "timeout"  # the last attempt ran past the handler's time limit
    # The delivery cannot be decoded (see envelope.decode).
    INVALID_JSON = "invalid_json"
    INVALID_UTF8 = "invalid_utf8"
    EMPTY_BODY = "empty_body"
    MISSING_MESSAGE_ID = "missing_message_id"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    INVALID_HEADERS = "invalid_headers"
    NO_HANDLER = "no_handler"
    UNEXPECTED_ROUTING_KEY = "unexpected_routing_key"
    # Ordered consumers: a later message of a key whose earlier message is a dead letter.
    PARKED = "parked"
    # The process died (killed, or exited past the handler's time limit) CRASH_LIMIT times.
    WORKER_CRASHED = "worker_crashed"
    CONSUMER_ERROR = "consumer_error"  # our own code (not the handler) failed on it repeatedly
    DELIVERY_LIMIT = "delivery_limit"  # a quorum queue's x-delivery-limit was reached
    # Past its deadline, for a consumer that keeps expired messages (``on_expiry="dead_letter"``).
    EXPIRED = "expired"
    # The payload does not match the consumer's declared type (``@consumer(payload=...)``).
    INVALID_PAYLOAD = "invalid_payload"


# The plain words too: Acknowledge("processed") type-checks as Acknowledge(OutcomeLabel.PROCESSED).
AckResult = Literal[
    OutcomeLabel.PROCESSED,
    OutcomeLabel.DUPLICATE,
    OutcomeLabel.DEAD_LETTERED,
    OutcomeLabel.EXPIRED,
    "processed",
    "duplicate",
    "dead_lettered",
    "expired",
]


@dataclass(frozen=True)
class Acknowledge:
    """Done with the delivery: ack it. ``result`` says why, for logs, metrics and tests."""

    result: AckResult
    reason: str | None = None


@dataclass(frozen=True)
class _Retry:
    delay: float
    next_attempt: int
    headers: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""
    # True when nothing failed: another consumer holds the message's processing lease.
    deferred: bool = False


@dataclass(frozen=True)
class ScheduleRetry(_Retry):
    """A copy (with ``headers``) waits ``delay`` seconds in the outbox, written in the
    transaction that decided it (``consuming/retry_rows.py``): ack once that committed."""


@dataclass(frozen=True)
class RetryInPlace(_Retry):
    """Ordered consumers only: keep the delivery unacked, wait ``delay`` seconds and run it
    again as ``next_attempt`` (with ``headers``), so no later message of its key overtakes it."""


@dataclass(frozen=True)
class Release:
    """Give the delivery back to the broker unacked (nack + requeue): nothing was decided."""

    why: str


Outcome = Acknowledge | ScheduleRetry | RetryInPlace | Release


def label_of(outcome: Outcome) -> OutcomeLabel:
    """The label of an outcome the connection's thread carries out."""
    if isinstance(outcome, Acknowledge):
        return OutcomeLabel(outcome.result)
    if isinstance(outcome, ScheduleRetry):
        return OutcomeLabel.DEFERRED if outcome.deferred else OutcomeLabel.RETRIED
    return OutcomeLabel.RELEASED
