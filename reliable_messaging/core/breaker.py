"""The circuit breaker's settings; its state is in :mod:`reliable_messaging.consuming.breaker`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..exceptions import ConsumerConfigurationError
from .backoff import exponential


@dataclass(frozen=True)
class Breaker:
    """Open when at least ``min_failures`` of the last ``window`` handled deliveries failed and
    they are at least ``failure_rate`` of them; stay open ``pause`` seconds (starting none of
    that handler's deliveries), then let ``probes`` deliveries through (half-open) and close
    when they all succeed. Each opening after a failed probe doubles the pause, up to
    ``max_pause`` (default: ten times ``pause``)."""

    failure_rate: float = 0.5
    window: int = 100
    min_failures: int = 20
    pause: float = 30.0
    probes: int = 3
    max_pause: float | None = None

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
        if self.max_pause is not None and (
            not _number(self.max_pause) or (_number(self.pause) and self.max_pause < self.pause)
        ):
            problems.append(
                f"max_pause must be a number of seconds >= pause, got {self.max_pause!r}"
            )
        if not _integer(self.probes) or self.probes < 1:
            problems.append(f"probes must be an integer >= 1, got {self.probes!r}")
        if problems:
            raise ConsumerConfigurationError("Breaker: " + "; ".join(problems))

    @property
    def longest_pause(self) -> float:
        """The cap of the pause's doubling."""
        return self.max_pause if self.max_pause is not None else 10 * self.pause

    def pause_after(self, reopenings: int) -> float:
        """The pause of an opening that follows ``reopenings`` failed half-open rounds."""
        return exponential(self.pause, reopenings, self.longest_pause)

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
