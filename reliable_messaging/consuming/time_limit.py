"""Handler time limits: past a call's deadline a watchdog interrupts the handler (the caller sees
:class:`~reliable_messaging.exceptions.HandlerTimeout`); past ``HANDLER_TIMEOUT_GRACE`` the
process exits (``docs/design.md#time-limits``)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..core.coroutines import wake
from ..core.envelope import Message
from ..exceptions import HandlerTimeout
from .stage import Job, Stage

logger = logging.getLogger(__name__)

# Exit code of a process that ended itself because a handler could not be stopped.
EXIT_HANDLER_STUCK = 3
# How often the watchdog looks at the calls in progress.
TICK = 0.1


class _Interrupt(BaseException):
    """Raised asynchronously in a handler's thread at its deadline."""

    def __init__(self, *args: object) -> None:
        # Runs in the interrupted thread when the exception takes effect: did it land in the
        # handler's code or in the bookkeeping after the handler returned?
        super().__init__(*(args or ("interrupted by the watchdog at the handler's time limit",)))
        call: _Call | None = getattr(_running, "call", None)
        if call is not None and not call.leaving:
            call.landed_in_handler = True


_running = threading.local()  # the call in progress in each thread, for _Interrupt


@dataclass
class _Call:
    thread: int
    consumer: str
    message_id: str
    seconds: float
    started: float
    fired: bool = False
    hopeless_at: float = 0.0
    # Set by the handler's thread once the body of the ``with`` block has ended.
    leaving: bool = False
    # Set when the interrupt took effect while the handler's code ran.
    landed_in_handler: bool = False

    @property
    def deadline(self) -> float:
        return self.started + self.seconds


def _raise_in(thread: int, exc_type: type[BaseException]) -> None:
    """Set the pending asynchronous exception of ``thread``."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(exc_type))


class _Withdrawn(BaseException):
    """Put in the place of a pending interrupt, and taken at once, to withdraw it."""


def _take_pending() -> None:
    """Does nothing: entering it is where this thread takes a pending asynchronous exception."""


def _withdraw_own() -> None:
    """Withdraw the interrupt the watchdog may have left pending for this thread.

    Not by clearing it (``PyThreadState_SetAsyncExc`` with NULL): on CPython 3.11 that leaves
    the interpreter's signal of a pending asynchronous exception set for good (only a thread
    taking its exception clears it), and any thread under a profiler or a tracer then loops in
    the interpreter forever at its next call. A harmless exception takes the pending one's
    place, and this thread takes it here."""
    try:
        _raise_in(threading.get_ident(), _Withdrawn)
        _take_pending()
    except _Withdrawn:
        pass


class _Limited:
    """The ``with`` block of :meth:`TimeLimits.limit`: every step that runs while the call is
    registered catches an interrupt landing there; deregistering withdraws a pending one."""

    def __init__(self, limits: TimeLimits, call: _Call) -> None:
        self._limits = limits
        self._call = call

    def __enter__(self) -> None:
        call = self._call
        try:
            _running.call = call
            with self._limits._lock:
                self._limits._calls[call.thread] = call
        except _Interrupt:  # the deadline passed before the handler started
            self._deregister()
            raise self._timeout(None) from None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        call = self._call
        call.leaving = True
        while True:
            # Inline, not in _deregister: an interrupt landing as that call starts is caught.
            try:
                self._deregister()
                break
            except _Interrupt:
                continue
        # Nothing can be raised in this thread by the watchdog from here on.
        if isinstance(exc, _Interrupt):
            call.landed_in_handler = True
            exc = None  # the timeout says it all
        if call.landed_in_handler:  # whatever the handler then did with it
            raise self._timeout(exc)
        if call.fired:  # the handler ended just as the watchdog fired: its outcome stands
            logger.warning(
                "message_id=%s consumer=%s: the handler ended at its time limit of %gs, as "
                "the watchdog fired; the interrupt was withdrawn and the handler's own outcome "
                "stands",
                call.message_id,
                call.consumer,
                call.seconds,
            )

    def _deregister(self) -> None:
        """Remove the call and withdraw a pending interrupt; idempotent (the caller retries)."""
        call = self._call
        with self._limits._lock:
            if self._limits._calls.get(call.thread) is call:
                del self._limits._calls[call.thread]
        if call.fired:
            _withdraw_own()  # the call is this thread's
        _running.call = None

    def _timeout(self, cause: BaseException | None) -> HandlerTimeout:
        call = self._call
        error = HandlerTimeout(
            f"the handler ran past its time limit of {call.seconds:g}s "
            f"(message_id={call.message_id}, consumer={call.consumer})"
        )
        error.__cause__ = cause
        error.__suppress_context__ = True
        return error


class TimeLimits:
    """The handler calls in progress in this process and the watchdog that enforces them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.grace = 10.0
        # Called (from the watchdog) when a call is past its deadline, and when it is hopeless.
        self.on_timeout: Callable[[str, str, float], None] | None = None
        self.on_hopeless: Callable[[str, str], None] | None = None

    def limit(
        self, seconds: float | None, consumer: str, message_id: str
    ) -> contextlib.AbstractContextManager[None]:
        """Run the body under a time limit of ``seconds`` (None or <= 0: no limit); past it the
        body ends with :class:`~reliable_messaging.exceptions.HandlerTimeout`."""
        if not seconds or seconds <= 0:
            return contextlib.nullcontext()
        call = _Call(threading.get_ident(), consumer, message_id, seconds, time.monotonic())
        return _Limited(self, call)

    def discard(self) -> None:
        """Forget this thread's call (left without ``__exit__``); withdraw its interrupt."""
        with self._lock:
            call = self._calls.pop(threading.get_ident(), None)
        if call is not None and call.fired:
            _withdraw_own()

    def overdue(self) -> list[str]:
        """The calls past their deadline now, in words (for ``/healthz``)."""
        now = time.monotonic()
        with self._lock:
            return [
                f"handler of {c.consumer} running {now - c.started:.0f}s on message_id="
                f"{c.message_id}, past its {c.seconds:g}s time limit"
                for c in self._calls.values()
                if now > c.deadline
            ]

    def start(self, grace: float) -> None:
        """Start the watchdog, unless one runs that was not told to stop. A stopped one still
        winding down keeps its own stop signal and ends; a new one watches from now on."""
        self.grace = max(0.0, grace)
        with self._lock:
            watchdog = self._watchdog
            if watchdog is not None and watchdog.is_alive() and not self._stop.is_set():
                return
            self._stop = threading.Event()
            self._watchdog = threading.Thread(
                target=self._watch, args=(self._stop,), name="rm-time-limits", daemon=True
            )
            self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(TICK):
            self.check(time.monotonic())

    def check(self, now: float, thread: int | None = None) -> None:
        """One look at the calls in progress (every ``TICK``), or at ``thread``'s only."""
        fire: list[_Call] = []
        hopeless: list[_Call] = []
        waiting: list[int] = []
        with self._lock:
            for call in self._calls.values():
                if now <= call.deadline or thread not in (None, call.thread):
                    continue
                if not call.fired:
                    call.fired = True
                    call.hopeless_at = now + self.grace
                    _raise_in(call.thread, _Interrupt)
                    fire.append(call)
                elif now >= call.hopeless_at:
                    hopeless.append(call)
                waiting.append(call.thread)
        # An async handler's thread waits outside Python on its coroutine: end the coroutine so
        # the interrupt lands; again every tick, in case the coroutine had not started yet.
        for waiter in waiting:
            wake(waiter)
        for call in fire:
            logger.error(
                "message_id=%s consumer=%s outcome=timeout: the handler ran past its time "
                "limit of %gs; interrupting it (its transaction rolls back)",
                call.message_id,
                call.consumer,
                call.seconds,
            )
            if self.on_timeout is not None:
                self.on_timeout(call.consumer, call.message_id, call.seconds)
        if hopeless:
            self._give_up(hopeless[0])

    def _give_up(self, call: _Call) -> None:
        logger.critical(
            "message_id=%s consumer=%s: the handler is still running %gs after its time limit "
            "of %gs and cannot be interrupted (blocked outside Python); exiting with code %d "
            "for a fresh process. The broker redelivers the messages in flight, and the crash "
            "guard dead-letters this one once it has cost CRASH_LIMIT processes",
            call.message_id,
            call.consumer,
            self.grace,
            call.seconds,
            EXIT_HANDLER_STUCK,
        )
        try:
            if self.on_hopeless is not None:
                self.on_hopeless(call.consumer, call.message_id)
        except Exception:  # we exit anyway; the redelivery counts as a death
            logger.exception("could not record the timeout of message_id=%s", call.message_id)
        finally:
            logging.shutdown()
            os._exit(EXIT_HANDLER_STUCK)


time_limits = TimeLimits()


class TimeLimit(Stage):
    """The stage around each handler: its consumer's ``timeout``, else ``HANDLER_TIMEOUT``."""

    def handling(
        self, job: Job, message: Message, state: Any
    ) -> contextlib.AbstractContextManager[None]:
        processor = job.processor
        seconds = processor.spec.timeout or processor.settings.handler_timeout
        return time_limits.limit(seconds, processor.spec.name, message.message_id)
