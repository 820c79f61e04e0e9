"""What processing a delivery decided; the connection's thread carries it out on the broker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

AckResult = Literal["processed", "duplicate", "dead_lettered"]


@dataclass(frozen=True)
class Acknowledge:
    """Done with the delivery: ack it. ``result`` says why, for logs, metrics and tests."""

    result: AckResult
    reason: str | None = None


@dataclass(frozen=True)
class ScheduleRetry:
    """Publish a copy (with ``headers``) to the delay queue for ``delay`` seconds, then ack."""

    delay: float
    next_attempt: int
    headers: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""
    # True when nothing failed: another consumer holds the message's processing lease, so this
    # copy comes back later (same attempt) instead of running in parallel with it.
    deferred: bool = False


@dataclass(frozen=True)
class RetryInPlace:
    """Ordered consumers only: keep the delivery unacked, wait ``delay`` seconds and run it
    again as ``next_attempt`` (with ``headers``), so no later message of its key overtakes it."""

    delay: float
    next_attempt: int
    headers: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class Release:
    """Give the delivery back to the broker unacked (nack + requeue): nothing was decided."""

    why: str


Outcome = Acknowledge | ScheduleRetry | RetryInPlace | Release
