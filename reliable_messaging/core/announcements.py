"""What a long-running command always shows (started, what it consumes, stopped): logged at
INFO and, when ``LOGGING`` would not show it, written to the command's output."""

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
    """Whether a record of ``level`` on ``logger`` reaches a handler (not a ``NullHandler``)."""
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
    """Log ``message % args`` at INFO, or write it to the attached output if logging would not
    show it."""
    logger.info(message, *args)
    write = _write
    if write is not None and not shown_by_logging(logger):
        write(message % args if args else message)


def quiet_pika_info() -> None:
    """Keep pika's logger (which logs every connection and channel at INFO) to warnings, unless
    the project gave it a level of its own."""
    pika_logger = logging.getLogger("pika")
    if pika_logger.level == logging.NOTSET:
        pika_logger.setLevel(logging.WARNING)
