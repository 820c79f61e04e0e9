"""Where pika's AMQP field-table codec is corrected, the one module that patches it
(``docs/design.md#where-pikas-codec-is-corrected``)."""

from __future__ import annotations

import datetime as dt
import struct
import threading
from collections.abc import Callable
from typing import Any

import pika.data
import pika.spec

from ..core.envelope import UNDECODABLE_HEADER, safe_text

# pika's own functions, to which ours hand every other case.
PIKA_DECODE_VALUE: Callable[[bytes, int], tuple[Any, int]] = pika.data.decode_value
PIKA_ENCODE_VALUE: Callable[[list[bytes], Any], int] = pika.data.encode_value
PIKA_DECODE_PROPERTIES: Callable[..., Any] = pika.spec.BasicProperties.decode

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_install_lock = threading.Lock()


def timestamp_value(raw: int) -> dt.datetime | int:
    """A UTC ``datetime`` from the signed seconds, else milliseconds, else the integer itself."""
    signed = raw - 2**64 if raw >= 2**63 else raw
    for unit in ("seconds", "milliseconds"):
        try:
            return _EPOCH + dt.timedelta(**{unit: signed})
        except OverflowError:
            continue
    return signed


def decode_field_value(encoded: bytes, offset: int) -> tuple[Any, int]:
    """pika's ``decode_value`` with doubles, floats and timestamps read as AMQP means them."""
    kind = encoded[offset : offset + 1]
    if kind == b"d":
        return struct.unpack_from(">d", encoded, offset + 1)[0], offset + 9
    if kind == b"f":
        return struct.unpack_from(">f", encoded, offset + 1)[0], offset + 5
    if kind == b"T":
        return timestamp_value(struct.unpack_from(">Q", encoded, offset + 1)[0]), offset + 9
    return PIKA_DECODE_VALUE(encoded, offset)


def encode_field_value(pieces: list[bytes], value: Any) -> int:
    """pika's ``encode_value`` that also writes floats (as doubles) and dates before 1970."""
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    if isinstance(value, dt.datetime):
        moment = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
        seconds = (moment - _EPOCH) // dt.timedelta(seconds=1)
        pieces.append(struct.pack(">cq", b"T", seconds))
        return 9
    return PIKA_ENCODE_VALUE(pieces, value)


# BasicProperties in wire order: the attribute and how it is written (else a struct format).
_PROPERTY_LAYOUT = (
    ("content_type", "shortstr"),
    ("content_encoding", "shortstr"),
    ("headers", "table"),
    ("delivery_mode", "B"),
    ("priority", "B"),
    ("correlation_id", "shortstr"),
    ("reply_to", "shortstr"),
    ("expiration", "shortstr"),
    ("message_id", "shortstr"),
    ("timestamp", ">Q"),
    ("type", "shortstr"),
    ("user_id", "shortstr"),
    ("app_id", "shortstr"),
    ("cluster_id", "shortstr"),
)


def _describe(exc: BaseException) -> str:
    return safe_text(f"{type(exc).__name__}: {exc}")[:300]


def _decode_headers_tolerantly(encoded: bytes, offset: int) -> tuple[dict[Any, Any], int]:
    """The header table from ``offset``, read until an entry fails; its length prefix says
    where the next property starts."""
    size = struct.unpack_from(">I", encoded, offset)[0]
    start = offset + 4
    end = start + size
    headers: dict[Any, Any] = {}
    position = start
    key: Any = None
    try:
        while position < end:
            key, position = pika.data.decode_short_string(encoded, position)
            value, position = pika.data.decode_value(encoded, position)
            headers[key] = value
            key = None
    except Exception as exc:  # noqa: BLE001 - RecursionError, unknown field types, truncation
        where = "" if key is None else f" (header {safe_text(key)!r})"
        headers[UNDECODABLE_HEADER] = f"the headers could not be decoded{where}: {_describe(exc)}"
    if end > len(encoded):
        raise struct.error(f"the header table claims {size} bytes; the frame is shorter")
    return headers, end


def decode_properties_tolerantly(
    properties: pika.spec.BasicProperties, encoded: bytes, offset: int, failure: BaseException
) -> pika.spec.BasicProperties:
    """Fill ``properties`` with what can be read of ``encoded`` after pika's decoding failed;
    the headers then carry ``UNDECODABLE_HEADER``."""
    for name, _ in _PROPERTY_LAYOUT:
        setattr(properties, name, None)
    problem = f"the properties could not be decoded: {_describe(failure)}"
    try:
        # Every flag of BasicProperties is in the first word; more follow while a word's
        # lowest bit is set.
        flags = word = struct.unpack_from(">H", encoded, offset)[0]
        offset += 2
        while word & 1:
            word = struct.unpack_from(">H", encoded, offset)[0]
            offset += 2
        for name, kind in _PROPERTY_LAYOUT:
            if not flags & getattr(pika.spec.BasicProperties, f"FLAG_{name.upper()}"):
                continue
            value: Any
            if kind == "shortstr":
                value, offset = pika.data.decode_short_string(encoded, offset)
            elif kind == "table":
                value, offset = _decode_headers_tolerantly(encoded, offset)
                problem = value.pop(UNDECODABLE_HEADER, problem)
            else:
                value = struct.unpack_from(kind, encoded, offset)[0]
                offset += struct.calcsize(kind)
            setattr(properties, name, value)
    except Exception as exc:  # noqa: BLE001 - a truncated frame: keep what was read
        problem = f"{problem}; reading stopped at byte {offset}: {_describe(exc)}"
    properties.headers = {**(properties.headers or {}), UNDECODABLE_HEADER: problem}
    return properties


def decode_properties_guarded(
    properties: pika.spec.BasicProperties, encoded: bytes, offset: int = 0
) -> pika.spec.BasicProperties:
    """``BasicProperties.decode`` that never raises."""
    try:
        return PIKA_DECODE_PROPERTIES(properties, encoded, offset)
    except Exception as exc:  # noqa: BLE001 - any failure here would drop the connection
        return decode_properties_tolerantly(properties, encoded, offset, exc)


def installed() -> bool:
    return (
        pika.data.decode_value is decode_field_value
        and pika.data.encode_value is encode_field_value
        and pika.spec.BasicProperties.decode is decode_properties_guarded
    )


def install() -> None:
    """Patch pika's table codec and properties decoding, once. pika's table functions look
    ``decode_value``/``encode_value`` up in their module on every call (nested ones too)."""
    with _install_lock:
        if installed():
            return
        pika.data.decode_value = decode_field_value
        pika.data.encode_value = encode_field_value
        pika.spec.BasicProperties.decode = decode_properties_guarded  # type: ignore[method-assign,assignment]
