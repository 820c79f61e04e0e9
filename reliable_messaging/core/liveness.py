"""What a long-running process reports about itself on ``/healthz`` (standard library only)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol


class HealthCheck(Protocol):
    """Anything ``/healthz`` can ask: (healthy, the reasons it is not, in words)."""

    def check(self) -> tuple[bool, list[str]]: ...


class HealthState:
    """What a long-running process knows about its own health; thread-safe. Not healthy while
    the broker is disconnected, the database failing, the process stopping, or when no
    :meth:`heartbeat` came for ``stall_after`` seconds (a stuck loop looks alive from outside)."""

    def __init__(
        self, stall_after: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stall_after = stall_after
        self._clock = clock
        self._lock = threading.Lock()
        self._broker_connected = False
        self._database_ok = True
        self._database_detail: str | None = None
        self._last_heartbeat = clock()
        self._stopping = False
        # More reasons to be unhealthy, asked at each check; and notes that do not fail it.
        self._problems: list[Callable[[], list[str]]] = []
        self._notes: dict[str, str] = {}
        self._note_sources: list[Callable[[], list[str]]] = []

    def add_problem_source(self, source: Callable[[], list[str]]) -> None:
        """``source()`` returns reasons the process is unhealthy now (empty when it is not)."""
        with self._lock:
            self._problems.append(source)

    def add_note_source(self, source: Callable[[], list[str]]) -> None:
        """``source()`` returns more notes ``/healthz`` shows without failing."""
        with self._lock:
            self._note_sources.append(source)

    def set_broker(self, connected: bool) -> None:
        with self._lock:
            self._broker_connected = connected

    def note(self, key: str, text: str | None) -> None:
        """Set (or with None, clear) a note ``/healthz`` shows without failing."""
        with self._lock:
            if text is None:
                self._notes.pop(key, None)
            else:
                self._notes[key] = text

    def notes(self) -> list[str]:
        with self._lock:
            notes, sources = list(self._notes.values()), list(self._note_sources)
        for source in sources:
            notes.extend(source())
        return notes

    def set_database(self, ok: bool, detail: str | None = None) -> None:
        with self._lock:
            self._database_ok = ok
            self._database_detail = None if ok else detail

    def heartbeat(self) -> None:
        with self._lock:
            self._last_heartbeat = self._clock()

    def stopping(self) -> None:
        with self._lock:
            self._stopping = True

    def check(self) -> tuple[bool, list[str]]:
        """(healthy, the reasons it is not, in words)."""
        with self._lock:
            reasons: list[str] = []
            if self._stopping:
                reasons.append("stopping")
            if not self._broker_connected:
                reasons.append("broker not connected")
            if not self._database_ok:
                detail = f": {self._database_detail}" if self._database_detail else ""
                reasons.append(f"database failing{detail}")
            silent = self._clock() - self._last_heartbeat
            if silent > self.stall_after:
                reasons.append(f"no heartbeat for {silent:.0f}s: the main loop looks stuck")
            sources = list(self._problems)
        for source in sources:
            reasons.extend(source())
        return not reasons, reasons


class HealthGroup:
    """Several :class:`HealthState` seen as one, healthy when all are (one per relay lane)."""

    def __init__(self, members: Mapping[str, HealthCheck]) -> None:
        self.members = dict(members)

    def check(self) -> tuple[bool, list[str]]:
        reasons: list[str] = []
        for name, member in self.members.items():
            ok, why = member.check()
            if not ok:
                reasons.extend(f"{name}: {reason}" for reason in why)
        return not reasons, reasons

    def notes(self) -> list[str]:
        found: list[str] = []
        for name, member in self.members.items():
            notes = getattr(member, "notes", None)
            if notes is not None:
                found.extend(f"{name}: {note}" for note in notes())
        return found
