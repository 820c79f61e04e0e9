"""Progress of a long-running management command: on a terminal one line rewritten in place,
elsewhere a plain line every ``interval`` seconds (none for a job that ends sooner)."""

from __future__ import annotations

import time
from collections.abc import Callable

from django.core.management.base import OutputWrapper

TTY_REFRESH = 0.1
LOG_INTERVAL = 5.0


class Progress:
    """``update(done)`` after each batch, ``finish(done)`` at the end; ``interrupt()`` before
    writing anything else to the terminal, so that text does not land on the progress line."""

    def __init__(
        self,
        out: OutputWrapper,
        label: str,
        total: int,
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.label = label
        self.total = total
        isatty = getattr(out, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.interval = (
            interval if interval is not None else TTY_REFRESH if self.tty else LOG_INTERVAL
        )
        self._clock = clock
        self._last = clock()
        self._shown = 0  # width of the line on screen, 0 when none is
        self._on_screen: int | None = None  # the count it shows
        self._done = 0
        self._finished = False

    def update(self, done: int) -> None:
        self._done = done
        now = self._clock()
        if now - self._last < self.interval:
            return
        self._last = now
        self._show(done)

    def finish(self) -> None:
        """Show the final count (the last update's) on a terminal and end the line (once)."""
        if self._finished:
            return
        self._finished = True
        if self.tty and self._done and self._done != self._on_screen:
            self._show(self._done)
        self.interrupt()

    def interrupt(self) -> None:
        if self._shown:
            self.out.write("")  # ends the progress line; the next update draws a new one
            self._shown = 0
            self._on_screen = None

    def _show(self, done: int) -> None:
        total = max(self.total, done)  # rows that aged into the job while it ran
        percent = f" ({done / total:.0%})" if total else ""
        text = f"  {self.label} {done:,}/{total:,}{percent}"
        if not self.tty:
            self.out.write(text)
            return
        # Pad over a longer previous text; the cursor stays on the line for the next redraw.
        self.out.write("\r" + text.ljust(self._shown), ending="")
        self.out.flush()
        self._shown = len(text)
        self._on_screen = done
