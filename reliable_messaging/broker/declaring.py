"""Declaring consumers' topology on a connection of its own, tolerating drift: the relay's way."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

import pika.exceptions

from ..conf import MessagingSettings
from ..core.registry import ConsumerSpec
from ..exceptions import TopologyMismatchError
from .queues import describe_broker_error
from .topology import CONNECTION_ERRORS, Declared, connect, declare_topology

logger = logging.getLogger(__name__)


def declare_tolerantly(
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings,
    *,
    name: str,
    timeout: float,
    known_unavailable: Collection[str] = (),
) -> Declared | str:
    """Declare what ``specs`` need, as ``consume`` does; never raises for what the broker does:
    what was declared (on a connection closed since), or, as a string, why it failed."""
    try:
        connection = connect(settings, name, timeout=timeout)
    except CONNECTION_ERRORS as exc:
        return f"the broker could not be reached ({describe_broker_error(exc, settings)})"
    try:
        return declare_topology(
            connection.channel(),
            specs,
            settings,
            known_unavailable=known_unavailable,
            tolerate_mismatch=True,
        )
    except TopologyMismatchError as exc:  # the consistent-hash plugin is missing
        return str(exc)
    except pika.exceptions.ChannelClosedByBroker as exc:
        return f"the broker refused: {exc.reply_code} {exc.reply_text}"
    except CONNECTION_ERRORS as exc:
        return f"the connection was lost ({describe_broker_error(exc, settings)})"
    finally:
        if connection.is_open:
            try:
                connection.close()
            except CONNECTION_ERRORS:
                logger.debug("closing the declaring connection failed", exc_info=True)
