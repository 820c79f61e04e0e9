"""Whether a delivery is past its deadline (the producer's ``x-rm-expires-at`` or the
consumer's ``max_age``): the one place the consumer decides it (``docs/expiry.md``)."""

from __future__ import annotations

import decimal
import logging
import math
import re
import time
from typing import Any

from ..core.envelope import EXPIRES_AT_HEADER, REPLAY_HEADER, Delivery, Message
from ..core.registry import ConsumerSpec
from ..models import ProcessedMessage
from .stage import DUPLICATE, DeliveryOutcome, Job, Stage

logger = logging.getLogger(__name__)

# AMQP's long-long integer: a deadline outside it was not written by any client we know.
_INT64_MIN, _INT64_END = -(2**63), 2**63
_DIGITS = re.compile(r"[+-]?[0-9]{1,19}")


class MalformedDeadline(ValueError):
    """The ``x-rm-expires-at`` header holds something that is not a time in milliseconds."""


def parse_deadline(raw: Any) -> int | None:
    """The deadline in Unix milliseconds from the header's value (an int, digits as text or
    bytes, a finite float or decimal), None when there is none; :class:`MalformedDeadline` for
    anything else."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise MalformedDeadline(f"{EXPIRES_AT_HEADER} is a boolean ({raw!r}), not milliseconds")
    if isinstance(raw, int):
        value = int(raw)
    elif isinstance(raw, float | decimal.Decimal):
        finite = math.isfinite(raw) if isinstance(raw, float) else raw.is_finite()
        # Compared before int(): 1E+999999999 must not become a billion digits.
        if not finite or not -_INT64_END < raw < _INT64_END:
            raise MalformedDeadline(f"{EXPIRES_AT_HEADER} is {raw!r}, not a time in 64 bits")
        value = int(raw)
    elif isinstance(raw, str | bytes):
        text = (raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else raw).strip()
        if not _DIGITS.fullmatch(text):
            raise MalformedDeadline(
                f"{EXPIRES_AT_HEADER} is {text[:40]!r}, not a number of milliseconds"
            )
        value = int(text)
    else:
        raise MalformedDeadline(
            f"{EXPIRES_AT_HEADER} is a {type(raw).__name__}, not a number of milliseconds"
        )
    if not _INT64_MIN <= value < _INT64_END:
        raise MalformedDeadline(f"{EXPIRES_AT_HEADER} is {value}, beyond 64 bits")
    return value


def expiry_of(
    delivery: Delivery, message: Message, spec: ConsumerSpec, now: float | None = None
) -> str | None:
    """Why ``message`` is too late for ``spec``'s consumer (by how much), or None when it may be
    handled; ``now`` in Unix seconds."""
    if REPLAY_HEADER in delivery.headers:
        return None  # an operator's replay: handle it now, whatever its age
    raw = delivery.headers.get(EXPIRES_AT_HEADER)
    try:
        deadline = None if raw is None else parse_deadline(raw)
    except MalformedDeadline as exc:
        logger.warning(
            "message_id=%s consumer=%s: ignoring the header %s: %s; handled as if it had no "
            "deadline",
            message.message_id,
            spec.name,
            EXPIRES_AT_HEADER,
            exc,
        )
        deadline = None
    if now is None:
        now = time.time()
    if deadline is not None and now * 1000 > deadline:
        return (
            f"its deadline ({EXPIRES_AT_HEADER}) passed {now - deadline / 1000:.3f}s before it "
            f"could be handled"
        )
    if spec.max_age is not None and message.published_at is not None:
        age = now - message.published_at.timestamp()
        if age > spec.max_age:
            return (
                f"it is {age:.3f}s old, {age - spec.max_age:.3f}s past the consumer's max_age "
                f"of {spec.max_age:g}s"
            )
    return None


class Expiry(Stage):
    """Acks a message past its deadline without running its handler (a duplicate instead of a
    dead letter when the inbox shows it was handled in time)."""

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        spec = job.processor.spec
        late = expiry_of(job.delivery, message, spec)
        if late is None:
            return None
        inbox = ProcessedMessage.objects.using(job.processor.using)
        if spec.on_expiry == "dead_letter" and inbox.has(spec.name, message.message_id):
            return DUPLICATE
        return job.processor.failures.expire(job.delivery, message, late)
