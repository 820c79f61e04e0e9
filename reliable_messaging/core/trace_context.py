"""The W3C trace context in message headers, parsed without OpenTelemetry (for dead letters)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)

# version "-" trace-id "-" parent-id "-" flags; a future version may append fields after "-".
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def header_text(value: Any) -> str | None:
    """A header value as text: pika hands a long string that is not valid UTF-8 over as bytes."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def parse_traceparent(value: Any) -> tuple[str, str] | None:
    """``(trace_id, span_id)`` as lowercase hex from a ``traceparent`` value, or None when it is
    missing or malformed (all-zero ids and version ``ff`` are invalid, as the W3C says)."""
    text = header_text(value)
    if text is None:
        return None
    match = _TRACEPARENT.match(text.strip())
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return trace_id, span_id


def ids_in(headers: Mapping[str, Any]) -> tuple[str, str] | None:
    """The trace and span ids of ``headers``' ``traceparent``, if it holds a valid one."""
    return parse_traceparent(headers.get(TRACEPARENT))
