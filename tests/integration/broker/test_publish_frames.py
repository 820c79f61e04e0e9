"""The relay's publisher writes its own frames on pika's real connection, and the broker takes
them: confirms, delivery tags, ``mandatory`` returns and bodies split at a small frame size.

The byte-for-byte comparison with pika is tests/unit/broker/test_publish_frames.py; here the
encoder must engage on the pika this project installs (a pika upgrade that moves what it writes
through fails here, not silently slower) and every message must arrive as it was sent.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pika
import pytest
from django.test import override_settings

from reliable_messaging.broker.publisher import ChannelClosed, ConfirmingPublisher, Returned
from reliable_messaging.conf import MessagingSettings
from tests.support import broker_connection, broker_url

FRAME_MAX = 8192  # a body of 20,000 bytes goes in three body frames


class Events:
    """Publishes ``messages`` once the channel is ready; records confirms and returns."""

    def __init__(self, publisher: ConfirmingPublisher, messages: list[dict[str, Any]]) -> None:
        self.publisher = publisher
        self.messages = messages
        self.tags: list[int] = []
        self.acked: set[int] = set()
        self.nacked: set[int] = set()
        self.returned: list[Returned] = []
        self.closed: list[str] = []
        self.direct = False

    def on_ready(self) -> None:
        self.direct = self.publisher._frames is not None
        for message in self.messages:
            self.tags.append(self.publisher.publish(**message))
        self.publisher.flush()
        self.publisher.call_later(30, lambda: self.publisher.close("timed out"))

    def on_confirm(self, tag: int, multiple: bool, acked: bool) -> None:
        done = set(range(1, tag + 1)) if multiple else {tag}
        (self.acked if acked else self.nacked).update(done)
        if len(self.acked | self.nacked) >= len(self.messages):
            self.publisher.close()

    def on_returned(self, returned: Returned) -> None:
        self.returned.append(returned)

    def on_channel_closed(self, closed: ChannelClosed) -> None:
        if closed.by_broker:  # not the close that follows the connection's
            self.closed.append(str(closed))

    def on_connect_failed(self, error: str) -> None:
        self.closed.append(error)

    def on_connection_closed(self, reason: str) -> None:
        pass

    def on_blocked(self, reason: str) -> None:
        pass

    def on_unblocked(self) -> None:
        pass


@pytest.fixture
def queue() -> Any:
    name = f"rmtest.frames.{uuid.uuid4().hex[:12]}"
    connection = broker_connection()
    connection.channel().queue_declare(name, durable=True)
    try:
        yield name
    finally:
        connection.channel().queue_delete(name)
        connection.close()


def test_our_frames_reach_the_broker_confirmed_returned_and_whole(
    rm_settings: dict[str, Any], queue: str
) -> None:
    body = "".join(f"{i:05d}é" for i in range(3000)).encode()  # 18,000 bytes, multibyte
    sent_at = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    messages: list[dict[str, Any]] = [
        {
            "exchange": "",
            "routing_key": queue,
            "body": b'{"n": 1}',
            "message_id": "m-1",
            "timestamp": 1_764_460_000,
            "headers": {"x-rm-outbox-id": 1, "x-rm-published-at": 1_764_460_000_123},
        },
        {
            "exchange": "",
            "routing_key": queue,
            "body": body,
            "message_id": "m-2-ü",
            "timestamp": 1,
            "headers": {
                "x-rm-priority": 7,
                "s": "Grüße",
                "f": 2.5,
                "t": True,
                "none": None,
                "nested": {"list": [1, "two", 2**40]},
                "when": sent_at,
            },
        },
        {  # no queue is bound for it: mandatory makes the broker return it, then ack it
            "exchange": "",
            "routing_key": f"{queue}.nobody-😶",
            "body": b"{}",
            "message_id": "m-3",
            "timestamp": 2,
            "headers": {"x-rm-outbox-id": 3},
        },
        {
            "exchange": "",
            "routing_key": queue,
            "body": b"",
            "message_id": "m-4",
            "timestamp": 3,
            "headers": {},
        },
    ]
    url = f"{broker_url()}?frame_max={FRAME_MAX}"
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "BROKER_URL": url}):
        publisher = ConfirmingPublisher(MessagingSettings(), name="rmtest frames")
        events = Events(publisher, messages)
        publisher.run(events)

    assert events.direct, "the frame encoder did not engage on this pika"
    assert publisher.frame_max == FRAME_MAX
    assert events.closed == []
    assert events.tags == [1, 2, 3, 4]
    assert events.acked == {1, 2, 3, 4} and events.nacked == set()
    assert [(r.routing_key, r.headers, r.reply_code) for r in events.returned] == [
        (f"{queue}.nobody-😶", {"x-rm-outbox-id": 3}, 312)
    ]

    channel = broker_connection().channel()
    got = []
    for _ in range(3):
        method, properties, payload = channel.basic_get(queue, auto_ack=True)
        assert method is not None
        got.append((properties, payload))
    assert channel.basic_get(queue, auto_ack=True)[0] is None
    for (properties, payload), sent in zip(got, [messages[0], messages[1], messages[3]]):
        assert payload == sent["body"] and properties is not None
        assert properties.message_id == sent["message_id"]
        assert properties.timestamp == sent["timestamp"]
        assert properties.content_type == "application/json"
        assert properties.delivery_mode == pika.DeliveryMode.Persistent.value
        assert properties.headers == sent["headers"]
    assert got[1][0] is not None and got[0][0] is not None
    assert got[1][0].priority == 7 and got[0][0].priority is None
    channel.connection.close()
