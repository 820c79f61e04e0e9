"""Tracing's hooks when OpenTelemetry is absent (``tracing.INSTALLED`` false, as without the
``otel`` extra): a real ConsumerService in a thread of this process, the real broker and
database. Messages are handled as ever, and a dead letter keeps the trace and span ids of the
``traceparent`` its message carried, read by the stdlib parser alone."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from reliable_messaging import Message, tracing
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests.support import Publisher, wait_until
from tests.testapp.consumers import behave

pytestmark = pytest.mark.django_db(transaction=True)


def test_without_opentelemetry_dead_letters_keep_the_ids_of_their_traceparent(
    ns: str, service: Any, publisher: Publisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracing, "INSTALLED", False)

    def handler(message: Message) -> None:
        behave("alpha", message)

    spec = ConsumerSpec(
        name=f"{ns}.alpha", queue=f"{ns}.alpha", handler=handler, bindings=("order.*",)
    )
    service([spec])
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    exchange = f"rmtest.{ns}"
    publisher.publish(
        exchange,
        "order.placed",
        {"permanent": {"alpha": True}},
        message_id="absent-dead",
        headers={"traceparent": f"00-{trace_id}-{span_id}-01".encode()},
    )
    publisher.publish(
        exchange,
        "order.placed",
        {},
        message_id="absent-alive",
        headers={"traceparent": f"00-{uuid.uuid4().hex}-{span_id}-01"},
    )
    wait_until(
        lambda: (
            DeadLetter.objects.filter(message_id="absent-dead").exists()
            and ProcessedMessage.objects.filter(message_id="absent-alive").exists()
        ),
        timeout=30,
        message="a dead letter and a processed message",
    )
    letter = DeadLetter.objects.get(message_id="absent-dead")
    assert (letter.trace_id, letter.span_id) == (trace_id, span_id)
    assert letter.history[0]["event"] == "dead_lettered"
    assert letter.history[0]["trace_id"] == trace_id
