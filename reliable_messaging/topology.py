"""Names and declaration of the broker objects: exchanges, consumer queues, delay queues.

Retries are delayed without any plugin: each delay value has a fanout exchange and a queue with
that message TTL whose dead-letter exchange is the default exchange (""). A retry copy is
published to the delay exchange with the failed consumer's queue name as routing key; when its
TTL expires the broker dead-letters it to the default exchange under that same routing key, so
it lands in that one queue only, never with the routing key's other subscribers. One queue per
delay value keeps every message in a queue with a uniform TTL, so none waits behind a longer one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from .conf import MessagingSettings, messaging_settings
from .exceptions import TopologyMismatchError
from .registry import ConsumerSpec
from .retry import delay_name

logger = logging.getLogger(__name__)

PRECONDITION_FAILED = 406


def delay_exchange_name(delay: float, settings: MessagingSettings = messaging_settings) -> str:
    return f"{settings.exchange}.delay.{delay_name(delay)}"


def consumer_exchange(spec: ConsumerSpec, settings: MessagingSettings = messaging_settings) -> str:
    return spec.exchange or settings.exchange


def queue_arguments(settings: MessagingSettings = messaging_settings) -> dict[str, Any]:
    if settings.queue_type == "quorum":
        return {"x-queue-type": "quorum"}
    return {}


def all_delays(
    specs: Iterable[ConsumerSpec], settings: MessagingSettings = messaging_settings
) -> list[float]:
    delays = set(settings.retry_delays)
    for spec in specs:
        delays.update(spec.retry_delays or ())
    return sorted(delays)


def _mismatch(kind: str, name: str, exc: pika.exceptions.ChannelClosedByBroker) -> Exception:
    if exc.reply_code != PRECONDITION_FAILED:
        return exc
    return TopologyMismatchError(
        f"The broker already has {kind} {name!r} declared with other arguments: "
        f"{exc.reply_text}. Either make the settings match the existing {kind}, or migrate: "
        f"stop its consumers, drain it, delete it (rabbitmqctl delete_queue / delete_exchange "
        f"{name}) and start again so it is declared afresh."
    )


def declare_topology(
    channel: BlockingChannel,
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
) -> None:
    """Declare (idempotently) everything the given consumers need. A declaration that conflicts
    with what the broker has raises :class:`TopologyMismatchError` saying what differs."""
    specs = list(specs)
    for exchange in sorted({consumer_exchange(s, settings) for s in specs} | {settings.exchange}):
        try:
            channel.exchange_declare(exchange, exchange_type="topic", durable=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _mismatch("exchange", exchange, exc) from exc
    arguments = queue_arguments(settings)
    for spec in specs:
        try:
            channel.queue_declare(spec.queue, durable=True, arguments=arguments)
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _mismatch("queue", spec.queue, exc) from exc
        for binding in spec.bindings:
            channel.queue_bind(spec.queue, consumer_exchange(spec, settings), routing_key=binding)
    for delay in all_delays(specs, settings):
        name = delay_exchange_name(delay, settings)
        try:
            channel.exchange_declare(name, exchange_type="fanout", durable=True)
            channel.queue_declare(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": round(delay * 1000),
                    "x-dead-letter-exchange": "",
                },
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            raise _mismatch("delay queue", name, exc) from exc
        channel.queue_bind(name, name)
    logger.info(
        "declared topology: %d queue(s), %d delay queue(s)",
        len(specs),
        len(all_delays(specs, settings)),
    )


def connection_parameters(
    settings: MessagingSettings = messaging_settings, name: str = "reliable_messaging"
) -> pika.URLParameters:
    params = pika.URLParameters(settings.broker_url)
    params.heartbeat = settings.heartbeat
    params.blocked_connection_timeout = 300
    params.connection_attempts = 1
    params.client_properties = {"connection_name": name}
    return params
