"""Declaring consumers' topology on a connection of its own, tolerating drift: the relay's way.

:func:`declare_tolerantly` opens a connection, runs
:func:`~reliable_messaging.broker.topology.declare_topology` (the code ``consume`` runs) with
``tolerate_mismatch`` and closes the connection again. It never raises for what the broker
does: it returns the objects declared with other arguments and the queues the broker could not
serve now, or why nothing could be declared.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import pika.exceptions

from ..conf import MessagingSettings
from ..core.registry import ConsumerSpec
from ..exceptions import TopologyMismatchError
from .queues import describe_broker_error
from .topology import CONNECTION_ERRORS, connect, declare_topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TolerantDeclaration:
    """What :func:`declare_tolerantly` declared: ``mismatched`` names each object the broker
    has with other arguments (and what differs), ``unavailable`` each queue the broker could not
    declare or bind now (404: its node down, or the queue crashed), with why."""

    mismatched: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)


def declare_tolerantly(
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings,
    *,
    name: str,
    timeout: float,
    known_unavailable: Collection[str] = (),
) -> TolerantDeclaration | str:
    """Declare what ``specs`` need. What was declared, or, as a string, why the declaration
    failed (broker unreachable, a refusal such as 403 without the configure permission, the
    consistent-hash plugin missing). ``known_unavailable``: queues already reported unavailable,
    logged again at DEBUG only."""
    try:
        connection = connect(settings, name, timeout=timeout)
    except CONNECTION_ERRORS as exc:
        return f"the broker could not be reached ({describe_broker_error(exc, settings)})"
    try:
        declared = declare_topology(
            connection.channel(),
            specs,
            settings,
            known_unavailable=known_unavailable,
            tolerate_mismatch=True,
        )
        return TolerantDeclaration(declared.mismatched, declared.unavailable)
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
