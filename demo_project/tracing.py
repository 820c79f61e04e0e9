"""Traces without a tracing server: every process appends its spans to one JSON-lines file, and
:func:`render_tree` prints a trace from it as a tree.

``configure_from_env()`` sets an OpenTelemetry tracer provider that exports there when
``RM_TRACE_FILE`` names the file (the demo's ``make demo`` and the tracing tests set it for the
processes they start); without it, nothing is configured and tracing stays off. A real
deployment configures its own provider and exporter (OTLP to a collector) instead.
``web_request()`` stands in for a web framework's instrumentation around a view.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TRACE_FILE_ENV = "RM_TRACE_FILE"


def configure_from_env(service: str | None = None) -> bool:
    """Export this process's spans to ``$RM_TRACE_FILE``; False when it is unset."""
    path = os.environ.get(TRACE_FILE_ENV)
    if not path:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    if service is None:
        command = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""
        program = Path(sys.argv[0])
        if program.name == "__main__.py":  # python -m celery ...: the package's name
            service = f"shop {program.parent.name}"
        else:
            service = f"shop {command}".strip() if command else program.stem
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(_file_exporter(path)))
    trace.set_tracer_provider(provider)
    return True


def sdk_installed() -> bool:
    """Whether ``opentelemetry-sdk``, which :func:`configure_from_env` needs, is installed."""
    try:
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except ImportError:  # not even the API's namespace package
        return False


@contextmanager
def web_request(method: str, route: str) -> Iterator[Any]:
    """A server span named like a view's (``POST /orders``), current meanwhile, as a web
    framework's instrumentation would start it; yields None when tracing is off."""
    from reliable_messaging import tracing

    if not tracing.active():
        yield None
        return
    from opentelemetry import trace

    tracer = trace.get_tracer("demo_project.shop")
    with tracer.start_as_current_span(
        f"{method} {route}",
        kind=trace.SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route},
    ) as span:
        yield span


def _file_exporter(path: str) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class FileSpanExporter(SpanExporter):
        """One JSON line per span, appended with a single ``write`` so that processes sharing
        the file never interleave their lines."""

        def __init__(self, target: str) -> None:
            self.fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            for span in spans:
                os.write(self.fd, (json.dumps(span_record(span)) + "\n").encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            os.close(self.fd)

    return FileSpanExporter(path)


def span_record(span: Any) -> dict[str, Any]:
    """A finished SDK span as plain JSON values."""
    context = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name,
        "start": span.start_time,
        "end": span.end_time,
        "service": span.resource.attributes.get("service.name", ""),
        "pid": os.getpid(),
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
        "events": [event.name for event in span.events],
    }


def read_spans(path: str | Path) -> list[dict[str, Any]]:
    """The spans in a trace file (a partly written last line is skipped)."""
    spans = []
    file = Path(path)
    if not file.exists():
        return []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return spans


# Attributes worth a glance in the tree, in this order.
_SHOWN = (
    "reliable_messaging.consumer",
    "reliable_messaging.attempt",
    "reliable_messaging.outcome",
    "reliable_messaging.reason",
    "reliable_messaging.outbox.wait_ms",
    "reliable_messaging.dead_letter.id",
)


def _label(span: dict[str, Any], origin: int) -> str:
    start_ms = (span["start"] - origin) / 1e6
    took_ms = (span["end"] - span["start"]) / 1e6
    attributes = span["attributes"]
    shown = []
    for key in _SHOWN:
        if key in attributes:
            value = attributes[key]
            if isinstance(value, float):
                value = f"{value:.0f}"
            shown.append(f"{key.rsplit('.', 1)[-1]}={value}")
    if span["status"] == "ERROR":
        shown.append("ERROR")
    for link in span["links"]:
        shown.append(f"linked to trace {link['trace_id'][:8]}… span {link['span_id'][:8]}…")
    detail = f"  [{', '.join(shown)}]" if shown else ""
    return f"{span['name']}  ({span['service']}, +{start_ms:.0f} ms, {took_ms:.1f} ms){detail}"


def render_tree(spans: Iterable[dict[str, Any]], trace_id: str) -> str:
    """One trace as an indented tree, children in start order; spans whose parent is not in
    the file (a foreign producer's) are shown as roots."""
    mine = [span for span in spans if span["trace_id"] == trace_id]
    if not mine:
        return f"(no spans of trace {trace_id})"
    ids = {span["span_id"] for span in mine}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in mine:
        parent = span["parent_span_id"] if span["parent_span_id"] in ids else None
        children[parent].append(span)
    origin = min(span["start"] for span in mine)
    lines = [f"trace {trace_id}"]

    def walk(parent: str | None, prefix: str) -> None:
        kids = sorted(children.get(parent, []), key=lambda span: span["start"])
        for index, span in enumerate(kids):
            last = index == len(kids) - 1
            lines.append(f"{prefix}{'└─ ' if last else '├─ '}{_label(span, origin)}")
            walk(span["span_id"], prefix + ("   " if last else "│  "))

    walk(None, "")
    return "\n".join(lines)
