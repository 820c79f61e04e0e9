"""Does an exchange exist? Asked before outbox rows are published to it.

Publishing to a missing exchange makes the broker close the channel, which would throw away the
confirms of every other row in flight (and send them twice). A passive declare on a separate,
blocking connection costs one round trip per exchange per minute instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pika
import pika.exceptions

from ..conf import MessagingSettings
from .pika_logs import expecting_not_found
from .replies import NOT_FOUND
from .topology import connect

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")


class ExchangeProbe:
    """Remembers for ``TTL`` seconds each exchange found; ``forget`` drops one the broker said
    is gone."""

    TTL = 60.0

    def __init__(self, settings: MessagingSettings) -> None:
        self.settings = settings
        self._known: dict[str, float] = {"": float("inf")}  # the default exchange always exists
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None

    def exists(self, exchange: str) -> bool:
        if self._known.get(exchange, 0.0) > time.monotonic():
            return True
        try:
            if self._connection is None or not self._connection.is_open:
                self._connection = connect(self.settings, name="relay exchange probe")
            if self._channel is None or not self._channel.is_open:
                self._channel = self._connection.channel()
            with expecting_not_found():
                self._channel.exchange_declare(exchange, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == NOT_FOUND:
                return False
            raise
        except pika.exceptions.AMQPError:
            # The probe cannot tell; let the publish try (a 404 there is handled too).
            self.close()
            return True
        self._known[exchange] = time.monotonic() + self.TTL
        return True

    def forget(self, exchange: str | None) -> None:
        """The broker said ``exchange`` is gone: check it again before the next publish."""
        if exchange is not None and exchange != "":
            self._known.pop(exchange, None)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:
                logger.debug("closing the exchange probe failed", exc_info=True)
