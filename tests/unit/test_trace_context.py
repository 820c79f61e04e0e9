"""The W3C ``traceparent`` as it rides in message headers
(:mod:`reliable_messaging.core.trace_context`), and the ids a dead letter keeps from it when no
span was made (:func:`reliable_messaging.tracing.ids_of`, also with OpenTelemetry absent)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_messaging import tracing
from reliable_messaging.core.envelope import ATTEMPT_HEADER, Delivery
from reliable_messaging.core.trace_context import header_text, ids_in, parse_traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


@pytest.mark.parametrize(
    "value",
    [
        VALID,
        f"00-{TRACE}-{SPAN}-00",  # not sampled: still the ids of its trace
        f" {VALID}\t",  # surrounding whitespace
        VALID.encode(),  # an AMQP byte array arrives as bytes
        f"01-{TRACE}-{SPAN}-01",  # a later version, as version 00 reads it
        f"cc-{TRACE}-{SPAN}-01-what-comes-next",  # a future version may append fields
    ],
)
def test_valid_traceparents_give_their_ids(value: Any) -> None:
    assert parse_traceparent(value) == (TRACE, SPAN)


@pytest.mark.parametrize(
    "value",
    [
        None,
        42,
        ["00", TRACE, SPAN, "01"],
        "",
        "garbage",
        VALID.upper(),  # hex must be lowercase
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",  # an all-zero trace id is invalid
        f"00-{TRACE}-{'0' * 16}-01",  # and so is an all-zero span id
        f"ff-{TRACE}-{SPAN}-01",  # version ff is forbidden
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",  # a short trace id
        f"00-{TRACE}-{SPAN}0-01",  # a long span id
        f"00-{TRACE}-{SPAN}-1",  # flags are two hex digits
        f"0-{TRACE}-{SPAN}-01",
        f"00_{TRACE}_{SPAN}_01",
        b"\xff\xfe" + VALID.encode(),  # bytes that are not UTF-8
        VALID.encode("utf-16"),
    ],
)
def test_missing_or_malformed_traceparents_give_nothing(value: Any) -> None:
    assert parse_traceparent(value) is None


def test_header_text() -> None:
    assert header_text("a") == "a"
    assert header_text(b"a") == "a"
    assert header_text(b"\xff") is None
    assert header_text(7) is None
    assert header_text(None) is None


def test_ids_in_headers() -> None:
    assert ids_in({"traceparent": VALID, "tracestate": "vendor=1"}) == (TRACE, SPAN)
    assert ids_in({"traceparent": VALID.encode()}) == (TRACE, SPAN)
    assert ids_in({"Traceparent": VALID}) is None  # the W3C names the header in lowercase
    assert ids_in({}) is None


def delivery(headers: dict[str, Any]) -> Delivery:
    return Delivery(body=b"{}", queue="q", exchange="x", routing_key="k", headers=headers)


def test_without_a_span_the_header_ids_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # No span is current here: the message's own ids.
    assert tracing.ids_of(delivery({"traceparent": VALID})) == (TRACE, SPAN)
    assert tracing.ids_of(delivery({"traceparent": "junk"})) is None
    assert tracing.ids_of(delivery({})) is None
    # OpenTelemetry not installed at all: the same, from the stdlib parser alone.
    monkeypatch.setattr(tracing, "INSTALLED", False)
    assert not tracing.active()
    assert tracing.ids_of(delivery({"traceparent": VALID.encode()})) == (TRACE, SPAN)
    assert tracing.sampled_trace_id(delivery({"traceparent": VALID})) is None
    assert tracing.current_trace_id() is None
    assert tracing.start_publish("x", "k", "m", 2) == (None, {})
    assert tracing.start_deliveries([(delivery({"traceparent": VALID}), "c")]) is None


@pytest.mark.parametrize(
    ("header", "attempt"),
    [(None, 1), (3, 3), ("3", 3), (b"4", 4), ("three", 1), (0, 1), (True, 1)],
)
def test_a_process_span_records_the_attempt_the_consumer_reads(
    monkeypatch: pytest.MonkeyPatch, header: Any, attempt: int
) -> None:
    # A foreign producer may send the attempt header as text: the span says what the consumer
    # decides on (parse_attempt), and a header the consumer refuses is attempt 1.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "active", lambda: True)
    monkeypatch.setattr(tracing, "_tracer", lambda: provider.get_tracer("test"))
    one = delivery({} if header is None else {ATTEMPT_HEADER: header})
    tracing.end_deliveries(tracing.start_deliveries([(one, "c")]), [one], [None])
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["reliable_messaging.attempt"] == attempt
