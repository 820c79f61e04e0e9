"""write_coalescing on pika's real transport against the real broker: it engages on the pika
this project installs (a pika upgrade that moves the buffers fails here, not silently slower),
and every message of a coalesced burst arrives intact, in order, each confirmed."""

from __future__ import annotations

import uuid
from typing import Any

import pika
import pika.channel

from reliable_messaging.broker.write_coalescing import CHUNK_BYTES, coalesce_writes
from tests.support import broker_connection, broker_url


def bodies() -> list[bytes]:
    # Small messages, and two larger than a chunk among them (they stay buffers of their own).
    out = [f'{{"n": {i}, "pad": "{"x" * (i % 700)}"}}'.encode() for i in range(600)]
    out[100] = b"A" * (CHUNK_BYTES * 2 + 7)
    out[400] = b"B" * (CHUNK_BYTES + 1)
    return out


def publish_burst(queue: str, payloads: list[bytes]) -> dict[str, Any]:
    """Publish every payload in one go on a SelectConnection with confirms, coalesce what pika
    buffered, and wait for every confirm. Returns what coalesce_writes saw and the confirms."""
    seen: dict[str, Any] = {"buffers": 0, "acked": 0, "nacked": 0, "error": None}
    settled: set[int] = set()

    def on_open(connection: pika.SelectConnection) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel: pika.channel.Channel) -> None:
        def on_confirm(frame: Any) -> None:
            # Confirms may come out of order: RabbitMQ 4.0 acks the small messages after a
            # large one first, then the large one with a multiple ack.
            method = frame.method
            tag = method.delivery_tag
            fresh = set(range(1, tag + 1) if method.multiple else (tag,)) - settled
            settled.update(fresh)
            seen["nacked" if isinstance(method, pika.spec.Basic.Nack) else "acked"] += len(fresh)
            if seen["acked"] + seen["nacked"] >= len(payloads):
                channel.connection.close()

        def publish_all(_frame: object) -> None:
            for n, body in enumerate(payloads):
                channel.basic_publish(
                    "",
                    queue,
                    body,
                    pika.BasicProperties(message_id=str(n), headers={"n": n}, delivery_mode=2),
                    mandatory=True,
                )
            seen["buffers"] = coalesce_writes(channel.connection)

        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=publish_all)

    def on_closed(connection: pika.SelectConnection, reason: BaseException) -> None:
        if seen["acked"] + seen["nacked"] < len(payloads):
            seen["error"] = reason
        connection.ioloop.stop()

    params = pika.URLParameters(broker_url())
    connection = pika.SelectConnection(
        params, on_open_callback=on_open, on_close_callback=on_closed
    )
    timer = connection.ioloop.call_later(60, lambda: connection.close())
    connection.ioloop.start()
    connection.ioloop.remove_timeout(timer)
    return seen


def test_a_coalesced_burst_arrives_whole_in_order_and_confirmed() -> None:
    queue = f"rmtest.coalesce.{uuid.uuid4().hex[:12]}"
    admin = broker_connection()
    channel = admin.channel()
    channel.queue_declare(queue, durable=True)
    try:
        payloads = bodies()
        seen = publish_burst(queue, payloads)
        assert seen["error"] is None, seen
        # Method, header and body frame of each message were separate buffers; they were joined.
        assert seen["buffers"] >= 3 * len(payloads), seen
        assert seen["acked"] == len(payloads) and seen["nacked"] == 0, seen

        received: list[tuple[str | None, Any, bytes | None]] = []
        for _ in range(len(payloads)):
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            assert method is not None and properties is not None, (
                f"only {len(received)} of {len(payloads)} arrived"
            )
            received.append((properties.message_id, (properties.headers or {})["n"], body))
        assert received == [(str(n), n, body) for n, body in enumerate(payloads)]
    finally:
        channel.queue_delete(queue)
        admin.close()
