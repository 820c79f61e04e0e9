"""Handler time limits (``reliable_messaging.consuming.time_limit.TimeLimits``), on an instance
of its own.

The watchdog interrupts a handler spinning in Python at its deadline, whatever the handler
catches; other exceptions pass through untouched. The grace before the watchdog gives up on a
call (and ends the process) is set far beyond any test here, so it never fires.

No timing is asserted beyond generous bounds: a limit of 0.3s must stop a handler that would
otherwise run for 10s well before those 10s.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from reliable_messaging.consuming.time_limit import TimeLimits
from reliable_messaging.exceptions import HandlerTimeout
from tests.support import ROOT, wait_until

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


# -- the watchdog firing inside limit()'s own bookkeeping -------------------------------------


class FiringLock:
    """Stands in for the lock of a TimeLimits so that its watchdog fires at a chosen moment of
    ``limit()``'s own bookkeeping: the ``nth`` time the handler's thread takes the lock, as it
    asks for it (``when="enter"``) or just after it let it go (``when="exit"``).

    The watchdog's real check runs in another thread and this thread waits for it: the
    interrupt is pending when the wait ends and lands at once, in the bookkeeping, whatever
    the machine's load. That is the interleaving of a handler returning as its deadline
    passes, forced."""

    def __init__(self, limits: TimeLimits, nth: int, when: str) -> None:
        self.limits = limits
        self.real = limits._lock
        self.nth = nth
        self.when = when
        self.thread = threading.get_ident()
        self.uses = 0
        self.fired = False

    def __enter__(self) -> bool:
        if threading.get_ident() == self.thread:
            self.uses += 1
            if self.when == "enter":
                self._fire()
        return self.real.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.real.__exit__(*exc)
        if threading.get_ident() == self.thread and self.when == "exit":
            self._fire()

    def _fire(self) -> None:
        if self.fired or self.uses != self.nth:
            return
        self.fired = True
        # Past every deadline, so the call in progress is fired on.
        watchdog = threading.Thread(target=self.limits.check, args=(time.monotonic() + 3600,))
        watchdog.start()
        watchdog.join()


@pytest.fixture
def firing() -> Iterator[Callable[[int, str], Watched]]:
    """``firing(nth, when)``: a TimeLimits without its own watchdog thread (nothing fires but
    the forced check) and a FiringLock in place of its lock."""
    made: list[Watched] = []

    def make(nth: int, when: str) -> Watched:
        tl = Watched()
        tl._lock = FiringLock(tl, nth, when)  # type: ignore[assignment]
        made.append(tl)
        return tl

    yield make
    for tl in made:
        assert tl._lock.fired, "the forced watchdog never fired"  # type: ignore[attr-defined]
        assert tl.overdue() == []  # the call is over, whatever happened
    # Nothing pending lands later in this thread.
    spin(0.3)


def test_a_handler_returning_as_the_watchdog_fires_keeps_its_outcome(
    firing: Callable[[int, str], Watched], caplog: pytest.LogCaptureFixture
) -> None:
    # The handler returned; limit() is taking its lock to deregister the call (its second use
    # of the lock) when the watchdog fires: the interrupt lands in limit()'s bookkeeping.
    limits = firing(2, "enter")
    ran = []
    with limits.limit(3600, "tl.consumer", "at-deadline"):
        ran.append(True)
    assert ran == [True]
    assert limits.timeouts == [("tl.consumer", "at-deadline", 3600)]  # the watchdog did fire
    assert "the interrupt was withdrawn" in caplog.text and "at-deadline" in caplog.text


def test_a_handler_error_raised_as_the_watchdog_fires_passes_through(
    firing: Callable[[int, str], Watched],
) -> None:
    limits = firing(2, "enter")
    with pytest.raises(ValueError, match="its own error"), limits.limit(3600, "tl.c", "err-1"):
        raise ValueError("its own error")
    assert limits.timeouts == [("tl.c", "err-1", 3600)]


def test_an_interrupt_landing_before_the_handler_starts_is_a_timeout(
    firing: Callable[[int, str], Watched],
) -> None:
    # The call is registered (first use of the lock) and its deadline passes before the body
    # starts: a stalled thread. The body must not run, and the call must not stay registered.
    limits = firing(1, "exit")
    ran = []
    with (
        pytest.raises(HandlerTimeout, match="before-start"),
        limits.limit(3600, "tl.consumer", "before-start"),
    ):
        ran.append(True)
    assert ran == []


def test_discard_forgets_a_call_whose_block_was_left_without_its_exit() -> None:
    # What the worker pool does for a thread an exception left before limit()'s __exit__ ran.
    tl = TimeLimits()
    tl.limit(0.01, "tl.consumer", "left-1").__enter__()
    time.sleep(0.05)
    assert tl.overdue()
    tl.discard()
    assert tl.overdue() == []


def test_a_watchdog_started_again_just_after_a_stop_still_watches(limits: Watched) -> None:
    """A service stopped and started again in one process (the stopped watchdog has not woken
    yet when the next start looks at it): the calls of the new run are still interrupted."""
    limits.stop()
    limits.start(grace=600.0)
    started = time.monotonic()
    with pytest.raises(HandlerTimeout), limits.limit(0.3, "tl.consumer", "restarted-1"):
        spin()
    assert time.monotonic() - started < IN_TIME


# Fires this thread's call from the watchdog's side while the thread waits outside Python, takes
# the interrupt, then discards the call (as a dying worker does) and calls a function under a
# profiler, as coverage or a debugger would run the process.
_AFTER_A_WITHDRAWN_INTERRUPT = """
import sys, threading, time
from reliable_messaging.consuming.time_limit import TimeLimits

limits = TimeLimits()
limits.limit(3600, "tl.consumer", "withdrawn-1").__enter__()
me = threading.get_ident()
watchdog = threading.Thread(target=lambda: limits.check(time.monotonic() + 7200, thread=me))
try:
    watchdog.start()
    watchdog.join()
    time.sleep(0.01)
except BaseException as landed:
    print("landed", type(landed).__name__, flush=True)
limits.discard()
sys.setprofile(lambda *args: None)
(lambda: None)()
sys.setprofile(None)
print("called", flush=True)
"""


def test_a_withdrawn_interrupt_leaves_a_profiled_process_running() -> None:
    """Withdrawing an interrupt by clearing it left CPython 3.11's signal of a pending
    asynchronous exception set for good: under a profiler, the next call of any thread looped
    in the interpreter forever (the forced-interrupt test of the consumer service hung so)."""
    try:
        ran = subprocess.run(
            [sys.executable, "-c", _AFTER_A_WITHDRAWN_INTERRUPT],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the profiled call never returned: {exc.stdout!r}")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:2] == ["landed _Interrupt", "called"], ran.stdout
