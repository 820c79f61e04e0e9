"""A retry copy's AMQP properties as the outbox keeps them: encoded by pika's own codec, so
that a header's type survives (``docs/design.md#where-a-retry-waits``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pika
from pika.spec import BasicProperties

from ..core.envelope import CONTENT_TYPE, wire_headers

# What is taken over from the original, besides its headers. ``user_id`` is not: the broker
# closes the channel of a publish whose user_id is not the publishing connection's user.
_KEPT = (
    "content_type",
    "content_encoding",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "app_id",
)


def retry_properties(original: Any, headers: Mapping[str, Any]) -> bytes:
    """The encoded properties of a retry copy of a delivery that came with ``original`` (pika's
    ``BasicProperties`` or alike): the original's, persistent, with ``headers`` as pika writes."""
    kept = {name: getattr(original, name, None) for name in _KEPT}
    kept["content_type"] = kept["content_type"] or CONTENT_TYPE
    properties = BasicProperties(
        **kept, delivery_mode=pika.DeliveryMode.Persistent, headers=wire_headers(headers)
    )
    return b"".join(properties.encode())


def decoded_properties(encoded: bytes | memoryview) -> BasicProperties:
    """The properties :func:`retry_properties` encoded."""
    return BasicProperties().decode(bytes(encoded))


def shown_properties(encoded: bytes | memoryview) -> dict[str, Any]:
    """The stored properties as names and values, for a person to read (the admin)."""
    properties = decoded_properties(encoded)
    return {
        name: value
        for name in ("delivery_mode", *_KEPT, "headers")
        if (value := getattr(properties, name, None)) is not None
    }
