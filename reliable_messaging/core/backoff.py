"""Capped exponential backoff: the one formula of every growing wait (reconnects, database
probes, conflicts, resends, refused retry copies, the circuit breaker's pauses)."""

from __future__ import annotations

import random


def exponential(first: float, step: int, maximum: float, factor: float = 2.0) -> float:
    """The wait of ``step`` (0-based): ``first`` grown ``step`` times by ``factor``, capped."""
    return min(first * factor ** min(step, 64), maximum)


class Backoff:
    """The successive waits of one thing tried again, with jitter."""

    def __init__(self, initial: float = 0.5, maximum: float = 30.0, factor: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._step = 0

    def next(self) -> float:
        """The next wait, with +-20 % jitter so a fleet does not reconnect in lockstep."""
        current = exponential(self.initial, self._step, self.maximum, self.factor)
        self._step += 1
        return current * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._step = 0
