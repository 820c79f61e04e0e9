"""Keeps the 404s our own passive declares expect out of the user's log (pika logs a channel
close at WARNING); any other 404 is logged by pika.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .replies import NOT_FOUND

_probing = threading.local()


@contextmanager
def expecting_not_found() -> Iterator[None]:
    """While this runs, this thread's passive declares may be answered 404 quietly."""
    depth = getattr(_probing, "depth", 0)
    _probing.depth = depth + 1
    try:
        yield
    finally:
        _probing.depth = depth


# The two lines pika writes when a channel is closed, with the reply code as first argument.
_CLOSE_MESSAGES = ("Received remote Channel.Close", "Closing channel")


def _not_an_expected_404(record: logging.LogRecord) -> bool:
    """False for pika's channel-close records of a 404 on a thread inside
    :func:`expecting_not_found`; looks only at an int argument (frames' ``==`` may raise)."""
    if not getattr(_probing, "depth", 0):
        return True
    message, args = record.msg, record.args
    return not (
        isinstance(message, str)
        and message.startswith(_CLOSE_MESSAGES)
        and isinstance(args, tuple)
        and bool(args)
        and type(args[0]) is int
        and args[0] == NOT_FOUND
    )


def install() -> None:
    """Put the filter on pika's channel logger (idempotent)."""
    logger = logging.getLogger("pika.channel")
    if _not_an_expected_404 not in logger.filters:
        logger.addFilter(_not_an_expected_404)
