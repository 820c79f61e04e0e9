"""Capped exponential backoff with jitter, for reconnects and database probes."""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial: float = 0.5, maximum: float = 30.0, factor: float = 2.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._next = initial

    def next(self) -> float:
        """The next wait: grows by ``factor`` up to ``maximum``, with +-20 % jitter so a fleet
        of consumers does not reconnect in lockstep."""
        current = min(self._next, self.maximum)
        self._next = min(current * self.factor, self.maximum)
        return current * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.initial
