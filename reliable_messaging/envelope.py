"""The wire format: JSON bodies with AMQP properties, and the decoding of a delivery.

Pure logic: no Django, no pika objects. A delivery arrives here as a :class:`Delivery` (plain
values copied off pika's frames on the connection's thread) and leaves as a :class:`Message` or a
:class:`DecodeError` that says exactly why it cannot be handled.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

CONTENT_TYPE = "application/json"

# Our own headers. They travel with retried and replayed copies; user headers are left alone.
HEADER_PREFIX = "x-rm-"
ATTEMPT_HEADER = "x-rm-attempt"
ORIGINAL_EXCHANGE_HEADER = "x-rm-exchange"
ORIGINAL_ROUTING_KEY_HEADER = "x-rm-routing-key"
ORDERING_KEY_HEADER = "x-rm-ordering-key"
FIRST_FAILED_AT_HEADER = "x-rm-first-failed-at"
LAST_ERROR_HEADER = "x-rm-last-error"
PUBLISHED_AT_HEADER = "x-rm-published-at"
REPLAY_HEADER = "x-rm-replay"  # how many times the message was replayed
REPLAYED_BY_HEADER = "x-rm-replayed-by"
DEAD_LETTER_ID_HEADER = "x-rm-dead-letter-id"
# Headers RabbitMQ adds on dead-lettering; they grow with every retry, so copies drop them.
BROKER_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)


class MessageJSONEncoder(json.JSONEncoder):
    """JSON with the types business payloads carry: Decimal as a string (no float rounding of
    money), datetimes/dates/times as ISO 8601, UUIDs as strings, sets and tuples as lists."""

    def default(self, o: Any) -> Any:
        if isinstance(o, decimal.Decimal):
            return str(o)
        if isinstance(o, dt.datetime | dt.date | dt.time):
            return o.isoformat()
        if isinstance(o, dt.timedelta):
            return o.total_seconds()
        if isinstance(o, uuid.UUID):
            return str(o)
        if isinstance(o, set | frozenset):
            return sorted(o, key=repr)
        return super().default(o)


def encode_payload(payload: Any) -> bytes:
    """Encode ``payload`` as the UTF-8 JSON body; a value JSON cannot hold raises ``TypeError``."""
    try:
        text = json.dumps(
            payload,
            cls=MessageJSONEncoder,
            ensure_ascii=False,
            separators=(",", ":"),
            allow_nan=False,
        )
    except ValueError as exc:  # NaN / Infinity, circular references
        raise TypeError(f"payload cannot be encoded as JSON: {exc}") from exc
    except TypeError as exc:
        raise TypeError(f"payload cannot be encoded as JSON: {exc}") from exc
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate such as "\ud800"
        raise TypeError(f"payload cannot be encoded as UTF-8 JSON: {exc}") from exc


@dataclass(frozen=True)
class Message:
    """One message as a handler sees it. ``attempt`` is 1 on the first delivery."""

    message_id: str
    routing_key: str
    exchange: str
    payload: Any
    headers: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    attempt: int = 1
    redelivered: bool = False
    published_at: dt.datetime | None = None
    ordering_key: str | None = None


@dataclass(frozen=True)
class Delivery:
    """What a consumer received, as plain values (safe to hand to another thread)."""

    body: bytes
    queue: str
    exchange: str
    routing_key: str
    delivery_tag: int = 0
    redelivered: bool = False
    message_id: str | None = None
    content_type: str | None = None
    timestamp: int | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)


class DecodeReason:
    INVALID_JSON = "invalid_json"
    INVALID_UTF8 = "invalid_utf8"
    EMPTY_BODY = "empty_body"
    MISSING_MESSAGE_ID = "missing_message_id"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
    INVALID_HEADERS = "invalid_headers"


@dataclass(frozen=True)
class DecodeError:
    """Why a delivery cannot be handled; ``message_id`` is whatever could be read."""

    reason: str
    detail: str
    message_id: str


MAX_MESSAGE_ID_LENGTH = 255


def safe_text(value: Any) -> str:
    """Text PostgreSQL can store: bytes decoded with escapes, NUL and lone surrogates escaped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="backslashreplace")
    text = str(value).replace("\x00", "\\x00")
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def normalize_headers(headers: Mapping[Any, Any] | None) -> dict[str, Any]:
    """Header names as text: pika hands a name that is not UTF-8 over as bytes."""
    if not headers:
        return {}
    return {(k if isinstance(k, str) else safe_text(k)): v for k, v in headers.items()}


def delivery_from_frame(queue: str, method: Any, properties: Any, body: bytes) -> Delivery:
    """A :class:`Delivery` from what pika handed the consumer (``Basic.Deliver``,
    ``BasicProperties``, body), as plain values. Never raises: whatever a foreign producer
    sent, the delivery can be decided (and if need be dead-lettered) rather than crash the
    connection's thread."""
    return Delivery(
        body=body,
        queue=queue,
        exchange=method.exchange or "",
        routing_key=method.routing_key or "",
        delivery_tag=method.delivery_tag or 0,
        redelivered=bool(method.redelivered),
        message_id=properties.message_id,
        content_type=properties.content_type,
        timestamp=properties.timestamp,
        headers=normalize_headers(properties.headers),
    )


def wire_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` as a copy the broker accepts when we publish it again (a retry copy)."""
    return dict(headers)


def jsonable(value: Any) -> Any:
    """AMQP header values (bytes, Decimal, datetime, nested tables) as JSON-safe values that
    PostgreSQL's jsonb accepts (no NUL, no lone surrogate)."""
    if isinstance(value, Mapping):
        return {safe_text(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes | str):
        return safe_text(value)
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return repr(value)


def derived_message_id(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def parse_attempt(headers: Mapping[str, Any]) -> int:
    """The 1-based attempt number from our header; raises ``ValueError`` when it is malformed."""
    raw = headers.get(ATTEMPT_HEADER)
    if raw is None:
        return 1
    if isinstance(raw, bool) or not isinstance(raw, int | str | bytes):
        raise ValueError(f"{ATTEMPT_HEADER} must be a positive integer, got {type(raw).__name__}")
    try:
        attempt = int(raw)
    except ValueError:
        raise ValueError(f"{ATTEMPT_HEADER} must be a positive integer, got {raw!r}") from None
    if attempt < 1:
        raise ValueError(f"{ATTEMPT_HEADER} must be a positive integer, got {attempt}")
    return attempt


def _published_at(delivery: Delivery) -> dt.datetime | None:
    raw = delivery.headers.get(PUBLISHED_AT_HEADER)
    try:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return dt.datetime.fromtimestamp(raw / 1000, tz=dt.UTC)
        if delivery.timestamp is not None:
            return dt.datetime.fromtimestamp(int(delivery.timestamp), tz=dt.UTC)
    except (OverflowError, OSError, ValueError):
        return None
    return None


def user_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """Headers without ours and without the broker's dead-letter bookkeeping."""
    return {
        k: v
        for k, v in normalize_headers(headers).items()
        if not k.startswith(HEADER_PREFIX) and k not in BROKER_HEADERS
    }


def _has_lone_surrogate(payload: Any) -> bool:
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_delivery(
    delivery: Delivery, *, max_body_bytes: int, derive_message_id: bool = False
) -> Message | DecodeError:
    """Turn a delivery into a :class:`Message`, or say precisely why it cannot be one."""
    message_id = _text(delivery.message_id) or ""
    if not message_id and derive_message_id:
        message_id = derived_message_id(delivery.body)

    def error(reason: str, detail: str) -> DecodeError:
        return DecodeError(reason=reason, detail=detail, message_id=message_id)

    if len(delivery.body) > max_body_bytes:
        return error(
            DecodeReason.BODY_TOO_LARGE,
            f"body is {len(delivery.body)} bytes, the limit (MAX_BODY_BYTES) is {max_body_bytes}",
        )
    if not message_id:
        return error(
            DecodeReason.MISSING_MESSAGE_ID,
            "the message has no message_id property, so duplicates cannot be "
            "recognised; publish with a message_id (or set DERIVE_MESSAGE_ID)",
        )
    if "\x00" in message_id:
        return error(DecodeReason.INVALID_HEADERS, "message_id contains a NUL character")
    if len(message_id) > MAX_MESSAGE_ID_LENGTH:
        return error(
            DecodeReason.INVALID_HEADERS,
            f"message_id is {len(message_id)} characters long, the limit is "
            f"{MAX_MESSAGE_ID_LENGTH}",
        )
    content_type = (_text(delivery.content_type) or "").split(";")[0].strip().lower()
    if content_type and content_type != CONTENT_TYPE and not content_type.endswith("+json"):
        return error(
            DecodeReason.UNSUPPORTED_CONTENT_TYPE,
            f"content type {content_type!r} is not JSON; only {CONTENT_TYPE} is accepted",
        )
    if not delivery.body:
        return error(DecodeReason.EMPTY_BODY, "the body is empty; a JSON document was expected")
    try:
        text = delivery.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return error(DecodeReason.INVALID_UTF8, f"the body is not valid UTF-8: {exc}")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        return error(DecodeReason.INVALID_JSON, f"the body is not valid JSON: {exc}")
    if "\\u" in text and _has_lone_surrogate(payload):
        return error(
            DecodeReason.INVALID_JSON,
            "the body escapes a lone UTF-16 surrogate (such as \\ud800), which is "
            "not a character: no database or UTF-8 text can hold it",
        )
    try:
        attempt = parse_attempt(delivery.headers)
    except ValueError as exc:
        return error(DecodeReason.INVALID_HEADERS, str(exc))
    headers = delivery.headers
    return Message(
        message_id=message_id,
        routing_key=_text(headers.get(ORIGINAL_ROUTING_KEY_HEADER)) or delivery.routing_key,
        exchange=_text(headers.get(ORIGINAL_EXCHANGE_HEADER)) or delivery.exchange,
        payload=payload,
        headers=MappingProxyType(user_headers(headers)),
        attempt=attempt,
        redelivered=delivery.redelivered,
        published_at=_published_at(delivery),
        ordering_key=_text(headers.get(ORDERING_KEY_HEADER)),
    )
