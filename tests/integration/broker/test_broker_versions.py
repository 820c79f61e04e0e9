"""What RabbitMQ 4 changed under our queues, proven on each broker line: 3.10.8 (the system
node), 4.0.5 and 4.3.x (tests/rabbitmq4.py).

4.0 gives every quorum queue a delivery limit of 20 and drops past it when the queue has no
dead-letter target, and a vhost can make quorum its default queue type: every queue we declare
states its type, and ``<queue>.dead`` states its limit and where what passes it goes. 4.3
counts toward that limit only the deliveries that failed (a ``basic.reject`` with requeue, a
channel or connection closed on the message), not a ``basic.nack`` with requeue. 4.3's
quorum-queue delayed retry is shown as such a client meets it (no use to our retries).
"""

from __future__ import annotations

import functools
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from django.test import override_settings

from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter
from tests.support import wait_until

SYSTEM_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
SYSTEM_MANAGEMENT_URL = "http://127.0.0.1:15672"


class Node:
    """One broker node: its AMQP URL and management API."""

    def __init__(self, url: str, management_url: str) -> None:
        self.url = url
        self.management_url = management_url

    def connection(self, vhost: str = "/") -> pika.BlockingConnection:
        base = self.url.rsplit("/", 1)[0]
        params = pika.URLParameters(f"{base}/{urllib.parse.quote(vhost, safe='')}")
        params.connection_attempts = 3
        params.retry_delay = 1
        return pika.BlockingConnection(params)

    def api(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(f"{self.management_url}/api/{path}", method=method)
        request.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def queues(self, fragment: str, vhost: str = "/") -> dict[str, dict[str, Any]]:
        found = self.api(f"queues/{urllib.parse.quote(vhost, safe='')}?columns=name,type")
        return {q["name"]: q for q in found if fragment in q["name"]}

    def delete_matching(self, fragment: str, vhost: str = "/") -> None:
        quoted = urllib.parse.quote(vhost, safe="")
        for queue in self.queues(fragment, vhost):
            self.api(f"queues/{quoted}/{urllib.parse.quote(queue, safe='')}", "DELETE")
        for exchange in self.api(f"exchanges/{quoted}?columns=name"):
            if fragment in exchange["name"]:
                name = urllib.parse.quote(exchange["name"], safe="")
                self.api(f"exchanges/{quoted}/{name}", "DELETE")


@pytest.fixture(params=["rabbitmq3", "rabbitmq4", "rabbitmq43"])
def node(request: pytest.FixtureRequest, ns: str) -> Iterator[Node]:
    """The system's 3.10 node, or the fixture of that name (the 4.0 and the 4.3 node)."""
    if request.param == "rabbitmq3":
        found = Node(SYSTEM_URL, SYSTEM_MANAGEMENT_URL)
    else:
        started = request.getfixturevalue(request.param)
        found = Node(started.url, started.management_url)
    yield found
    found.delete_matching(ns)


@pytest.fixture(params=["rabbitmq4", "rabbitmq43"])
def node4(request: pytest.FixtureRequest) -> Any:
    """Each RabbitMQ 4 node (tests/rabbitmq4.py), for what needs ``rabbitmqctl``."""
    return request.getfixturevalue(request.param)


def payments(ns: str) -> ConsumerSpec:
    return ConsumerSpec(
        name=f"{ns}.payments",
        queue=f"{ns}.payments",
        handler=lambda message: None,
        bindings=("payment.*",),
    )


def bounce(channel: Any, queue: str, times: int) -> int:
    """Take the message off ``queue`` and give it back as failed, up to ``times`` times or until
    the queue stays empty for a second (the broker moved it on); returns how many times it came.
    ``basic.reject``: every version counts it toward the delivery limit, where 4.3 no longer
    counts a ``basic.nack`` (see test_a_requeueing_nack_counts_toward_the_limit_before_4_3)."""
    came = 0
    empty_since: float | None = None
    while came < times:
        method, _, _ = channel.basic_get(queue)
        if method is None:
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > 1.0:
                break
            time.sleep(0.02)
            continue
        empty_since = None
        came += 1
        channel.basic_reject(method.delivery_tag, requeue=True)
    return came


def test_a_requeueing_nack_counts_toward_the_limit_before_4_3(node: Node, ns: str) -> None:
    """What the broker counts toward a quorum queue's delivery limit, the ground the crash guard
    and the docs stand on: a closed channel (a process that died on the message) and a
    ``basic.reject`` on every version; a ``basic.nack`` with requeue (what the app gives back
    undecided) before 4.3 only. On 4.3 such a nack leaves ``x-delivery-count`` unset."""
    version = node.api("overview")["rabbitmq_version"]
    counts_nacks = tuple(int(part) for part in version.split(".")[:2]) < (4, 3)
    connection = node.connection()
    try:
        channel = connection.channel()
        came: dict[str, int] = {}
        for how in ("nack", "reject", "close"):
            queue = f"{ns}.count-{how}"
            channel.queue_declare(f"{queue}.dead", durable=True)
            channel.queue_declare(
                queue,
                durable=True,
                arguments={
                    "x-queue-type": "quorum",
                    "x-delivery-limit": 2,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": f"{queue}.dead",
                },
            )
            channel.basic_publish("", queue, b"{}", pika.BasicProperties(delivery_mode=2))
            came[how] = 0
            counts: list[Any] = []
            while came[how] < 6 and (got := _next(channel, queue)) is not None:
                method, properties = got
                came[how] += 1
                counts.append((properties.headers or {}).get("x-delivery-count"))
                if how == "nack":
                    channel.basic_nack(method.delivery_tag, requeue=True)
                elif how == "reject":
                    channel.basic_reject(method.delivery_tag, requeue=True)
                else:
                    channel.close()
                    channel = connection.channel()
            if how == "nack" and not counts_nacks:
                assert (came[how], counts) == (6, [None] * 6), version
                wait_until(functools.partial(_has_depth, channel, queue, 1), timeout=5)
                assert _depth(channel, f"{queue}.dead") == 0
            else:
                # Delivered once and given back twice within the limit; the third return
                # passes it and the broker moves the message to <queue>.dead.
                # (3.10 gives the first delivery a count of 0, 4.x none.)
                assert (came[how], counts[1:]) == (3, [1, 2]), (how, version, counts)
                wait_until(functools.partial(_has_depth, channel, f"{queue}.dead", 1), timeout=5)
    finally:
        connection.close()


def _next(channel: Any, queue: str, within: float = 1.5) -> tuple[Any, Any] | None:
    """The next message of ``queue`` (method, properties), or None if none comes ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        method, properties, _ = channel.basic_get(queue)
        if method is not None:
            return method, properties
        time.sleep(0.02)
    return None


def _depth(channel: Any, queue: str) -> int:
    return int(channel.queue_declare(queue, passive=True).method.message_count)


def _has_depth(channel: Any, queue: str, depth: int) -> bool:
    return _depth(channel, queue) == depth


DELAYED_RETRY_MIN_MS = 2000


def _returned_twice(node: Node, queue: str, how: str) -> list[tuple[bool, Any]]:
    """Publish one message, take it and give it back (``nack`` or ``reject``) twice;
    for each return: was the message ready again at once, and its ``x-delivery-count`` then."""
    connection = node.connection()
    try:
        channel = connection.channel()
        channel.queue_declare(
            queue,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delayed-retry-type": "all",
                "x-delayed-retry-min": DELAYED_RETRY_MIN_MS,
                "x-delayed-retry-max": 4 * DELAYED_RETRY_MIN_MS,
            },
        )
        channel.basic_publish("", queue, b"{}", pika.BasicProperties(delivery_mode=2))
        seen: list[tuple[bool, Any]] = []
        got: list[Any] = []

        def take() -> bool:
            method, properties, _body = channel.basic_get(queue)
            if method is None:
                return False
            got[:] = [method, properties]
            return True

        wait_until(take, timeout=10, interval=0.05)
        for _ in range(2):
            method, _properties = got
            if how == "nack":
                channel.basic_nack(method.delivery_tag, requeue=True)
            else:
                channel.basic_reject(method.delivery_tag, requeue=True)
            at_once = take()
            if not at_once:
                wait_until(take, timeout=5 * DELAYED_RETRY_MIN_MS / 1000, interval=0.1)
            seen.append((at_once, (got[1].headers or {}).get("x-delivery-count")))
        channel.basic_ack(got[0].delivery_tag)
        return seen
    finally:
        connection.close()


@pytest.mark.parametrize("node", ["rabbitmq3", "rabbitmq43"], indirect=True)
def test_4_3s_delayed_retry_holds_a_nack_the_minimum_uncounted_and_backs_off_a_reject(
    node: Node, ns: str
) -> None:
    """RabbitMQ 4.3's quorum-queue delayed retry, as an AMQP 0.9.1 client meets it: the ground
    for keeping retries out of it (``docs/design.md#where-a-retry-waits``). A returned message
    waits ``min(min * delivery_count, max)``. A requeueing ``basic.nack`` is no failed delivery
    on 4.3: it waits the minimum every time, with no ``x-delivery-count`` (no backoff, no
    attempt number); a ``basic.reject`` counts, so its wait grows linearly, one schedule per
    queue. 3.10 (and 4.0) take the arguments and ignore them. The 4.0 node behaves as 3.10
    here and is not started for it."""
    version = node.api("overview")["rabbitmq_version"]
    delays = tuple(int(part) for part in version.split(".")[:2]) >= (4, 3)
    nacked = _returned_twice(node, f"{ns}.delayed-nack", "nack")
    rejected = _returned_twice(node, f"{ns}.delayed-reject", "reject")
    if delays:
        # Held back each time, never counted: the same minimum, no attempt number.
        assert nacked == [(False, None), (False, None)], version
        # Held back and counted: min * count, so a linear backoff of the queue's own.
        assert rejected == [(False, 1), (False, 2)], version
    else:
        assert [at_once for at_once, _count in nacked] == [True, True], version
        assert [at_once for at_once, _count in rejected] == [True, True], version


def test_a_message_past_the_dead_queues_limit_is_kept_and_becomes_a_dead_letter(
    node: Node, ns: str, rm_settings: dict[str, Any], service: Any
) -> None:
    """RabbitMQ 4 gives ``.dead`` a limit of 20 when it states none, and drops past it: a
    message that came back more often than that (a consumer losing its connection again and
    again while the database is down) vanished without a trace."""
    spec = payments(ns)
    quorum = {
        **rm_settings,
        "BROKER_URL": node.url,
        "QUEUE_TYPE": "quorum",
        "QUORUM_DELIVERY_LIMIT": 3,
    }
    with override_settings(RELIABLE_MESSAGING=quorum):
        connection = node.connection()
        try:
            declare_topology(connection.channel(), [spec])
            channel = connection.channel()
            channel.basic_publish(
                rm_settings["EXCHANGE"],
                "payment.captured",
                b'{"order": 7}',
                pika.BasicProperties(
                    message_id="limit-1", content_type="application/json", delivery_mode=2
                ),
            )
            # Past the consumer queue's limit, then past the .dead queue's own (more than the
            # 20 that RabbitMQ 4 gives a quorum queue that states none). 4.3 carries the count
            # along when it dead-letters: the message reaches .dead already past its limit,
            # and the first failed return there moves it on.
            assert bounce(channel, spec.queue, 10) >= 3
            assert bounce(channel, f"{spec.queue}.dead", 25) >= 1
            wait_until(lambda: _depth(channel, f"{spec.queue}.dead.kept") == 1, timeout=5)
        finally:
            connection.close()
        service([spec])
        wait_until(
            lambda: DeadLetter.objects.filter(message_id="limit-1").exists(),
            timeout=30,
            message="the message that passed both limits stored as a dead letter",
        )
    dead = DeadLetter.objects.get(message_id="limit-1")
    assert dead.reason == DeadLetterReason.DELIVERY_LIMIT
    # Its origin is the consumer's queue, not the .dead queue it passed through last.
    assert (dead.consumer, dead.queue, dead.routing_key) == (
        spec.name,
        spec.queue,
        "payment.captured",
    )


def test_classic_queues_stay_classic_on_a_vhost_whose_default_type_is_quorum(
    node4: Any, ns: str, rm_settings: dict[str, Any]
) -> None:
    """A queue declared without ``x-queue-type`` takes the vhost's default type: quorum, with
    the broker's delivery limit and no dead-letter target, where QUEUE_TYPE says classic."""
    vhost = f"rm-{ns}"
    node4.ctl("add_vhost", vhost, "--default-queue-type", "quorum")
    try:
        node4.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        node = Node(node4.url, node4.management_url)
        spec = payments(ns)
        ordered = ConsumerSpec(
            name=f"{ns}.ledger",
            queue=f"{ns}.ledger",
            handler=lambda message: None,
            bindings=("payment.*",),
            ordered=True,
        )
        with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": "classic"}):
            connection = node.connection(vhost)
            try:
                declare_topology(connection.channel(), [spec, ordered])
            finally:
                connection.close()
        types = {name: q["type"] for name, q in node.queues("", vhost).items()}
        ours = [spec.queue, *(f"{ordered.queue}.p{i}" for i in range(4))]
        assert {name: types.get(name) for name in ours} == dict.fromkeys(ours, "classic")
    finally:
        node4.ctl("delete_vhost", vhost)


def test_a_per_queue_consumer_timeout_takes_a_late_delivery_back(node4: Any, ns: str) -> None:
    """What the broker does to a consumer holding a delivery past its queue's consumer timeout
    (5 s here), the ground of the broker check's ``consumer-timeout`` finding: 4.0 closes the
    channel at its next check (every ``channel_tick_interval``: a minute by default, 5 s on the
    test nodes, scripts/rabbitmq4.sh; pika's blocking adapter says so only when
    the channel is used), on classic and quorum queues alike; 4.3 cancels the consumer of a
    quorum queue and keeps the channel open, refuses the argument on a classic queue and ignores
    the policy there. Where the broker acts, the delivery is back in the queue."""
    node = Node(node4.url, node4.management_url)
    version = node.api("overview")["rabbitmq_version"]
    is_43 = tuple(int(part) for part in version.split(".")[:2]) >= (4, 3)
    consuming = node.connection()
    side = node.connection().channel()
    policy = f"{ns}-consumer-timeout"
    try:
        channels: dict[str, Any] = {}
        cancelled: dict[str, list[Any]] = {}
        for kind in ("classic", "quorum"):
            queue = f"{ns}.timeout-{kind}"
            arguments: dict[str, Any] = {"x-queue-type": kind, "x-consumer-timeout": 5000}
            if is_43 and kind == "classic":
                with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                    consuming.channel().queue_declare(queue, durable=True, arguments=arguments)
                assert refused.value.reply_code == 406, refused.value
                del arguments["x-consumer-timeout"]
                node4.ctl(
                    "set_policy", policy, f"^{queue}$", '{"consumer-timeout": 5000}',
                    "--apply-to", "queues",
                )  # fmt: skip
            channel = channels[kind] = consuming.channel()
            channel.queue_declare(queue, durable=True, arguments=arguments)
            channel.basic_publish("", queue, b"{}", pika.BasicProperties(delivery_mode=2))
            cancelled[kind] = []
            channel.add_on_cancel_callback(cancelled[kind].append)
            channel.basic_consume(queue, lambda *delivery: None)  # holds it, never acks

        def back(kind: str) -> bool:
            consuming.process_data_events(0.2)
            return _depth(side, f"{ns}.timeout-{kind}") == 1

        wait_until(lambda: back("quorum"), timeout=150, message="the quorum queue's delivery back")
        if is_43:
            assert cancelled["quorum"] and channels["quorum"].is_open, version
            time.sleep(3)  # past the quorum queue's own check: the classic queue never acts
            assert not back("classic") and not cancelled["classic"], version
            assert channels["classic"].is_open, version
        else:
            wait_until(lambda: back("classic"), timeout=60, message="the classic delivery back")
            consuming.process_data_events(1)
            assert channels["quorum"].is_closed and channels["classic"].is_closed, version
            assert not cancelled["quorum"] and not cancelled["classic"], version
    finally:
        if is_43:
            node4.ctl("clear_policy", policy)
        consuming.close()
        side.connection.close()
        node.delete_matching(ns)
