"""Names and declaration of the broker objects: exchanges and consumer queues (the ordered
consumers' partitions: ``docs/design.md#topology-ordered-partitions``)."""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from ..conf import MessagingSettings, messaging_settings
from ..core.envelope import ORDERING_KEY_HEADER
from ..core.priorities import MAX_PRIORITY
from ..core.registry import ConsumerSpec
from ..exceptions import TopologyMismatchError
from .replies import COMMAND_INVALID, NOT_FOUND, PRECONDITION_FAILED

logger = logging.getLogger(__name__)

# Errors after which a connection (or its channel) is gone and a new one must be made.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.StreamLostError,
    pika.exceptions.ConnectionWrongStateError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
    OSError,
)
HASH_EXCHANGE_PLUGIN = "rabbitmq_consistent_hash_exchange"


def consumer_exchange(spec: ConsumerSpec, settings: MessagingSettings = messaging_settings) -> str:
    return spec.exchange or settings.exchange


def partition_exchange(spec: ConsumerSpec) -> str:
    return f"{spec.queue}.partitions"


def consumer_queues(
    spec: ConsumerSpec, settings: MessagingSettings = messaging_settings
) -> list[str]:
    """The queues ``spec`` consumes: its own, or an ordered consumer's partitions."""
    if not spec.ordered:
        return [spec.queue]
    return [f"{spec.queue}.p{index}" for index in range(settings.ordered_partitions)]


def dead_letter_queue(spec: ConsumerSpec) -> str:
    """Quorum queues only: where the broker dead-letters a message past ``x-delivery-limit``."""
    return f"{spec.queue}.dead"


def broker_dead_letter_queues(spec: ConsumerSpec) -> list[str]:
    """The queues the broker dead-letters ``spec``'s messages into (quorum queues only): the
    ``.dead`` queue, and the classic queue (no delivery limit) past its delivery limit."""
    return [dead_letter_queue(spec), f"{spec.queue}.dead.kept"]


def queue_arguments(
    settings: MessagingSettings = messaging_settings,
    *,
    ordered: bool = False,
    dead_letter_to: str | None = None,
    priorities: bool = False,
) -> dict[str, Any]:
    # The type always stated: a vhost can make quorum its default type (RabbitMQ 3.11+).
    arguments: dict[str, Any] = {"x-queue-type": settings.queue_type}
    if priorities and settings.queue_type == "classic":
        # A quorum queue refuses the argument (3.10 to 4.3): from 4.0 it orders by priority
        # without one (docs/tasks.md#priorities).
        arguments["x-max-priority"] = MAX_PRIORITY
    if settings.queue_type == "quorum":
        # The broker's own guard against a message that crashes its consumer before any ack.
        arguments["x-delivery-limit"] = settings.quorum_delivery_limit
        if dead_letter_to is not None:
            arguments["x-dead-letter-exchange"] = ""
            arguments["x-dead-letter-routing-key"] = dead_letter_to
    if ordered:
        arguments["x-single-active-consumer"] = True
    return arguments


@dataclass
class Declared:
    """:func:`declare_topology`'s declarer and its result: ``channel``, open, is reopened when
    the broker closes it; ``unavailable`` names each queue the broker cannot serve now (404: its
    node down) and ``mismatched`` each it has with other arguments."""

    channel: BlockingChannel
    unavailable: dict[str, str] = field(default_factory=dict)
    mismatched: dict[str, str] = field(default_factory=dict)
    known: Collection[str] = ()  # already reported unavailable: tried again quietly
    tolerate_mismatch: bool = False

    def _mismatched(
        self,
        kind: str,
        name: str,
        exc: pika.exceptions.ChannelClosedByBroker,
        wanted: dict[str, Any],
    ) -> None:
        """Raise what the broker's refusal means or, when mismatches are tolerated, note it."""
        if exc.reply_code != PRECONDITION_FAILED:
            raise exc
        queue_type = "quorum" if wanted.get("x-queue-type") == "quorum" else "classic"
        hint = ""
        if "x-max-priority" in str(exc.reply_text):
            hint = (
                " Task queues are declared with x-max-priority so that a classic queue honours "
                "the tasks' priorities, and no policy can add it to an existing queue: stop the "
                "relay, let the consumers empty the queue with the old declaration, then delete "
                "the queue and start again (docs/tasks.md#priorities)."
            )
        elif "x-queue-type" in str(exc.reply_text):
            hint = (
                f" A queue's type cannot change in place: to move to {queue_type} queues, run "
                f"the consumers with the old QUEUE_TYPE until the queue is empty (stop the relay "
                f"first, or bind a new queue and let the old one drain), then delete the queue "
                f"and start with QUEUE_TYPE={queue_type!r}."
            )
        error = TopologyMismatchError(
            f"The broker already has {kind} {name!r} declared with other arguments than these "
            f"settings ask for ({wanted or 'no arguments'}): {exc.reply_text}.{hint} Either "
            f"make the settings match the existing {kind}, or migrate: stop its consumers, "
            f"drain it, delete it (rabbitmqctl delete_queue / delete_exchange {name}) and start "
            f"again so it is declared afresh."
        )
        if not self.tolerate_mismatch:
            raise error from exc
        self.mismatched[name] = str(error)
        self.channel = self.channel.connection.channel()

    def exchange(
        self, name: str, exchange_type: str, arguments: dict[str, Any] | None = None
    ) -> None:
        try:
            self.channel.exchange_declare(
                name, exchange_type=exchange_type, durable=True, arguments=arguments
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._mismatched("exchange", name, exc, arguments or {"type": exchange_type})

    def queue(
        self,
        kind: str,
        name: str,
        arguments: dict[str, Any],
        bindings: Iterable[tuple[str, str]] = (),
    ) -> None:
        """Declare durable queue ``name`` with ``arguments`` and bind it (exchange, routing key);
        a queue unavailable now is noted so."""
        try:
            try:
                self.channel.queue_declare(name, durable=True, arguments=arguments)
            except pika.exceptions.ChannelClosedByBroker as exc:
                self._mismatched(kind, name, exc, arguments)
            for exchange, routing_key in bindings:
                self.channel.queue_bind(name, exchange, routing_key)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != NOT_FOUND:
                raise  # refused (403), locked (405)...: the broker's answer for every queue
            self.channel = self.channel.connection.channel()
            self.unavailable[name] = f"{exc.reply_code} {exc.reply_text}"
            log = logger.debug if name in self.known else logger.warning
            log(
                "%s %s cannot be declared now (%s %s); the other queues are consumed and it "
                "is tried again",
                kind,
                name,
                exc.reply_code,
                exc.reply_text,
            )


def declare_topology(
    channel: BlockingChannel,
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
    *,
    known_unavailable: Collection[str] = (),
    tolerate_mismatch: bool = False,
) -> Declared:
    """Declare (idempotently) everything the given consumers need. A conflicting declaration
    raises :class:`TopologyMismatchError` (with ``tolerate_mismatch``, it is named in the
    result); a queue the broker cannot serve now is left out and named in the result."""
    specs = list(specs)
    declarer = Declared(channel, known=known_unavailable, tolerate_mismatch=tolerate_mismatch)
    for exchange in sorted({consumer_exchange(s, settings) for s in specs} | {settings.exchange}):
        declarer.exchange(exchange, "topic")
    for spec in specs:
        dead_letter_to = _declare_dead_letter_queue(declarer, spec, settings)
        if spec.ordered:
            # Equal weights: the binding key of a consistent-hash exchange is the queue's weight.
            bindings = [(_declare_partition_exchange(declarer, spec, settings), "1")]
        else:
            bindings = [(consumer_exchange(spec, settings), key) for key in spec.bindings]
        wanted = queue_arguments(
            settings,
            ordered=spec.ordered,
            dead_letter_to=dead_letter_to,
            priorities=spec.priorities,
        )
        for queue in consumer_queues(spec, settings):
            arguments = _arguments_the_broker_takes(declarer.channel, queue, wanted)
            declarer.queue("queue", queue, arguments, bindings)
    log = logger.debug if declarer.unavailable and declarer.known else logger.info
    log(
        "declared topology: %d queue(s)%s",
        sum(len(consumer_queues(spec, settings)) for spec in specs),
        f"; not available now: {', '.join(sorted(declarer.unavailable))}"
        if declarer.unavailable
        else "",
    )
    return declarer


def _declare_dead_letter_queue(
    declarer: Declared, spec: ConsumerSpec, settings: MessagingSettings
) -> str | None:
    if settings.queue_type != "quorum":
        return None
    name, kept = broker_dead_letter_queues(spec)
    # The .dead queue's delivery limit stated (RabbitMQ 4 gives one, 20 by default, and drops
    # past it without a target): past it a message goes to the classic .dead.kept queue.
    declarer.queue("dead-letter queue", kept, {"x-queue-type": "classic"})
    declarer.queue("dead-letter queue", name, queue_arguments(settings, dead_letter_to=kept))
    # Named as the target even when unavailable now: the broker routes to it once it exists.
    return name


def _arguments_the_broker_takes(
    channel: BlockingChannel, queue: str, arguments: dict[str, Any]
) -> dict[str, Any]:
    """``arguments``, or without the dead-letter target when ``queue`` already exists without
    one: its arguments cannot change in place, and refusing to start would be worse."""
    if "x-dead-letter-routing-key" not in arguments:
        return arguments
    try:
        # On a channel of its own: the broker closes one that declares a queue differently.
        with channel.connection.channel() as probe:
            probe.queue_declare(queue, durable=True, arguments=arguments)
        return arguments
    except pika.exceptions.ChannelClosedByBroker as refused:
        if refused.reply_code != PRECONDITION_FAILED or "x-dead-letter" not in refused.reply_text:
            return arguments  # another refusal or mismatch: the real declaration reports it
    logger.warning(
        "queue %s exists without a dead-letter target: a message that reaches its "
        "x-delivery-limit would be dropped by the broker. Give it one with a policy "
        "(rabbitmqctl set_policy --apply-to queues <name> '^%s$' "
        '\'{"dead-letter-exchange":"","dead-letter-routing-key":"%s"}\'), or drain '
        "and delete it so that it is declared afresh",
        queue,
        queue,
        arguments["x-dead-letter-routing-key"],
    )
    return {k: v for k, v in arguments.items() if not k.startswith("x-dead-letter-")}


def _declare_partition_exchange(
    declarer: Declared, spec: ConsumerSpec, settings: MessagingSettings
) -> str:
    """Declare ``spec``'s consistent-hash exchange, bound to its consumer exchange; its name."""
    exchange = partition_exchange(spec)
    hashing = {"hash-header": ORDERING_KEY_HEADER}
    try:
        declarer.exchange(exchange, "x-consistent-hash", hashing)
    except pika.exceptions.ConnectionClosedByBroker as exc:
        if exc.reply_code != COMMAND_INVALID or "exchange type" not in str(exc.reply_text):
            raise
        raise TopologyMismatchError(
            f"Ordered consumers need RabbitMQ's consistent-hash exchange ({exc.reply_text}). "
            f"Enable it on every node: rabbitmq-plugins enable {HASH_EXCHANGE_PLUGIN}"
        ) from exc
    for binding in spec.bindings:
        declarer.channel.exchange_bind(
            exchange, consumer_exchange(spec, settings), routing_key=binding
        )
    return exchange


def broker_host(url: str) -> str:
    """The host a broker URL names, as pika reads it ("" for none); raises what pika raises."""
    return str(pika.URLParameters(url).host or "")


def connection_parameters(
    settings: MessagingSettings = messaging_settings, name: str = "reliable_messaging"
) -> list[pika.URLParameters]:
    """One set of connection parameters per broker URL, in a new random order each call, so
    that the processes of a deployment spread over a cluster's nodes."""
    found = []
    for url in settings.broker_urls:
        params = pika.URLParameters(url)
        params.heartbeat = settings.heartbeat
        params.blocked_connection_timeout = 300
        params.connection_attempts = 1
        params.client_properties = {"connection_name": name}
        found.append(params)
    if not found:
        raise ValueError("BROKER_URL holds no URL")
    random.shuffle(found)
    return found


def connect(
    settings: MessagingSettings = messaging_settings,
    name: str = "reliable_messaging",
    *,
    timeout: float | None = None,
) -> pika.BlockingConnection:
    """A blocking connection to the first broker URL that answers (``timeout`` for each);
    raises the last error when none answers."""
    return connect_to_any(connection_parameters(settings, name), timeout=timeout)[0]


def connect_to_any(
    candidates: list[pika.URLParameters], *, timeout: float | None = None
) -> tuple[pika.BlockingConnection, pika.URLParameters]:
    """The connection and the parameters it was opened with (so a caller knows the node)."""
    error: BaseException | None = None
    for params in candidates:
        if timeout is not None:
            params.socket_timeout = timeout
            params.stack_timeout = timeout
        try:
            return pika.BlockingConnection(params), params
        except (pika.exceptions.AMQPConnectionError, OSError) as exc:
            error = exc
            logger.debug("broker %s:%s refused: %r", params.host, params.port, exc)
    assert error is not None
    raise error
