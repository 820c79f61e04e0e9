"""Handler time limits (``reliable_messaging.consuming.time_limit.TimeLimits``), on an instance
of its own.

The watchdog interrupts a handler spinning in Python at its deadline, whatever the handler
catches; other exceptions pass through untouched. The grace before the watchdog gives up on a
call (and ends the process) is set far beyond any test here, so it never fires.

No timing is asserted beyond generous bounds: a limit of 0.3s must stop a handler that would
otherwise run for 10s well before those 10s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from reliable_messaging.consuming.time_limit import TimeLimits
from reliable_messaging.exceptions import HandlerTimeout
from tests.support import wait_until

# The longest a test handler runs on its own when nothing interrupts it.
SPIN = 10.0
# Interrupted "in time": far below SPIN, far above the 0.3s limit plus the watchdog's tick.
IN_TIME = 5.0


def spin(seconds: float = SPIN) -> None:
    """Busy in Python bytecode (an asynchronous exception lands at the next instruction)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


class Watched(TimeLimits):
    """A TimeLimits that remembers the timeouts its watchdog reported."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[tuple[str, str, float]] = []
        self.on_timeout = lambda *reported: self.timeouts.append(reported)


@pytest.fixture
def limits() -> Iterator[Watched]:
    tl = Watched()
    tl.start(grace=600.0)  # never hopeless within a test: it would end the process
    yield tl
    tl.stop()


def test_a_handler_spinning_past_its_limit_is_interrupted(limits: Watched) -> None:
    finished = False
    started = time.monotonic()
    with pytest.raises(HandlerTimeout) as caught, limits.limit(0.3, "tl.consumer", "spin-1"):
        spin()
        finished = True
    elapsed = time.monotonic() - started
    assert not finished
    assert elapsed < IN_TIME, f"interrupted only after {elapsed:.1f}s"
    assert "spin-1" in str(caught.value) and "tl.consumer" in str(caught.value)
    # Reported by the watchdog just after it interrupted the handler.
    wait_until(lambda: limits.timeouts, timeout=5, message="the on_timeout callback")
    assert limits.timeouts == [("tl.consumer", "spin-1", 0.3)]
    assert limits.overdue() == []  # the call is over


def test_a_handler_catching_exception_cannot_swallow_the_interrupt(limits: Watched) -> None:
    swallowed = 0
    started = time.monotonic()
    with pytest.raises(HandlerTimeout), limits.limit(0.3, "tl.consumer", "catch-exception"):
        # A handler that retries whatever fails until its own (long) deadline.
        while time.monotonic() - started < SPIN:
            try:
                spin(0.5)
            except Exception:  # noqa: BLE001 - the point of the test
                swallowed += 1
    assert swallowed == 0
    assert time.monotonic() - started < IN_TIME


def test_a_handler_catching_base_exception_still_ends_as_a_timeout(limits: Watched) -> None:
    caught: list[str] = []
    started = time.monotonic()
    with pytest.raises(HandlerTimeout), limits.limit(0.3, "tl.consumer", "catch-all"):
        try:
            spin()
        except BaseException as exc:  # noqa: BLE001 - the point of the test
            caught.append(type(exc).__name__)
            # ... and returns normally, as if nothing had happened.
    assert caught, "the handler was never interrupted"
    assert time.monotonic() - started < IN_TIME
    # Nothing pending lands later in this thread.
    spin(0.5)


def test_a_handler_error_under_a_limit_passes_through(limits: Watched) -> None:
    with pytest.raises(ValueError, match="bad value"), limits.limit(5.0, "tl.consumer", "v-e"):
        raise ValueError("bad value")
    with limits.limit(5.0, "tl.consumer", "fine"):
        spin(0.1)
    assert limits.timeouts == []


def test_no_limit_lets_a_handler_run() -> None:
    tl = TimeLimits()
    with tl.limit(None, "tl.consumer", "none"), tl.limit(0, "tl.consumer", "zero"):
        assert tl.overdue() == []
        spin(0.1)


def test_overdue_lists_a_call_past_its_deadline() -> None:
    tl = TimeLimits()  # no watchdog: the call is late but not interrupted
    with tl.limit(0.05, "tl.consumer", "late-1"):
        assert tl.overdue() == []  # before its deadline
        time.sleep(0.2)
        (late,) = tl.overdue()
        assert "tl.consumer" in late and "message_id=late-1" in late and "0.05s" in late
    assert tl.overdue() == []
