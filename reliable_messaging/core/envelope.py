"""The wire format: JSON bodies with AMQP properties, and the decoding of a :class:`Delivery`
into a :class:`Message` or a :class:`DecodeError` that says why it cannot be handled."""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import math
import reprlib
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .outcomes import FailureReason

CONTENT_TYPE = "application/json"

# Our own headers (what each holds: HEADER_SCHEMAS in contracts/asyncapi.py). They travel with
# retried and replayed copies; user headers are left alone.
HEADER_PREFIX = "x-rm-"
ATTEMPT_HEADER = "x-rm-attempt"
ORIGINAL_EXCHANGE_HEADER = "x-rm-exchange"
ORIGINAL_ROUTING_KEY_HEADER = "x-rm-routing-key"
ORDERING_KEY_HEADER = "x-rm-ordering-key"
FIRST_FAILED_AT_HEADER = "x-rm-first-failed-at"
LAST_ERROR_HEADER = "x-rm-last-error"
PUBLISHED_AT_HEADER = "x-rm-published-at"
# The outbox row a message was sent from, so that a message the broker returns finds its row.
OUTBOX_ID_HEADER = "x-rm-outbox-id"
EXPIRES_AT_HEADER = "x-rm-expires-at"
REPLAY_HEADER = "x-rm-replay"
REPLAYED_BY_HEADER = "x-rm-replayed-by"
DEAD_LETTER_ID_HEADER = "x-rm-dead-letter-id"
REPLAY_ID_HEADER = "x-rm-replay-id"
DEFERRALS_HEADER = "x-rm-deferrals"
PRIORITY_HEADER = "x-rm-priority"
# On the dead letter of a Celery task whose pool child kept dying: not replayable.
CELERY_TASK_HEADER = "celery-task"
# Set by broker/codec.py when part of a delivery's properties could not be decoded (what failed).
UNDECODABLE_HEADER = "x-rm-undecodable"
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
# RabbitMQ's sender-selected distribution (case-sensitive, as the broker compares them): the
# broker routes to every entry too, also when dead-lettering. A copy we publish again drops them,
# so it reaches the queue we address and no other.
SENDER_ROUTING_HEADERS = frozenset({"CC", "BCC"})

MAX_MESSAGE_ID_LENGTH = 255
MAX_SHORT_STRING_BYTES = 255
# Nesting kept when headers or payloads are stored or published again: encoders recurse.
MAX_STORED_NESTING = 200
MAX_WIRE_NESTING = 64
# Compared, never tested with ``in range(...)``: for pika's int subclass that scans every number.
_INT64_MIN, _INT64_END = -(2**63), 2**63
_INT32_MIN, _INT32_END = -(2**31), 2**31


def check_header_value(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is one AMQP tables hold as pika encodes them."""
    if value is None or isinstance(value, str | bool):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value < _INT64_END:
            raise TypeError(f"header {name!r} is out of the 64-bit integer range")
    elif isinstance(value, list | tuple):
        for item in value:
            check_header_value(name, item)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"header {name!r} has a non-string key {key!r}")
            check_header_value(f"{name}.{key}", item)
    else:
        raise TypeError(
            f"header {name!r} has a value of type {type(value).__name__}; AMQP headers hold "
            f"str, int, bool, None, and lists or dicts of these (send a float as a string)"
        )


def check_short_string(what: str, value: str) -> None:
    """Raise ``ValueError`` when ``value`` is longer than an AMQP short string (255 bytes)."""
    if len(value.encode("utf-8", errors="surrogatepass")) > MAX_SHORT_STRING_BYTES:
        raise ValueError(f"{what} {value[:40]!r}... is longer than AMQP's 255 bytes")


def checked_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """``headers`` as a dict, after checking that each name and value can travel in AMQP."""
    if not headers:
        return {}
    if not isinstance(headers, Mapping):
        raise TypeError("headers must be a mapping with string keys")
    for name, value in headers.items():
        if not isinstance(name, str):
            raise TypeError(f"header names must be strings, got {name!r}")
        check_short_string("header name", name)
        check_header_value(name, value)
    return dict(headers)


class MessageJSONEncoder(json.JSONEncoder):
    """JSON with Decimal and UUID as strings, dates and times as ISO 8601, sets as lists."""

    def default(self, o: Any) -> Any:
        if isinstance(o, decimal.Decimal | uuid.UUID):
            return str(o)
        if isinstance(o, dt.datetime | dt.date | dt.time):
            return o.isoformat()
        if isinstance(o, dt.timedelta):
            return o.total_seconds()

        if isinstance(o, set | frozenset):
            return sorted(o, key=repr)
        return super().default(o)


# One encoder for every body: json.dumps(cls=...) would build one per call. It keeps no state
# between calls (each encode() has its own), so threads share it.
_ENCODER = MessageJSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_payload(payload: Any) -> bytes:
    """Encode ``payload`` as the UTF-8 JSON body; a value JSON cannot hold raises ``TypeError``."""
    try:
        text = _ENCODER.encode(payload)
    except (ValueError, TypeError) as exc:  # NaN / Infinity, circular references, a type
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
    """What a consumer received, as plain values. ``defects`` lists what could not be taken
    over faithfully (a routing key that is not UTF-8, ...): such a delivery is refused."""

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
    defects: tuple[str, ...] = ()
    # The broker's properties object as received (pika's BasicProperties): a retry copy
    # goes out with them (reliable_messaging.consuming.retry_rows).
    properties: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DecodeError:
    """Why a delivery cannot be handled; ``message_id`` is whatever could be read."""

    reason: str
    detail: str
    message_id: str


def safe_text(value: Any) -> str:
    """Text PostgreSQL can store: bytes decoded with escapes, NUL and lone surrogates escaped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="backslashreplace")
    text = str(value).replace("\x00", "\\x00")
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def escaped_text(raw: bytes) -> str:
    r"""``raw`` (bytes that are not UTF-8) as text, one to one (backslashes doubled, other
    bytes as ``\xNN``), so that, unlike :func:`safe_text`, the result can serve as a key."""
    text = raw.replace(b"\\", b"\\\\").decode("utf-8", errors="backslashreplace")
    return text.replace("\x00", "\\x00")


def fit_utf8(text: str, limit: int = MAX_SHORT_STRING_BYTES) -> str:
    """``text`` if it fits in ``limit`` UTF-8 bytes; otherwise its beginning plus a hash of the
    whole, so that two long texts that only differ at the end stay apart."""
    encoded = text.encode("utf-8", errors="surrogatepass")
    if len(encoded) <= limit:
        return text
    suffix = "~" + hashlib.sha256(encoded).hexdigest()[:16]
    head = encoded[: limit - len(suffix)].decode("utf-8", errors="ignore")  # whole characters
    return head + suffix


def _frame_text(value: Any, what: str, defects: list[str]) -> str:
    """A short string off a frame as text; pika leaves one that is not UTF-8 as bytes."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            text = escaped_text(value)
            defects.append(f"{what} is not UTF-8 (received as {text!r}, escaped)")
            return text
    defects.append(f"{what} is a {type(value).__name__}, not text")
    return safe_text(value)


def _header_name(name: Any) -> str:
    return str(_text(name)) if isinstance(name, str | bytes) else safe_text(name)


def normalize_headers(headers: Mapping[Any, Any] | None) -> dict[str, Any]:
    """Header names as text: pika hands a name that is not UTF-8 over as bytes (escaped here)."""
    if not headers:
        return {}
    if all(type(name) is str for name in headers):
        return dict(headers)
    return {_header_name(k): v for k, v in headers.items()}


def delivery_from_frame(queue: str, method: Any, properties: Any, body: bytes) -> Delivery:
    """A :class:`Delivery` from what pika handed the consumer. Never raises: a field that is
    not what AMQP says becomes escaped text and a defect, so the delivery is refused."""
    defects: list[str] = []

    def optional(value: Any, what: str) -> str | None:
        return None if value is None else _frame_text(value, what, defects)

    try:
        message_id, content_type = properties.message_id, properties.content_type
        return Delivery(
            body=bytes(body),
            queue=queue,
            exchange=_frame_text(method.exchange or "", "exchange", defects),
            routing_key=_frame_text(method.routing_key or "", "routing key", defects),
            delivery_tag=method.delivery_tag or 0,
            redelivered=bool(method.redelivered),
            message_id=optional(message_id, "message_id"),
            content_type=optional(content_type, "content type"),
            timestamp=_signed_timestamp(properties.timestamp),
            headers=normalize_headers(properties.headers),
            defects=tuple(defects),
            properties=properties,
        )
    except Exception as exc:  # noqa: BLE001 - a delivery that cannot be read is refused, not fatal
        return Delivery(
            body=body if isinstance(body, bytes) else b"",
            queue=queue,
            exchange="",
            routing_key="",
            delivery_tag=_delivery_tag(method),
            defects=(*defects, f"the delivery could not be read: {type(exc).__name__}: {exc}"),
        )


def _delivery_tag(method: Any) -> int:
    try:
        return int(method.delivery_tag or 0)
    except Exception:  # noqa: BLE001 - without a tag the delivery cannot be acked anyway
        return 0


def _signed_timestamp(raw: Any) -> int | None:
    """The timestamp property as a signed number: Java clients write a date before 1970 as a
    negative 64-bit value, which pika reads unsigned."""
    if not isinstance(raw, int) or isinstance(raw, bool):
        return None
    return raw - 2**64 if raw >= 2**63 else raw


def wire_headers(headers: Mapping[Any, Any]) -> dict[str, Any]:
    """``headers`` as a copy the broker accepts when we publish it again, without
    :data:`SENDER_ROUTING_HEADERS`: names fit a short string, and values pika cannot write
    (with :mod:`reliable_messaging.broker.codec`) become text or lists."""
    named = ((_wire_name(k), v) for k, v in headers.items())
    return {k: _wire_value(v, 1) for k, v in named if k not in SENDER_ROUTING_HEADERS}


def _wire_name(name: Any) -> str:
    return fit_utf8(safe_text(_header_name(name)))


def _wire_decimal(value: decimal.Decimal) -> decimal.Decimal | str:
    # AMQP's decimal: an unsigned octet of decimal places and a signed 32-bit integer. The size
    # is checked before any integer is made: 1E+999999999 must not become a billion digits.
    if not value.is_finite() or not -256 < value.adjusted() < 10:
        return str(value)
    try:
        normalized = value.normalize()  # as pika does before writing it
        places = max(0, -int(normalized.as_tuple().exponent))
        fits = places <= 255 and _INT32_MIN <= int(normalized.scaleb(places)) < _INT32_END
    except decimal.DecimalException:
        fits = False
    return value if fits else str(value)


def _wire_value(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool | float | bytes | dt.datetime):
        return value
    if isinstance(value, str):
        if _is_utf8(value):
            return value
        # A lone surrogate: pika could not write it.
        return value.encode("utf-8", errors="backslashreplace").decode("utf-8")
    if isinstance(value, int):
        return value if _INT64_MIN <= value < _INT64_END else str(value)
    if isinstance(value, decimal.Decimal):
        return _wire_decimal(value)
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, Mapping | list | tuple) and depth > MAX_WIRE_NESTING:
        return f"(nested deeper than {MAX_WIRE_NESTING} levels: left out)"
    if isinstance(value, Mapping):
        return {_wire_name(k): _wire_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_wire_value(v, depth + 1) for v in value]
    return safe_text(bounded_repr(value))


_repr = reprlib.Repr()
_repr.maxlevel = 4
_repr.maxstring = _repr.maxother = 200


def bounded_repr(value: Any) -> str:
    """A bounded repr: never recursing deeper than a few levels, whatever ``value`` holds."""
    return _repr.repr(value)


def _jsonable_scalar(value: Any) -> Any:
    if isinstance(value, bytes | str):
        return safe_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # jsonb has no NaN or Infinity
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return bounded_repr(value)


def jsonable(value: Any, max_depth: int | None = None) -> Any:
    """AMQP header values as JSON-safe values that PostgreSQL's jsonb accepts; iterative, and
    with ``max_depth`` a table or list nested deeper becomes a note saying so."""
    result: list[Any] = [None]
    on_path: set[int] = set()  # containers being converted: a cycle is noted, not followed
    # (value, where the result goes, its key there, depth) or a container's id to leave
    stack: list[tuple[Any, Any, Any, int] | int] = [(value, result, 0, 1)]
    while stack:
        item = stack.pop()
        if isinstance(item, int):
            on_path.discard(item)
            continue
        current, target, slot, depth = item
        if not isinstance(current, Mapping | list | tuple):
            target[slot] = _jsonable_scalar(current)
            continue
        if max_depth is not None and depth > max_depth:
            target[slot] = f"(nested deeper than {max_depth} levels: see the raw body)"
            continue
        if id(current) in on_path:
            target[slot] = "(a reference to itself)"
            continue
        on_path.add(id(current))
        stack.append(id(current))
        children: list[tuple[Any, Any, Any, int]] = []
        converted: dict[str, Any] | list[Any]
        if isinstance(current, Mapping):
            converted = {}
            for key, child in current.items():
                name = safe_text(key)
                converted[name] = None
                children.append((child, converted, name, depth + 1))
        else:
            converted = [None] * len(current)
            children = [(child, converted, i, depth + 1) for i, child in enumerate(current)]
        target[slot] = converted
        stack.extend(reversed(children))
    return result[0]


def _walk(value: Any) -> Iterator[tuple[Any, int]]:
    """``value`` and everything nested in it (mapping keys too), each with its depth; iterative."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        current, depth = stack.pop()
        yield current, depth
        if isinstance(current, Mapping):
            stack.extend((child, depth + 1) for child in (*current.keys(), *current.values()))
        elif isinstance(current, list | tuple):
            stack.extend((child, depth + 1) for child in current)


def nesting_depth(value: Any) -> int:
    """How deep lists and mappings nest in ``value`` (0 for a scalar); iterative."""
    deepest = 0
    for node, depth in _walk(value):
        deepest = max(deepest, depth + 1 if isinstance(node, Mapping | list | tuple) else depth)
        if deepest > 100_000:  # a structure holding itself: deep enough to say so
            break
    return deepest


def _is_utf8(text: str) -> bool:
    """Whether UTF-8 can encode ``text``: it holds no lone surrogate (such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def derived_message_id(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return escaped_text(value)
    return str(value)


def _message_id(value: Any) -> tuple[str, str | None]:
    """The message_id as the inbox's key, and why it cannot be one (or None): an id that is not
    UTF-8 is refused, since two different ids must never share an inbox key."""
    if value is None:
        return "", None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return fit_utf8(escaped_text(value)), "message_id is not UTF-8"
    text = str(value)
    if not _is_utf8(text):
        return fit_utf8(safe_text(text)), "message_id holds a lone surrogate, which is not text"
    return text, None


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


def sent_to_its_queue(delivery: Delivery) -> bool:
    """Whether ``delivery`` came the way our own copies come: through the default exchange to
    its queue. Only then do our origin headers stand for where it was first published."""
    return delivery.exchange == "" and delivery.routing_key == delivery.queue


def decode_delivery(
    delivery: Delivery, *, max_body_bytes: int, derive_message_id: bool = False
) -> Message | DecodeError:
    """Turn a delivery into a :class:`Message`, or say precisely why it cannot be one."""
    message_id, message_id_defect = _message_id(delivery.message_id)
    if not message_id and derive_message_id:
        message_id = derived_message_id(delivery.body)

    def error(reason: str, detail: str) -> DecodeError:
        return DecodeError(reason=reason, detail=detail, message_id=message_id)

    if len(delivery.body) > max_body_bytes:
        return error(
            FailureReason.BODY_TOO_LARGE,
            f"body is {len(delivery.body)} bytes, the limit (MAX_BODY_BYTES) is {max_body_bytes}",
        )
    defects = list(delivery.defects)
    if message_id_defect:
        defects.append(message_id_defect)
    undecodable = delivery.headers.get(UNDECODABLE_HEADER)
    if undecodable is not None:
        defects.insert(
            0,
            f"the message's properties could not be decoded ({safe_text(undecodable)}); "
            "the headers hold what could be read",
        )
    if defects:
        return DecodeError(
            reason=FailureReason.INVALID_HEADERS,
            detail="; ".join(defects),
            message_id=fit_utf8(message_id),  # an escaped id may be longer than the column
        )
    if not message_id:
        return error(
            FailureReason.MISSING_MESSAGE_ID,
            "the message has no message_id property, so duplicates cannot be "
            "recognised; publish with a message_id (or set DERIVE_MESSAGE_ID)",
        )
    if "\x00" in message_id:
        return error(FailureReason.INVALID_HEADERS, "message_id contains a NUL character")
    if len(message_id) > MAX_MESSAGE_ID_LENGTH:
        return error(
            FailureReason.INVALID_HEADERS,
            f"message_id is {len(message_id)} characters long, the limit is "
            f"{MAX_MESSAGE_ID_LENGTH}",
        )
    content_type = (_text(delivery.content_type) or "").split(";")[0].strip().lower()
    if content_type and content_type != CONTENT_TYPE and not content_type.endswith("+json"):
        return error(
            FailureReason.UNSUPPORTED_CONTENT_TYPE,
            f"content type {content_type!r} is not JSON; only {CONTENT_TYPE} is accepted",
        )
    if not delivery.body:
        return error(FailureReason.EMPTY_BODY, "the body is empty; a JSON document was expected")
    try:
        text = delivery.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return error(FailureReason.INVALID_UTF8, f"the body is not valid UTF-8: {exc}")
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        return error(FailureReason.INVALID_JSON, f"the body is not valid JSON: {exc}")
    except RecursionError:
        return error(
            FailureReason.INVALID_JSON,
            "the body is JSON nested too deeply to decode (arrays or objects thousands of "
            "levels deep)",
        )
    except ValueError as exc:  # an integer literal beyond Python's 4300-digit limit
        return error(
            FailureReason.INVALID_JSON,
            f"the body is JSON with a number too long to decode: {str(exc)[:200]}",
        )
    if "\\u" in text and any(isinstance(n, str) and not _is_utf8(n) for n, _ in _walk(payload)):
        return error(
            FailureReason.INVALID_JSON,
            "the body escapes a lone UTF-16 surrogate (such as \\ud800), which is "
            "not a character: no database or UTF-8 text can hold it",
        )
    try:
        attempt = parse_attempt(delivery.headers)
    except ValueError as exc:
        return error(FailureReason.INVALID_HEADERS, str(exc))
    headers = delivery.headers
    origin = headers if sent_to_its_queue(delivery) else {}
    return Message(
        message_id=message_id,
        routing_key=_text(origin.get(ORIGINAL_ROUTING_KEY_HEADER)) or delivery.routing_key,
        exchange=_text(origin.get(ORIGINAL_EXCHANGE_HEADER)) or delivery.exchange,
        payload=payload,
        headers=MappingProxyType(user_headers(headers)),
        attempt=attempt,
        redelivered=delivery.redelivered,
        published_at=_published_at(delivery),
        ordering_key=_text(headers.get(ORDERING_KEY_HEADER)),
    )
