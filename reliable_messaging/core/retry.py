"""Retry decisions: pure functions of the attempt number, the policy and the exception."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..exceptions import HandlerTimeout, PermanentError
from .outcomes import FailureReason


@dataclass(frozen=True)
class RetryLater:
    """Send a copy back to the consumer's queue after ``delay`` seconds as ``next_attempt``."""

    delay: float
    next_attempt: int


@dataclass(frozen=True)
class GiveUp:
    """Stop retrying: the message becomes a dead letter for ``reason``."""

    reason: str


def delay_for(attempt: int, delays: Sequence[float]) -> float:
    """The wait after failed ``attempt`` (1-based): the n-th delay, the last one repeating."""
    return float(delays[min(attempt, len(delays)) - 1])


def decide(
    exc: BaseException, *, attempt: int, max_attempts: int, delays: Sequence[float]
) -> RetryLater | GiveUp:
    if isinstance(exc, PermanentError):
        return GiveUp(FailureReason.PERMANENT)
    if attempt >= max_attempts or not delays:
        if isinstance(exc, HandlerTimeout):
            return GiveUp(FailureReason.TIMEOUT)
        return GiveUp(FailureReason.RETRIES_EXHAUSTED)
    return RetryLater(delay=delay_for(attempt, delays), next_attempt=attempt + 1)


def delay_name(delay: float) -> str:
    """A stable, readable suffix for a delay: ``5s`` or ``250ms``."""
    ms = round(delay * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
