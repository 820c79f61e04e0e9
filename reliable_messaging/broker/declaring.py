"""Declaring consumers' topology on a connection of its own, tolerating drift: the relay's way.

:func:`declare_tolerantly` opens a connection, runs
:func:`~reliable_messaging.broker.topology.declare_topology` (the code ``consume`` runs) with
``tolerate_mismatch`` and closes the connection again. It never raises for what the broker
does: it returns the objects declared with other arguments, or why nothing could be declared.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pika.exceptions

from ..conf import MessagingSettings
from ..core.registry import ConsumerSpec
from ..exceptions import TopologyMismatchError
from .queues import describe_broker_error
from .topology import CONNECTION_ERRORS, connect, declare_topology

logger = logging.getLogger(__name__)


def declare_tolerantly(
    specs: Iterable[ConsumerSpec], settings: MessagingSettings, *, name: str, timeout: float
) -> dict[str, str] | str:
    """Declare what ``specs`` need. The objects the broker has with other arguments (name:
    what differs), or, as a string, why the declaration failed (broker unreachable, a refusal
    such as 403 without the configure permission, the consistent-hash plugin missing)."""
    try:
        connection = connect(settings, name, timeout=timeout)
    except CONNECTION_ERRORS as exc:
        return f"the broker could not be reached ({describe_broker_error(exc, settings)})"
    try:
        declared = declare_topology(connection.channel(), specs, settings, tolerate_mismatch=True)
        return declared.mismatched
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
