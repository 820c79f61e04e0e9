"""The retry delays: which one follows an attempt, and the name of its delay queue."""

from __future__ import annotations

from collections.abc import Sequence


def delay_for(attempt: int, delays: Sequence[float]) -> float:
    """The wait after failed ``attempt`` (1-based): the n-th delay, the last one repeating."""
    return float(delays[min(attempt, len(delays)) - 1])


def delay_name(delay: float) -> str:
    """A stable, readable suffix for a delay: ``5s`` or ``250ms``."""
    ms = round(delay * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
