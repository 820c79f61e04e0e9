"""Does a queue or an exchange exist? Passive declares, the one way the app asks (the relay's
:class:`ExchangeProbe`: a publish to a missing exchange would close the channel under every row
in flight)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from ..conf import MessagingSettings
from .pika_logs import expecting_not_found
from .replies import NOT_FOUND
from .topology import connect

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")


class PassiveProbe:
    """Passive declares on ``connection``, on one channel reopened after each "no" (a 404
    closes it); any other refusal is raised."""

    def __init__(self, connection: BlockingConnection) -> None:
        self.connection = connection
        self._channel: BlockingChannel | None = None

    def queue(self, name: str) -> tuple[int, int] | None:
        """(ready messages, consumers) of queue ``name``, or None when it does not exist."""
        ok = self._ask(lambda channel: channel.queue_declare(name, passive=True))
        if ok is None:
            return None
        return int(ok.method.message_count or 0), int(ok.method.consumer_count or 0)

    def exchange(self, name: str) -> bool:
        return self._ask(lambda channel: channel.exchange_declare(name, passive=True)) is not None

    def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and channel.is_open:
            channel.close()

    def _ask(self, declare: Callable[[BlockingChannel], Any]) -> Any:
        if self._channel is None or not self._channel.is_open:
            self._channel = self.connection.channel()
        try:
            with expecting_not_found():
                return declare(self._channel)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = None  # the broker closed it
            if exc.reply_code != NOT_FOUND:
                raise
            return None


class ExchangeProbe:
    """Remembers for ``TTL`` seconds each exchange found, asked on a connection of its own."""

    TTL = 60.0

    def __init__(self, settings: MessagingSettings) -> None:
        self.settings = settings
        self._known: dict[str, float] = {"": float("inf")}  # the default exchange always exists
        self._connection: BlockingConnection | None = None
        self._probe: PassiveProbe | None = None

    def exists(self, exchange: str) -> bool:
        if self._known.get(exchange, 0.0) > time.monotonic():
            return True
        try:
            if self._connection is None or not self._connection.is_open:
                self._connection = connect(self.settings, name="relay exchange probe")
                self._probe = PassiveProbe(self._connection)
            assert self._probe is not None
            if not self._probe.exchange(exchange):
                return False
        except pika.exceptions.ChannelClosedByBroker:
            raise  # a refusal other than 404 (403, ...): not the probe's "cannot tell" below
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
        connection, self._connection, self._probe = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:
                logger.debug("closing the exchange probe failed", exc_info=True)
