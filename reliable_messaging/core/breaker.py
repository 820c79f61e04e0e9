"""The circuit breaker's settings: when a handler's failures pause its queue, and for how long.

Only the configuration lives here (the ``@consumer`` decorator and the settings build it); the
breaker's state and what the consume process does with it are in
:mod:`reliable_messaging.consuming.breaker`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..exceptions import ConsumerConfigurationError


@dataclass(frozen=True)
class Breaker:
    """Open when at least ``min_failures`` of the last ``window`` handled deliveries failed and
    they are at least ``failure_rate`` of them; stay open ``pause`` seconds (taking no
    deliveries of that handler), then let ``probes`` deliveries through (half-open) and close
    when they all succeed."""

    failure_rate: float = 0.5
    window: int = 100
    min_failures: int = 20
    pause: float = 30.0
    probes: int = 3

    def __post_init__(self) -> None:
        problems = []
        if not _number(self.failure_rate) or not 0 < self.failure_rate <= 1:
            problems.append(f"failure_rate must be in (0, 1], got {self.failure_rate!r}")
        if not _integer(self.window) or self.window < 1:
            problems.append(f"window must be an integer >= 1, got {self.window!r}")
        if not _integer(self.min_failures) or self.min_failures < 1:
            problems.append(f"min_failures must be an integer >= 1, got {self.min_failures!r}")
        elif _integer(self.window) and self.min_failures > self.window:
            problems.append(
                f"min_failures ({self.min_failures}) cannot exceed window ({self.window})"
            )
        if not _number(self.pause) or self.pause <= 0:
            problems.append(f"pause must be a positive number of seconds, got {self.pause!r}")
        if not _integer(self.probes) or self.probes < 1:
            problems.append(f"probes must be an integer >= 1, got {self.probes!r}")
        if problems:
            raise ConsumerConfigurationError("Breaker: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Breaker:
        """From a settings dict (``RELIABLE_MESSAGING["BREAKER"]``), lower- or upper-case keys."""
        known = {f.name for f in fields(cls)}
        given = {str(k).lower(): v for k, v in values.items()}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConsumerConfigurationError(
                f"Breaker: unknown key(s) {unknown!r}; known: {sorted(known)!r}"
            )
        return cls(**given)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
