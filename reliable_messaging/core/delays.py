"""The retry delays: which one follows an attempt."""

from __future__ import annotations

from collections.abc import Sequence


def delay_for(attempt: int, delays: Sequence[float]) -> float:
    """The wait after failed ``attempt`` (1-based): the n-th delay, the last one repeating."""
    return float(delays[min(attempt, len(delays)) - 1])
