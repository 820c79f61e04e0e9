"""Exceptions raised by reliable_messaging; each carries a default message."""

from __future__ import annotations


class ReliableMessagingError(Exception):
    """Base class of every error this app raises on purpose."""

    default_message = "reliable_messaging error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)


class PermanentError(ReliableMessagingError):
    """Raise from a handler when retrying cannot help: the message becomes a dead letter at once."""

    default_message = "permanent failure: the message cannot be handled"


class ConsumerConfigurationError(ReliableMessagingError):
    """A consumer registration is invalid (duplicate name or queue, bad arguments)."""

    default_message = "invalid consumer registration"


class TopologyMismatchError(ReliableMessagingError):
    """The broker already has a queue or exchange with other arguments than we declare."""

    default_message = "the broker's queue or exchange differs from the declared topology"


class DatabaseUnavailable(ReliableMessagingError):
    """The database cannot be reached; the delivery is held (not acked) until it can."""

    default_message = "the database is unreachable"


class DatabaseConflict(ReliableMessagingError):
    """The database asked for the transaction to be run again: it runs again in place, uncharged."""

    default_message = "the database asked for the transaction to be retried"


class HandlerTimeout(ReliableMessagingError):
    """A handler ran past its time limit: its transaction rolled back, the attempt failed."""

    default_message = "the handler ran past its time limit"


class MissingExtra(ImportError):
    """An optional feature was imported without the extra that installs what it needs."""

    def __init__(self, feature: str, extra: str, missing: str) -> None:
        super().__init__(
            f"{feature} needs {missing}, which is not installed: "
            f'pip install "reliable-messaging[{extra}]"',
            name=missing,
        )
        self.extra = extra
