"""Handler time limits: a handler that never returns does not hold its delivery forever.

Each handler call runs inside :meth:`TimeLimits.limit`. A watchdog thread looks at the calls in
progress a few times a second. Past a call's deadline it raises :class:`_Interrupt` in the
handler's thread (``PyThreadState_SetAsyncExc``, as dramatiq's time limit does): a handler
running Python code stops at its next bytecode, the exception unwinds through the handler's
``transaction.atomic()`` (so its effects and its inbox row roll back), and the caller sees a
:class:`~reliable_messaging.exceptions.HandlerTimeout`, a failed attempt like any other: retried
with backoff, then a dead letter with reason ``timeout``. ``_Interrupt`` derives from
``BaseException`` so that a handler's own ``except Exception`` cannot swallow it; should a handler
catch it anyway, the call still ends as a timeout.

Python cannot interrupt a thread blocked in C (a socket read with no timeout, ``time.sleep``).
When a call is still running ``HANDLER_TIMEOUT_GRACE`` seconds after its deadline, the process
cannot recover that thread, and its open transaction would hold the delivery's inbox row. The
watchdog then records the death against the delivery (the crash guard, reason ``timeout``),
logs why, and ends the process with exit code 3, as Celery's hard time limit replaces its
worker process. Nothing is lost or doubled: nothing uncommitted was acked, the database rolls
back the open transactions when the connections drop, the broker redelivers, and the
supervisor (systemd, Kubernetes) starts a new process, whose crash guard dead-letters the
delivery once it has cost ``CRASH_LIMIT`` processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..exceptions import HandlerTimeout

logger = logging.getLogger(__name__)

# Exit code of a process that ended itself because a handler could not be stopped.
EXIT_HANDLER_STUCK = 3
# How often the watchdog looks at the calls in progress.
TICK = 0.1


class _Interrupt(BaseException):
    """Raised asynchronously in a handler's thread at its deadline."""


@dataclass
class _Call:
    thread: int
    consumer: str
    message_id: str
    seconds: float
    started: float
    fired: bool = False
    hopeless_at: float = field(default=0.0)

    @property
    def deadline(self) -> float:
        return self.started + self.seconds


def _raise_in(thread: int, exc_type: type[BaseException] | None) -> None:
    """Set (or, with None, clear) the pending asynchronous exception of ``thread``."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), ctypes.py_object(exc_type) if exc_type else ctypes.c_void_p(0)
    )


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

    @contextlib.contextmanager
    def limit(self, seconds: float | None, consumer: str, message_id: str) -> Iterator[None]:
        """Run the body under a time limit of ``seconds`` (None or <= 0: no limit)."""
        if not seconds or seconds <= 0:
            yield
            return
        call = _Call(threading.get_ident(), consumer, message_id, seconds, time.monotonic())
        with self._lock:
            self._calls[call.thread] = call
        error: BaseException | None = None
        try:
            yield
        except _Interrupt:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised below unless it timed out
            error = exc
        with self._lock:
            self._calls.pop(call.thread, None)
            fired = call.fired
        if fired:
            # The watchdog may have fired just as the handler returned: clear a pending
            # interrupt so it cannot land in our own code after this point.
            _raise_in(call.thread, None)
            raise HandlerTimeout(
                f"the handler ran past its time limit of {seconds:g}s "
                f"(message_id={message_id}, consumer={consumer})"
            ) from error
        if error is not None:
            raise error

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

    # -- the watchdog ----------------------------------------------------------------------------

    def start(self, grace: float) -> None:
        self.grace = max(0.0, grace)
        if self._watchdog is not None and self._watchdog.is_alive():
            return
        self._stop.clear()
        self._watchdog = threading.Thread(target=self._watch, name="rm-time-limits", daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(TICK):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One look at the calls in progress (the watchdog calls it every ``TICK``)."""
        fire: list[_Call] = []
        hopeless: list[_Call] = []
        with self._lock:
            for call in self._calls.values():
                if now <= call.deadline:
                    continue
                if not call.fired:
                    call.fired = True
                    call.hopeless_at = now + self.grace
                    _raise_in(call.thread, _Interrupt)
                    fire.append(call)
                elif now >= call.hopeless_at:
                    hopeless.append(call)
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
            "of %gs and cannot be interrupted (blocked outside Python, e.g. a socket read "
            "without a timeout); exiting with code %d so that a fresh process takes over. "
            "Nothing uncommitted was acked: the broker redelivers the messages in flight, and "
            "the crash guard dead-letters this one once it has cost CRASH_LIMIT processes",
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
