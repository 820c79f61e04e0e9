"""Queues a consumer left behind when its shape changed, found and moved at each ``consume``
start (``docs/design.md#leftover-queues``)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from ..conf import MessagingSettings, messaging_settings
from ..core.envelope import (
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    SENDER_ROUTING_HEADERS,
)
from ..core.registry import ConsumerSpec, registry
from .probes import PassiveProbe
from .replies import NOT_FOUND, PRECONDITION_FAILED
from .topology import consumer_exchange, consumer_queues, partition_exchange

logger = logging.getLogger(__name__)

# Partition queues are numbered from 0 without gaps; probing stops at the first missing one.
MAX_PARTITIONS_PROBED = 256
# Times a leftover is drained again when messages arrived between the drain and the delete.
DELETE_ROUNDS = 5


@dataclass(frozen=True)
class Leftover:
    spec: ConsumerSpec
    queue: str
    # The bindings that feed it, cut before it is drained: (source exchange, routing key).
    feeds: tuple[tuple[str, str], ...]
    messages: int
    consumers: int


def _partitions_from(probe: PassiveProbe, spec: ConsumerSpec, first: int) -> list[str]:
    names = (f"{spec.queue}.p{index}" for index in range(first, MAX_PARTITIONS_PROBED))
    return list(itertools.takewhile(lambda name: probe.queue(name) is not None, names))


def find_leftovers(
    connection: BlockingConnection,
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
) -> list[Leftover]:
    """The leftover queues of ``specs`` on the broker (passive declares only); a queue that a
    registered consumer reads now is never one, whatever its name."""
    specs = list(specs)
    live = {
        queue for spec in [*registry.all(), *specs] for queue in consumer_queues(spec, settings)
    }
    found: list[Leftover] = []
    with closing(PassiveProbe(connection)) as probe:
        for spec in specs:
            feeds: dict[str, tuple[tuple[str, str], ...]] = {}
            if spec.ordered:
                # From before ordered=True: most likely fed by the bindings the consumer has now.
                exchange = consumer_exchange(spec, settings)
                feeds[spec.queue] = tuple((exchange, b) for b in spec.bindings)
                # From a larger ORDERED_PARTITIONS: fed by the partition exchange, weight "1".
                for name in _partitions_from(probe, spec, settings.ordered_partitions):
                    feeds[name] = ((partition_exchange(spec), "1"),)
            else:
                # From before ordered=False: fed by the partition exchange, deleted first.
                feeds = dict.fromkeys(_partitions_from(probe, spec, 0), ())
            for name, fed_by in feeds.items():
                figures = None if name in live else probe.queue(name)
                if figures is not None:
                    found.append(Leftover(spec, name, fed_by, *figures))
    return found


def retire_leftovers(
    connection: BlockingConnection,
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
) -> list[Leftover]:
    """Find the leftovers of ``specs``, move what they hold where the consumer reads now (each
    acked after its copy is confirmed) and delete them; returns what was found."""
    specs = list(specs)
    # An ordered consumer turned plain: stop the old partitions' feed before looking at them.
    live = {partition_exchange(spec) for spec in registry.all() if spec.ordered}
    try:
        with closing(PassiveProbe(connection)) as probe:
            for spec in specs:
                exchange = partition_exchange(spec)
                if spec.ordered or exchange in live or not probe.exchange(exchange):
                    continue
                with connection.channel() as channel:
                    channel.exchange_delete(exchange)
                logger.warning(
                    "consumer=%s is no longer ordered: deleted its partition exchange %r, which "
                    "kept copying messages into its old partition queues",
                    spec.name,
                    exchange,
                )
        leftovers = find_leftovers(connection, specs, settings)
    except pika.exceptions.AMQPChannelError as exc:
        # Refused by the broker: left in place, and consuming goes on (connection errors
        # propagate, for the caller's reconnect).
        logger.error(
            "could not look for or retire leftover queues (%s: %s); they are left in place",
            type(exc).__name__,
            exc,
        )
        return []
    for leftover in leftovers:
        try:
            _retire(connection, leftover, settings)
        except pika.exceptions.AMQPChannelError as exc:
            logger.error(
                "consumer=%s: could not retire leftover queue %r (%s: %s); it is left in place",
                leftover.spec.name,
                leftover.queue,
                type(exc).__name__,
                exc,
            )
    return leftovers


def _retire(
    connection: BlockingConnection, leftover: Leftover, settings: MessagingSettings
) -> None:
    spec, queue = leftover.spec, leftover.queue
    logger.warning(
        "consumer=%s: queue %r is left from an earlier shape of this consumer (%s) and holds "
        "%d message(s); moving them to where it consumes now and deleting it",
        spec.name,
        queue,
        "before ordered=True"
        if spec.ordered and queue == spec.queue
        else "a larger ORDERED_PARTITIONS"
        if spec.ordered
        else "before ordered=False",
        leftover.messages,
    )
    channel = connection.channel()
    for exchange, routing_key in leftover.feeds:
        channel.queue_unbind(queue, exchange, routing_key=routing_key)
    channel.confirm_delivery()
    moved = 0
    for _ in range(DELETE_ROUNDS):
        moved += _move_all(channel, queue, spec, settings)
        try:
            channel.queue_delete(queue, if_unused=True, if_empty=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == NOT_FOUND:
                break  # another consume process retired it at the same moment
            if exc.reply_code != PRECONDITION_FAILED:
                raise
            channel = connection.channel()
            channel.confirm_delivery()
            with closing(PassiveProbe(connection)) as probe:
                figures = probe.queue(queue)
            if figures is not None and figures[1] > 0:
                logger.warning(
                    "consumer=%s: leftover queue %r still has %d consumer(s) (an older version "
                    "of the app still running?); moved %d message(s) out of it and left it in "
                    "place: the next consume start retires it",
                    spec.name,
                    queue,
                    figures[1],
                    moved,
                )
                break
            continue  # messages arrived between the drain and the delete: drain again
        logger.warning(
            "consumer=%s: moved %d message(s) out of leftover queue %r and deleted it",
            spec.name,
            moved,
            queue,
        )
        break
    else:
        logger.warning(
            "consumer=%s: leftover queue %r keeps receiving messages (bound by a binding this "
            "consumer no longer has?); moved %d message(s) out of it and left it in place: "
            "remove its bindings (management UI) and the next consume start retires it",
            spec.name,
            queue,
            moved,
        )
    if channel.is_open:
        channel.close()


def _move_all(
    channel: BlockingChannel, queue: str, spec: ConsumerSpec, settings: MessagingSettings
) -> int:
    moved = 0
    while True:
        method, got_properties, got_body = channel.basic_get(queue, auto_ack=False)
        if method is None or method.delivery_tag is None:
            return moved
        tag: int = method.delivery_tag
        properties = got_properties or pika.BasicProperties()
        body = got_body or b""
        original_key = method.routing_key or ""
        # Moved to the consumer's queue only: a producer's CC/BCC would copy it further.
        headers = {
            k: v for k, v in (properties.headers or {}).items() if k not in SENDER_ROUTING_HEADERS
        }
        if spec.ordered:
            # The partition exchange hashes the ordering-key header; the routing key stays.
            exchange, routing_key = partition_exchange(spec), original_key
        else:
            # Straight to the consumer's queue, the origin kept in headers as retries do.
            headers.setdefault(ORIGINAL_ROUTING_KEY_HEADER, original_key)
            headers.setdefault(
                ORIGINAL_EXCHANGE_HEADER, method.exchange or consumer_exchange(spec, settings)
            )
            exchange, routing_key = "", spec.queue
        properties.headers = headers
        try:
            channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            channel.basic_nack(tag, requeue=True)
            raise pika.exceptions.AMQPChannelError(
                f"the copy of message_id={properties.message_id} was not accepted "
                f"({type(exc).__name__})"
            ) from exc
        channel.basic_ack(tag)
        moved += 1
