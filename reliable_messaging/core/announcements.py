"""What a long-running command always shows, whatever ``LOGGING`` says.

``consume`` and ``relay`` run for weeks under systemd or Kubernetes, whose logs are the process's
output. A fresh Django project's ``LOGGING`` gives this app's loggers no handler, so without
this a healthy ``consume`` printed nothing at all: no sign that it started, what it consumes,
that it makes progress, or that it stopped. The lines that say so (*announcements*) are logged
at INFO as always and, when the command has attached its output with :func:`attach` and the
logging configuration would not show that INFO line itself, written to the command's output
too: once, either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

# No lock around it: a command's signal handler announces too, and a lock the interrupted main
# thread held would never be released. Rebinding a module global is atomic.
_write: Callable[[str], None] | None = None


def attach(write: Callable[[str], None]) -> None:
    """Send announcements to ``write`` (a command's ``self.stdout.write``) from now on."""
    global _write
    _write = write


def detach() -> None:
    global _write
    _write = None


def shown_by_logging(logger: logging.Logger, level: int = logging.INFO) -> bool:
    """Whether a record of ``level`` on ``logger`` reaches a handler that emits it (the
    ``NullHandler`` libraries add does not count)."""
    if not logger.isEnabledFor(level):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if not isinstance(handler, logging.NullHandler) and handler.level <= level:
                return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def announce(logger: logging.Logger, message: str, *args: object) -> None:
    """Log ``message % args`` at INFO on ``logger``; also write it to the attached command
    output when logging would not show it."""
    logger.info(message, *args)
    write = _write
    if write is not None and not shown_by_logging(logger):
        write(message % args if args else message)


def quiet_pika_info() -> None:
    """pika logs every connection and channel it opens at INFO; under a root logger at INFO
    that floods a long-running process's log. Unless the project configured pika's logger
    itself (a level of its own), keep it to warnings."""
    pika_logger = logging.getLogger("pika")
    if pika_logger.level == logging.NOTSET:
        pika_logger.setLevel(logging.WARNING)
