"""A consumer whose shape changed (ordered on or off, fewer partitions) leaves queues behind that
still receive messages. ``consume`` retires them when it connects: nothing is stranded in them,
nothing new reaches them, and they are deleted once empty. Real RabbitMQ, real queues."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from django.test import override_settings

from reliable_messaging.broker.leftovers import find_leftovers, retire_leftovers
from reliable_messaging.broker.topology import consumer_queues, declare_topology, partition_exchange
from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.envelope import (
    ORDERING_KEY_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    Delivery,
    Message,
    decode_delivery,
    normalize_headers,
)
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.core.routing import topic_matches
from tests.support import Publisher, broker_connection


@pytest.fixture
def connection() -> Iterator[pika.BlockingConnection]:
    conn = broker_connection()
    yield conn
    if conn.is_open:
        conn.close()


def spec_for(ns: str, *, ordered: bool) -> ConsumerSpec:
    return ConsumerSpec(
        name="tests.leftovers.ledger",
        queue=f"rmtest.{ns}.ledger",
        handler=lambda m: None,
        bindings=("acct.*",),
        ordered=ordered,
    )


def depth(connection: pika.BlockingConnection, queue: str) -> int | None:
    """Ready messages in ``queue``; None when it does not exist."""
    channel = connection.channel()
    try:
        method = channel.queue_declare(queue, passive=True).method
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return None
    channel.close()
    return int(method.message_count or 0)


def exchange_exists(connection: pika.BlockingConnection, exchange: str) -> bool:
    channel = connection.channel()
    try:
        channel.exchange_declare(exchange, passive=True)
    except pika.exceptions.ChannelClosedByBroker:
        return False
    channel.close()
    return True


def publish_keys(exchange: str, keys: list[str]) -> list[str]:
    """One message per key through the topic exchange, as the relay sends it; their ids."""
    publisher = Publisher()
    ids = []
    try:
        for n, key in enumerate(keys):
            message_id = f"m-{n}-{key}"
            publisher.publish(
                exchange,
                f"acct.{key}",
                {"key": key, "n": n},
                message_id=message_id,
                headers={ORDERING_KEY_HEADER: key, "x-rm-attempt": 2, "tenant": "t1"},
            )
            ids.append(message_id)
    finally:
        publisher.close()
    return ids


def decoded(delivery: Delivery) -> Message:
    message = decode_delivery(delivery, max_body_bytes=messaging_settings.max_body_bytes)
    assert isinstance(message, Message), message
    return message


def drain(connection: pika.BlockingConnection, queues: list[str]) -> list[Delivery]:
    """Every message in ``queues``, acked, as deliveries the consumer would decode."""
    channel = connection.channel()
    found = []
    for queue in queues:
        while True:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            assert properties is not None and body is not None
            found.append(
                Delivery(
                    body=body,
                    message_id=properties.message_id,
                    content_type=properties.content_type,
                    headers=normalize_headers(properties.headers),
                    routing_key=method.routing_key or "",
                    exchange=method.exchange or "",
                    queue=queue,
                    timestamp=properties.timestamp,
                )
            )
    channel.close()
    return found


def test_turning_ordered_on_moves_the_old_queue_into_the_partitions(
    connection: pika.BlockingConnection,
    ns: str,
    rm_settings: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = spec_for(ns, ordered=False)
    declare_topology(connection.channel(), [plain])
    keys = [f"k{i}" for i in range(12)]
    ids = publish_keys(rm_settings["EXCHANGE"], keys)
    assert depth(connection, plain.queue) == len(keys)

    ordered = dataclasses.replace(plain, ordered=True)
    declare_topology(connection.channel(), [ordered])
    # Before retirement the old queue gets a copy of every new message: the hazard.
    assert [leftover.queue for leftover in find_leftovers(connection, [ordered])] == [plain.queue]
    with caplog.at_level(logging.WARNING, logger="reliable_messaging.broker.leftovers"):
        retired = retire_leftovers(connection, [ordered])
    assert [(r.queue, r.messages) for r in retired] == [(plain.queue, len(keys))]
    assert depth(connection, plain.queue) is None, "the old queue is deleted"
    assert f"moved {len(keys)} message(s) out of leftover queue {plain.queue!r}" in caplog.text

    # New messages reach the partitions only.
    ids += publish_keys(rm_settings["EXCHANGE"], ["late"])
    partitions = consumer_queues(ordered)
    moved = drain(connection, partitions)
    assert sorted(d.message_id or "" for d in moved) == sorted(ids)
    # Each message sits in the partition its key hashes to, so the key stays on one partition.
    by_key: dict[str, set[str]] = {}
    for delivery in moved:
        message = decoded(delivery)
        by_key.setdefault(message.ordering_key or "", set()).add(delivery.queue)
        assert message.routing_key == f"acct.{message.payload['key']}"
        assert message.attempt == 2 and message.headers["tenant"] == "t1"
    assert all(len(queues) == 1 for queues in by_key.values())
    assert len({q for queues in by_key.values() for q in queues}) > 1, "keys spread out"
    assert find_leftovers(connection, [ordered]) == []


def test_fewer_partitions_moves_the_extra_partitions_into_the_remaining_ones(
    connection: pika.BlockingConnection, ns: str, rm_settings: dict[str, Any]
) -> None:
    four = {**rm_settings, "ORDERED_PARTITIONS": 4}
    two = {**rm_settings, "ORDERED_PARTITIONS": 2}
    spec = spec_for(ns, ordered=True)
    keys = [f"k{i}" for i in range(40)]
    with override_settings(RELIABLE_MESSAGING=four):
        declare_topology(connection.channel(), [spec])
        ids = publish_keys(rm_settings["EXCHANGE"], keys)
        old = consumer_queues(spec)
    assert sum(depth(connection, q) or 0 for q in old[2:]) > 0, "some keys in p2 and p3"

    with override_settings(RELIABLE_MESSAGING=two):
        declare_topology(connection.channel(), [spec])
        retired = retire_leftovers(connection, [spec])
        assert [r.queue for r in retired] == old[2:]
        assert [depth(connection, q) for q in old[2:]] == [None, None]
        ids += publish_keys(rm_settings["EXCHANGE"], ["late1", "late2", "late3"])
        moved = drain(connection, consumer_queues(spec))
    assert sorted(d.message_id or "" for d in moved) == sorted(ids)
    assert {d.queue for d in moved} <= set(old[:2])


def test_turning_ordered_off_moves_the_partitions_into_the_queue(
    connection: pika.BlockingConnection, ns: str, rm_settings: dict[str, Any]
) -> None:
    ordered = spec_for(ns, ordered=True)
    declare_topology(connection.channel(), [ordered])
    keys = [f"k{i}" for i in range(10)]
    ids = publish_keys(rm_settings["EXCHANGE"], keys)

    plain = dataclasses.replace(ordered, ordered=False)
    declare_topology(connection.channel(), [plain])
    retired = retire_leftovers(connection, [plain])
    assert [r.queue for r in retired] == consumer_queues(ordered)
    assert not exchange_exists(connection, partition_exchange(ordered))
    assert all(depth(connection, q) is None for q in consumer_queues(ordered))

    ids += publish_keys(rm_settings["EXCHANGE"], ["late"])
    moved = drain(connection, [plain.queue])
    assert sorted(d.message_id or "" for d in moved) == sorted(ids)
    for delivery in moved:
        message = decoded(delivery)
        # Moved copies come through the default exchange; the binding check sees the original
        # routing key, so none becomes an unexpected_routing_key dead letter.
        assert any(topic_matches(b, message.routing_key) for b in plain.bindings)
        assert message.exchange == rm_settings["EXCHANGE"]
        if delivery.message_id != ids[-1]:
            assert delivery.exchange == ""
            assert delivery.headers[ORIGINAL_ROUTING_KEY_HEADER] == message.routing_key
            assert delivery.headers[ORIGINAL_EXCHANGE_HEADER] == rm_settings["EXCHANGE"]


def test_a_leftover_still_consumed_elsewhere_is_emptied_but_kept(
    connection: pika.BlockingConnection,
    ns: str,
    rm_settings: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """During a rolling deploy an older process may still consume the old queue: its messages
    are moved, the queue stays for that process, and a later start deletes it."""
    plain = spec_for(ns, ordered=False)
    declare_topology(connection.channel(), [plain])
    ids = publish_keys(rm_settings["EXCHANGE"], ["a", "b", "c"])
    old_version = broker_connection(name="rm-tests older version")
    try:
        old_channel = old_version.channel()
        old_channel.basic_qos(prefetch_count=1)
        old_channel.basic_consume(plain.queue, lambda *args: None)  # holds one, never acks
        old_version.process_data_events(time_limit=0.5)

        ordered = dataclasses.replace(plain, ordered=True)
        declare_topology(connection.channel(), [ordered])
        with caplog.at_level(logging.WARNING, logger="reliable_messaging.broker.leftovers"):
            retire_leftovers(connection, [ordered])
        assert depth(connection, plain.queue) == 0
        assert "still has 1 consumer(s)" in caplog.text
    finally:
        old_version.close()  # its unacked message returns to the old queue
    assert depth(connection, plain.queue) == 1
    retire_leftovers(connection, [ordered])
    assert depth(connection, plain.queue) is None
    moved = drain(connection, consumer_queues(ordered))
    assert sorted(d.message_id or "" for d in moved) == sorted(ids)


def test_no_leftovers_costs_nothing_and_changes_nothing(
    connection: pika.BlockingConnection, ns: str, rm_settings: dict[str, Any]
) -> None:
    plain, ordered = (
        spec_for(ns, ordered=False),
        dataclasses.replace(
            spec_for(ns, ordered=True), name="tests.leftovers.other", queue=f"rmtest.{ns}.other"
        ),
    )
    declare_topology(connection.channel(), [plain, ordered])
    publish_keys(rm_settings["EXCHANGE"], ["a"])
    assert retire_leftovers(connection, [plain, ordered]) == []
    assert depth(connection, plain.queue) == 1
    assert sum(depth(connection, q) or 0 for q in consumer_queues(ordered)) == 1
    assert exchange_exists(connection, partition_exchange(ordered))


def test_a_queue_another_consumer_reads_now_is_never_a_leftover(
    connection: pika.BlockingConnection, ns: str, rm_settings: dict[str, Any]
) -> None:
    """``orders.p0`` looks like a partition of ``orders``, but here it is the queue of another
    registered consumer: its messages stay where they are."""
    orders = spec_for(ns, ordered=False)
    neighbour = ConsumerSpec(
        name="tests.leftovers.neighbour",
        queue=f"{orders.queue}.p0",
        handler=lambda m: None,
        bindings=("acct.*",),
    )
    declare_topology(connection.channel(), [orders, neighbour])
    publish_keys(rm_settings["EXCHANGE"], ["a", "b"])
    with registry.isolated():
        registry.register(orders)
        registry.register(neighbour)
        assert retire_leftovers(connection, [orders]) == []
    assert depth(connection, neighbour.queue) == 2
    assert depth(connection, orders.queue) == 2


def test_consume_retires_leftovers_when_it_connects(
    ns: str,
    rm_settings: dict[str, Any],
    connection: pika.BlockingConnection,
    transactional_db: None,
) -> None:
    """The consumer service calls the retirement itself, before consuming."""
    from reliable_messaging.consuming.service import ConsumerService

    plain = spec_for(ns, ordered=False)
    declare_topology(connection.channel(), [plain])
    publish_keys(rm_settings["EXCHANGE"], ["a", "b"])
    ordered = dataclasses.replace(plain, ordered=True)
    service = ConsumerService([ordered], concurrency=1, idle_timeout=1.0)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert depth(connection, plain.queue) is None
    assert sum(depth(connection, q) or 0 for q in consumer_queues(ordered)) == 0, "handled"
