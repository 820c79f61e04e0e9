"""OpenTelemetry spans for ``publish()``, the relay's send, each delivery, tasks and replays;
every hook returns at once unless a tracer provider is set (``docs/tracing.md``)."""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from importlib import metadata
from typing import Any

from .core.envelope import (
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    Delivery,
    parse_attempt,
    sent_to_its_queue,
)
from .core.outcomes import Acknowledge, Outcome, OutcomeLabel, Release, RetryInPlace, label_of
from .core.trace_context import TRACE_HEADERS, header_text, ids_in

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.propagators.textmap import Getter
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

    INSTALLED = True
except ImportError:  # the "otel" extra is not installed
    INSTALLED = False

SYSTEM = "rabbitmq"
# Our attributes, beside the semantic conventions' messaging.* ones.
OUTCOME = "reliable_messaging.outcome"
REASON = "reliable_messaging.reason"
CONSUMER = "reliable_messaging.consumer"
ATTEMPT = "reliable_messaging.attempt"

_NOTHING: AbstractContextManager[None] = nullcontext()
_UNKNOWN = object()
# A provider named in the environment is made by the first get_tracer_provider() call.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_local = threading.local()


def active() -> bool:
    """Whether spans are recorded: the API is installed and a tracer provider was set."""
    if not INSTALLED:
        return False
    # Until a provider is set, OpenTelemetry's getter reads the environment on every call: the
    # global it sets is cheaper (a version without it goes through the getter).
    if getattr(trace, "_TRACER_PROVIDER", _UNKNOWN) is None and not _PROVIDER_FROM_ENV:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


_tracer_of: tuple[Any, Any] = (None, None)  # (provider, its tracer for this package)


def _tracer() -> Any:
    global _tracer_of
    provider = trace.get_tracer_provider()
    if _tracer_of[0] is not provider:
        try:
            version: str | None = metadata.version("reliable-messaging")
        except metadata.PackageNotFoundError:  # run from a checkout
            version = None
        _tracer_of = (provider, provider.get_tracer("reliable_messaging", version))
    return _tracer_of[1]


if INSTALLED:

    class _TextGetter(Getter[Any]):
        """Reads the context from AMQP headers (pika may hand strings over as bytes) or, with
        ``attributes``, from a Celery task request's attributes."""

        def __init__(self, attributes: bool = False) -> None:
            self.attributes = attributes

        def get(self, carrier: Any, key: str) -> list[str] | None:
            raw = getattr(carrier, key, None) if self.attributes else carrier.get(key)
            text = header_text(raw)
            return None if text is None else [text]

        def keys(self, carrier: Any) -> list[str]:
            return [] if self.attributes else [str(key) for key in carrier]

    _headers_getter = _TextGetter()
    _attribute_getter = _TextGetter(attributes=True)


def _inject(span: Any, headers: MutableMapping[str, Any], parent: Any = None) -> None:
    """Put ``span``'s context into ``headers``, replacing any ``traceparent`` there."""
    for name in TRACE_HEADERS:
        headers.pop(name, None)
    propagate.inject(headers, context=trace.set_span_in_context(span, parent))


def _failed(span: Any, description: str, error: BaseException | None = None) -> None:
    if error is not None:
        span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, description[:500]))


def _settle(span: Any, outcome: str, reason: str | None) -> None:
    span.set_attribute(OUTCOME, outcome)
    if reason:
        span.set_attribute(REASON, reason[:500])


def _attributes(
    operation_type: str, operation_name: str, exchange: str, routing_key: str
) -> dict[str, Any]:
    """The semantic conventions' attributes of a span about one message on RabbitMQ."""
    return {
        "messaging.system": SYSTEM,
        "messaging.operation.type": operation_type,
        "messaging.operation.name": operation_name,
        "messaging.destination.name": exchange,
        "messaging.rabbitmq.destination.routing_key": routing_key,
    }


def _with_carrier(span: Any) -> tuple[Any, dict[str, str]]:
    """``span`` and the headers carrying its context."""
    carrier: dict[str, str] = {}
    _inject(span, carrier)
    return span, carrier


def end(span: Any, error: BaseException | None = None) -> None:
    """End a span of :func:`start_publish` or :func:`start_replay` (None: nothing to end)."""
    if span is None:
        return
    if error is not None:
        _failed(span, f"{type(error).__name__}: {error}", error)
    span.end()


def start_publish(
    exchange: str, routing_key: str, message_id: str, body_size: int
) -> tuple[Any, dict[str, str]]:
    """A ``publish`` span and the headers carrying its context; ``(None, {})`` when off."""
    if not active():
        return None, {}
    span = _tracer().start_span(
        f"publish {routing_key}",
        kind=SpanKind.PRODUCER,
        attributes={
            **_attributes("create", "publish", exchange, routing_key),
            "messaging.message.id": message_id,
            "messaging.message.body.size": body_size,
        },
    )
    return _with_carrier(span)


def start_replay(
    *,
    dead_letter: int,
    consumer: str,
    queue: str,
    message_id: str,
    trace_id: str,
    span_id: str,
    replayed_by: str,
) -> tuple[Any, dict[str, str]]:
    """A ``replay`` span starting a new trace, linked to the failure it replays, and the
    headers for the copy."""
    if not active():
        return None, {}
    links = []
    if trace_id and span_id:
        original = SpanContext(
            int(trace_id, 16),
            int(span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        links.append(Link(original, {"reliable_messaging.link": "replayed failure"}))
    span = _tracer().start_span(
        f"replay {queue}",
        context=otel_context.Context(),  # a root: the replay is a trace of its own
        kind=SpanKind.PRODUCER,
        links=links,
        attributes={
            **_attributes("create", "replay", "", queue),
            "messaging.message.id": message_id,
            CONSUMER: consumer,
            "reliable_messaging.dead_letter.id": dead_letter,
            "reliable_messaging.replayed_by": replayed_by,
        },
    )
    return _with_carrier(span)


def start_send(
    headers: Mapping[str, Any],
    *,
    exchange: str,
    routing_key: str,
    message_id: str,
    created_at: dt.datetime,
    now: dt.datetime,
) -> Any:
    """A ``send`` span for one outbox row, a child of its publish's context; None when off or
    the row holds no context."""
    if not active() or "traceparent" not in headers:
        return None
    parent = propagate.extract(headers, getter=_headers_getter)
    return _tracer().start_span(
        f"send {routing_key}",
        context=parent,
        kind=SpanKind.PRODUCER,
        attributes={
            **_attributes("send", "send", exchange, routing_key),
            "messaging.message.id": message_id,
            "reliable_messaging.outbox.wait_ms": max(
                0.0, (now - created_at).total_seconds() * 1000
            ),
        },
    )


def sent_with(span: Any, headers: MutableMapping[str, Any]) -> None:
    """The message goes out carrying the ``send`` span's context."""
    if span is not None:
        _inject(span, headers, propagate.extract(headers, getter=_headers_getter))


def end_send(span: Any, outcome: str, error: str | None = None) -> None:
    """End a ``send`` span: ``sent``, ``unrouted``, ``failed`` (with ``error``) or ``again``."""
    if span is None:
        return
    _settle(span, outcome, error)
    if error is not None:
        _failed(span, error)
    span.end()


def _delivery_spans() -> dict[int, tuple[Delivery, Any]]:
    """This thread's deliveries being decided, by ``id()`` (the entry keeps the id in use)."""
    spans: dict[int, tuple[Delivery, Any]] | None = getattr(_local, "spans", None)
    if spans is None:
        spans = _local.spans = {}
    return spans


def _origin(delivery: Delivery) -> tuple[str, str]:
    """Where the message was first published (a retry or replay copy's headers say)."""
    if sent_to_its_queue(delivery):
        exchange = header_text(delivery.headers.get(ORIGINAL_EXCHANGE_HEADER))
        routing_key = header_text(delivery.headers.get(ORIGINAL_ROUTING_KEY_HEADER))
        return exchange or delivery.exchange, routing_key or delivery.routing_key
    return delivery.exchange, delivery.routing_key


def _attempt(headers: Mapping[str, Any]) -> int:
    """The attempt as the consumer reads it (a malformed header: 1, the consumer refuses it)."""
    try:
        return parse_attempt(headers)
    except ValueError:
        return 1


def start_deliveries(deliveries: Iterable[tuple[Delivery, str]]) -> list[Delivery] | None:
    """Start a ``process`` span for each (delivery, consumer) without one on this thread; the
    deliveries started here (for :func:`end_deliveries`), or None when tracing is off."""
    if not active():
        return None
    spans = _delivery_spans()
    tracer = _tracer()
    started = []
    for delivery, consumer in deliveries:
        if id(delivery) in spans:
            continue  # decided again inside the batch that started its span
        exchange, routing_key = _origin(delivery)
        attributes: dict[str, Any] = {
            **_attributes("process", "process", exchange, routing_key),
            "messaging.destination.subscription.name": delivery.queue,
            "messaging.rabbitmq.message.delivery_tag": delivery.delivery_tag,
            "messaging.message.body.size": len(delivery.body),
            CONSUMER: consumer,
            ATTEMPT: _attempt(delivery.headers),
        }
        if delivery.message_id:
            attributes["messaging.message.id"] = delivery.message_id
        if delivery.redelivered:
            attributes["reliable_messaging.redelivered"] = True
        span = tracer.start_span(
            f"process {delivery.queue}",
            context=propagate.extract(delivery.headers, getter=_headers_getter),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        )
        spans[id(delivery)] = (delivery, span)
        started.append(delivery)
    return started


def _span_of(delivery: Delivery) -> Any:
    entry = getattr(_local, "spans", {}).get(id(delivery))
    return None if entry is None else entry[1]


def handling(delivery: Delivery) -> AbstractContextManager[Any]:
    """Around the handler: its span is current, so the handler's own spans nest in it."""
    span = _span_of(delivery)
    if span is None:
        return _NOTHING
    return trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    )


def delivery_failed(
    delivery: Delivery, description: str, error: BaseException | None = None
) -> None:
    """The delivery failed (its handler raised ``error``, or it cannot be handled at all)."""
    span = _span_of(delivery)
    if span is not None:
        _failed(span, description, error)


def _describe(outcome: Outcome | None) -> tuple[str, str | None]:
    if outcome is None:
        return "held", "held behind an earlier delivery of its queue; it comes back"
    if isinstance(outcome, RetryInPlace):
        return OutcomeLabel.RETRIED, outcome.error or None
    label = label_of(outcome)
    if isinstance(outcome, Acknowledge):
        return label, outcome.reason
    if isinstance(outcome, Release):
        return label, outcome.why
    return label, outcome.error or None


def end_deliveries(
    started: Sequence[Delivery] | None,
    deliveries: Sequence[Delivery],
    outcomes: Sequence[Outcome | None] | None,
    error: BaseException | None = None,
) -> None:
    """End the spans :func:`start_deliveries` started with their outcomes (held on ``error``)."""
    if not started:
        return
    spans = _delivery_spans()
    mine = {id(delivery) for delivery in started}
    results: list[Outcome | None] = list(outcomes) if outcomes is not None else []
    for index, delivery in enumerate(deliveries):
        if id(delivery) not in mine:
            continue
        mine.discard(id(delivery))
        _, span = spans.pop(id(delivery), (None, None))
        if span is None:
            continue
        if error is not None:
            _settle(span, "held", f"{type(error).__name__}: {error}")
        else:
            label, reason = _describe(results[index] if index < len(results) else None)
            _settle(span, str(label), reason)
        span.end()


def _valid_context(span: Any) -> Any:
    """``span``'s context when it has valid ids, else None."""
    context = None if span is None else span.get_span_context()
    return context if context is not None and context.is_valid else None


def ids_of(delivery: Delivery) -> tuple[str, str] | None:
    """The trace and span ids to store with ``delivery``'s dead letter: its span's (or the
    current one's), else its ``traceparent``'s."""
    span = _span_of(delivery)
    if span is None and INSTALLED:
        span = trace.get_current_span()  # an idempotent task's
    context = _valid_context(span)
    if context is not None:
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"
    return ids_in(delivery.headers)


def sampled_trace_id(delivery: Delivery | None = None) -> str | None:
    """A metric exemplar's trace id, when ``delivery``'s (or the current) span is sampled."""
    if not INSTALLED:
        return None
    context = _valid_context(
        _span_of(delivery) if delivery is not None else trace.get_current_span()
    )
    if context is None or not context.trace_flags.sampled:
        return None
    return f"{context.trace_id:032x}"


def current_trace_id() -> str | None:
    """The trace id of the current span, if any (what a history entry records)."""
    context = _valid_context(trace.get_current_span()) if INSTALLED else None
    return None if context is None else f"{context.trace_id:032x}"


class TaskSpan:
    """The span of one idempotent task's run, and the outcome it ends with."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.outcome: str | None = None

    def settle(self, outcome: str, reason: str | None = None) -> None:
        self.outcome = outcome
        if self.span is not None:
            _settle(self.span, outcome, reason)


@contextmanager
def running_task(request: Any, name: str, message_id: str) -> Iterator[TaskSpan]:
    """A ``process`` span around an idempotent task's run, a child of the current span or of the
    task message's ``traceparent``; an escaping exception without an outcome ends it ``failed``."""
    if not active():
        yield TaskSpan(None)
        return
    parent = None
    if not trace.get_current_span().get_span_context().is_valid and request is not None:
        parent = propagate.extract(request, getter=_attribute_getter)
    span = _tracer().start_span(
        f"process {name}",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "celery",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": str(getattr(request, "id", None) or message_id),
            CONSUMER: name,
            "reliable_messaging.idempotency_key": message_id,
        },
    )
    holder = TaskSpan(span)
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        try:
            yield holder
        except BaseException as exc:
            if holder.outcome is None:
                holder.settle("failed")
                _failed(span, f"{type(exc).__name__}: {exc}", exc)
            raise


def inject_into_task(headers: MutableMapping[str, Any]) -> None:
    """Give a task message being sent the current context (unless it has one)."""
    if not active() or "traceparent" in headers:
        return
    if trace.get_current_span().get_span_context().is_valid:
        propagate.inject(headers)
