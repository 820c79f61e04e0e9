"""The project's AsyncAPI 3.0 document (the broker, what the project publishes, what it
consumes), built from the code alone: the same code gives the same document
(``docs/contracts.md#the-asyncapi-document`` explains the mapping)."""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from ..broker.topology import (
    consumer_exchange,
    consumer_queues,
    dead_letter_queue,
    partition_exchange,
    queue_arguments,
)
from ..conf import MessagingSettings, messaging_settings, split_broker_urls
from ..core import envelope
from ..core.contracts import Contract
from ..core.envelope import CONTENT_TYPE, HEADER_PREFIX
from ..core.registry import ConsumerSpec, registry
from ..core.routing import topic_matches
from ..core.trace_context import TRACE_HEADERS, TRACEPARENT, TRACESTATE
from ..task_runs.naming import is_task_consumer
from .declarations import published as declared_payloads

ASYNCAPI_VERSION = "3.0.0"
AMQP_BINDING_VERSION = "0.3.0"
# The message trait every message of ours carries: the headers below.
HEADERS_TRAIT = "reliableMessagingHeaders"
UNTYPED_MESSAGE = "untypedJson"
TASK_MESSAGE = "djangoTask"
# Set on a frame in the consuming process only (its properties could not be decoded); never sent.
_IN_PROCESS_HEADERS = frozenset({envelope.UNDECODABLE_HEADER})


def _header(kind: str, description: str, **limits: Any) -> dict[str, Any]:
    """The JSON Schema of one header of ours: its JSON type, what it holds, its limits."""
    return {"type": kind, **limits, "description": description}


# What each header of ours holds. The names come from the code (every ``*_HEADER`` constant of
# core/envelope.py with our prefix, and the W3C trace headers); a header the code gains without
# a line here is still listed, and tests/integration/contracts/test_asyncapi.py asks for one.
HEADER_SCHEMAS: dict[str, dict[str, Any]] = {
    envelope.PUBLISHED_AT_HEADER: _header(
        "integer", "When the outbox row was written (Unix ms); set by the relay."
    ),
    envelope.OUTBOX_ID_HEADER: _header(
        "integer", "The outbox row the message was sent from; set by the relay."
    ),
    envelope.ORDERING_KEY_HEADER: _header(
        "string",
        "publish(ordering_key=...): an ordered consumer handles the messages of one key one at "
        "a time, in publish order; its partitions hash on this header.",
    ),
    envelope.EXPIRES_AT_HEADER: _header(
        "integer",
        "publish(expires=...): the deadline (Unix ms) past which the message is not handled.",
    ),
    envelope.ATTEMPT_HEADER: _header(
        "integer", "The attempt a retried copy is (absent on the first).", minimum=1
    ),
    envelope.ORIGINAL_EXCHANGE_HEADER: _header(
        "string", "On a retried or replayed copy: the exchange it was first published to."
    ),
    envelope.ORIGINAL_ROUTING_KEY_HEADER: _header(
        "string", "On a retried or replayed copy: the routing key it was first published with."
    ),
    envelope.FIRST_FAILED_AT_HEADER: _header(
        "integer", "On a retried copy: when the first attempt failed (Unix ms)."
    ),
    envelope.LAST_ERROR_HEADER: _header(
        "string",
        "On a retried copy: the type and text of the last attempt's exception.",
        maxLength=500,
    ),
    envelope.DEFERRALS_HEADER: _header(
        "integer",
        "How many times a copy was put aside because another consumer process held the message.",
    ),
    envelope.REPLAY_HEADER: _header(
        "integer", "On a replayed dead letter: how many times it was replayed.", minimum=1
    ),
    envelope.REPLAYED_BY_HEADER: _header(
        "string", "On a replayed dead letter: who replayed it (an admin user, a command)."
    ),
    envelope.DEAD_LETTER_ID_HEADER: _header(
        "integer", "On a replayed dead letter: its DeadLetter row."
    ),
    envelope.REPLAY_ID_HEADER: _header(
        "integer", "On a replayed dead letter: its row of the replay ledger."
    ),
    envelope.PRIORITY_HEADER: _header(
        "integer",
        "A task's AMQP priority (its framework priority mapped onto 0 to 9, 4 by default); the "
        "relay sends it as the message's priority property too.",
        minimum=0,
        maximum=9,
    ),
    TRACEPARENT: _header(
        "string",
        "W3C Trace Context of the publishing span (with the otel extra).",
        pattern="^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
    ),
    TRACESTATE: _header("string", "W3C Trace Context vendor state, passed along with traceparent."),
}


# The body of a task message (contrib/task_backend.py enqueues it, task_runs/worker.py reads it).
TASK_MESSAGE_SCHEMA: dict[str, Any] = {
    "title": "TaskMessage",
    "type": "object",
    "description": "A django.tasks task enqueued with ReliableTaskBackend. The task's arguments, "
    "status and result are in its TaskRun row (written in the transaction that "
    "published this message), not here: a message whose task_id has no row is a dead letter "
    "at once.",
    "properties": {
        "task_id": {
            "type": "string",
            "minLength": 1,
            "description": "The TaskRun row's id, also the message_id (the inbox deduplicates "
            "on it): the task runs at most once.",
        },
        "task": {
            "type": "string",
            "minLength": 1,
            "description": "The task function's module path (module.function), as its TaskRun row "
            "names it; the worker runs the task of the row.",
        },
    },
    "required": ["task_id", "task"],
}


def our_headers() -> list[str]:
    """Every header the app sets on a message: ``x-rm-*`` of core/envelope.py, and tracing's."""
    names = {
        value
        for attribute, value in vars(envelope).items()
        if attribute.endswith("_HEADER")
        and isinstance(value, str)
        and value.startswith(HEADER_PREFIX)
        and value not in _IN_PROCESS_HEADERS
    }
    return sorted(names | set(TRACE_HEADERS))


def headers_schema() -> dict[str, Any]:
    """The JSON Schema of the headers of ours a message may carry (user headers pass too)."""
    return {
        "type": "object",
        "description": "Headers reliable_messaging sets; the publisher's own headers "
        "(publish(headers=...)) travel beside them.",
        "properties": {
            name: HEADER_SCHEMAS.get(name, {"description": "Set by reliable_messaging."})
            for name in our_headers()
        },
    }


def _key(text: str) -> str:
    """``text`` as a key of the document (letters, digits, ``_`` and ``-``: what every parser
    takes; the specification allows ``.`` in component keys only)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "_"


_ABSENT = object()


def _unique(taken: Mapping[str, Any], base: str, value: Any = _ABSENT) -> str:
    """``base``, else ``base-2``, ``base-3``, ...: the first key free in ``taken`` (or that
    holds ``value`` already)."""
    key = base
    for n in range(2, 10_000):
        if taken.get(key, value) == value:
            break
        key = f"{base}-{n}"
    return key


def _rewrite_refs(value: Any, names: Mapping[str, str]) -> Any:
    """``value`` with its local ``$defs``/``definitions`` references pointed at components."""
    if isinstance(value, dict):
        out = {k: _rewrite_refs(v, names) for k, v in value.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            match = re.fullmatch(r"#/(?:\$defs|definitions)/(.+)", ref)
            if match:
                name = match[1].replace("~1", "/").replace("~0", "~")
                out["$ref"] = f"#/components/schemas/{names.get(name, _key(name))}"
        return out
    if isinstance(value, list):
        return [_rewrite_refs(item, names) for item in value]
    return value


def _vhost(url: str) -> str:
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def _server(url: str) -> dict[str, Any]:
    """The server of a broker URL: host, port and vhost, never the user or password."""
    parts = urlsplit(url)
    secure = parts.scheme.lower() == "amqps"
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"  # IPv6
    try:
        port = parts.port
    except ValueError:
        port = None
    server: dict[str, Any] = {
        "host": f"{host}:{port or (5671 if secure else 5672)}",
        "protocol": "amqps" if secure else "amqp",
        "protocolVersion": "0.9.1",
        "pathname": parts.path or "/",
        "description": f"RabbitMQ (BROKER_URL), virtual host {_vhost(url)!r}.",
    }
    if parts.username:
        server["security"] = [{"$ref": "#/components/securitySchemes/brokerUser"}]
    return server


class _Document:
    """The document being built: channels, operations and components by key."""

    def __init__(self, settings: MessagingSettings, urls: Sequence[str]) -> None:
        self.settings = settings
        self.vhost = _vhost(urls[0]) if urls else "/"
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        self.schemas: dict[str, Any] = {}
        self._message_keys: dict[tuple[str, str], str] = {}

    # -- components --------------------------------------------------------------------------

    def message(self, payload: Contract) -> str:
        """The key of ``payload``'s message in components (added once)."""
        schema = copy.deepcopy(payload.json_schema())
        schema.pop("$schema", None)
        found = (payload.name, json.dumps(schema, sort_keys=True, default=str))
        if found in self._message_keys:
            return self._message_keys[found]
        key = self._message_keys[found] = _unique(self.messages, _key(payload.name))
        schema_ref = f"#/components/schemas/{self._schema(key, schema)}"
        return self._add_message(key, payload.name, payload.name, {"$ref": schema_ref})

    def untyped_message(self) -> str:
        summary = "No payload type is declared: any JSON value."
        return self._add_message(UNTYPED_MESSAGE, UNTYPED_MESSAGE, "Any JSON", {}, summary)

    def task_message(self) -> str:
        """The message of the task queues: what ``ReliableTaskBackend.enqueue`` publishes."""
        self.schemas[TASK_MESSAGE] = TASK_MESSAGE_SCHEMA
        summary = (
            "A task enqueued through ReliableTaskBackend: which task, and the id of its TaskRun "
            "row; the arguments stay in that row."
        )
        schema_ref = f"#/components/schemas/{TASK_MESSAGE}"
        return self._add_message(
            TASK_MESSAGE, TASK_MESSAGE, "A django.tasks task", {"$ref": schema_ref}, summary
        )

    def _add_message(
        self, key: str, name: str, title: str, payload: dict[str, Any], summary: str | None = None
    ) -> str:
        message: dict[str, Any] = {
            "name": name,
            "title": title,
            "contentType": CONTENT_TYPE,
            "payload": payload,
            "traits": [{"$ref": f"#/components/messageTraits/{HEADERS_TRAIT}"}],
            "bindings": {"amqp": {"bindingVersion": AMQP_BINDING_VERSION}},
        }
        if summary is not None:
            message["summary"] = summary
        self.messages[key] = message
        return key

    def _schema(self, name: str, schema: dict[str, Any]) -> str:
        """Put ``schema`` and its nested types (``$defs``) in components; its key there.
        A nested type of the same name but another shape than one already there is kept
        under ``<name>_<type>``, and so are the other nested types of ``schema``."""
        defs: dict[str, Any] = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
        names: dict[str, str] = {}
        hoisted: dict[str, Any] = {}
        for prefix in ("", f"{name}_"):
            names = {d: f"{prefix}{_key(d)}" for d in defs}
            hoisted = {names[d]: _rewrite_refs(s, names) for d, s in defs.items()}
            if all(self.schemas.get(k, s) == s for k, s in hoisted.items()):
                break
        self.schemas.update(hoisted)
        top = _rewrite_refs(schema, names)
        key = _unique(self.schemas, name, top)
        self.schemas[key] = top
        return key

    def _channel_binding(self, kind: str, name: str, **details: Any) -> dict[str, Any]:
        """A channel's AMQP binding: a durable ``exchange`` (its routing key) or ``queue``."""
        is_ = "routingKey" if kind == "exchange" else "queue"
        entity = {"name": name, "durable": True, "autoDelete": False, "vhost": self.vhost}
        return {
            "amqp": {
                "is": is_,
                kind: {**entity, **details},
                "bindingVersion": AMQP_BINDING_VERSION,
            }
        }

    # -- what the project publishes ----------------------------------------------------------

    def published(self, routing_key: str, payload: Contract) -> None:
        message = self.message(payload)
        channel = _unique(self.channels, f"published_{_key(routing_key)}")
        self.channels[channel] = {
            "address": routing_key,
            "title": f"{routing_key} on {self.settings.exchange}",
            "description": "Published with publish() inside the caller's transaction; the "
            "relay sends it after commit.",
            "messages": {message: {"$ref": f"#/components/messages/{message}"}},
            "bindings": self._channel_binding("exchange", self.settings.exchange, type="topic"),
        }
        self.operations[_unique(self.operations, f"publish_{_key(routing_key)}")] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel}"},
            "summary": f'publish("{routing_key}", ...): the payload is checked, an outbox row '
            "written in the caller's transaction, and the relay sends it after commit.",
            "messages": [{"$ref": f"#/channels/{channel}/messages/{message}"}],
            "bindings": {
                "amqp": {
                    # Persistent, and mandatory with publisher confirms: a row is marked sent
                    # only once the broker routed and confirmed it.
                    "deliveryMode": 2,
                    "mandatory": True,
                    "bindingVersion": AMQP_BINDING_VERSION,
                }
            },
        }

    # -- what the project consumes -----------------------------------------------------------

    def consumed(self, spec: ConsumerSpec, published: Mapping[str, Contract]) -> None:
        settings = self.settings
        if spec.payload is not None:
            messages = [self.message(spec.payload)]
        elif is_task_consumer(spec.name):
            messages = [self.task_message()]
        else:  # what of ours reaches the queue, or any JSON
            matched = {
                self.message(payload)
                for key, payload in published.items()
                if any(topic_matches(binding, key) for binding in spec.bindings)
            }
            messages = sorted(matched) or [self.untyped_message()]
        exchange = consumer_exchange(spec, settings)
        bound_to = [{"exchange": exchange, "routingKey": key} for key in spec.bindings]
        dead_letter_to = dead_letter_queue(spec) if settings.queue_type == "quorum" else None
        channel_id = _unique(self.channels, f"queue_{_key(spec.queue)}")
        address = f"{spec.queue}.p{{partition}}" if spec.ordered else spec.queue
        channel: dict[str, Any] = {
            "address": address,
            "title": spec.queue,
            "messages": {m: {"$ref": f"#/components/messages/{m}"} for m in messages},
            "bindings": self._channel_binding("queue", address, exclusive=False),
            "x-queue-arguments": queue_arguments(
                settings,
                ordered=spec.ordered,
                dead_letter_to=dead_letter_to,
                priorities=spec.priorities,
            ),
            "x-bound-to": bound_to,
        }
        if spec.ordered:
            partitions = consumer_queues(spec, settings)
            channel["parameters"] = {
                "partition": {
                    "enum": [str(n) for n in range(len(partitions))],
                    "description": "Ordered consumer: one queue per partition, each with a "
                    "single active consumer.",
                }
            }
            # Equal weights: the binding key of a consistent-hash exchange is the weight.
            channel["x-bound-to"] = [{"exchange": partition_exchange(spec), "routingKey": "1"}]
            channel["x-ordered"] = {
                "partitions": partitions,
                "hashExchange": partition_exchange(spec),
                "hashExchangeType": "x-consistent-hash",
                "hashHeader": envelope.ORDERING_KEY_HEADER,
                "hashExchangeBoundTo": bound_to,
            }
        self.channels[channel_id] = channel
        delays = list(spec.retry_delays or settings.retry_delays)
        operation: dict[str, Any] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"{spec.name}: handled once per message_id (the inbox), in a "
            "transaction with its inbox row.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{m}"} for m in messages],
            "bindings": {"amqp": {"ack": True, "bindingVersion": AMQP_BINDING_VERSION}},
            "x-consumer": spec.name,
            "x-max-attempts": spec.max_attempts or settings.max_attempts,
            "x-retry-delays": delays,
            "x-handler-timeout": spec.timeout or settings.handler_timeout,
        }
        if spec.max_age is not None:
            operation["x-max-age"] = spec.max_age
            operation["x-on-expiry"] = spec.on_expiry
        self.operations[_unique(self.operations, f"consume_{_key(spec.queue)}")] = operation


def asyncapi_document(
    *,
    title: str,
    version: str = "unversioned",
    settings: MessagingSettings = messaging_settings,
    specs: Iterable[ConsumerSpec] | None = None,
    published: Mapping[str, Contract] | None = None,
    broker_url: str | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``specs`` (the registry's) and ``published`` (the declared
    payloads), on the exchange of ``settings`` and its broker (``broker_url``'s, when given:
    ``;``-separated URLs, as ``BROKER_URL``)."""
    specs = sorted(registry.all() if specs is None else specs, key=lambda s: s.queue)
    if published is None:
        published = declared_payloads()
    urls = settings.broker_urls if broker_url is None else split_broker_urls(broker_url)
    doc = _Document(settings, urls)
    for routing_key, payload in sorted(published.items()):
        doc.published(routing_key, payload)
    for spec in specs:
        doc.consumed(spec, published)
    servers = {
        ("rabbitmq" if len(urls) == 1 else f"rabbitmq-{n + 1}"): _server(url)
        for n, url in enumerate(urls)
    }
    components: dict[str, Any] = {
        "messages": doc.messages,
        "schemas": doc.schemas,
        "messageTraits": {
            HEADERS_TRAIT: {
                "headers": headers_schema(),
                "contentType": CONTENT_TYPE,
                "description": "Every message carries its message_id (the AMQP property, the "
                "inbox's deduplication key), content type application/json and delivery "
                "mode 2 (persistent).",
            }
        },
    }
    if any("security" in server for server in servers.values()):
        components["securitySchemes"] = {
            "brokerUser": {
                "type": "userPassword",
                "description": "The user and password of BROKER_URL (not written here).",
            }
        }
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": "What this project publishes and consumes over RabbitMQ. Written by "
            "`manage.py asyncapi` from the code (consumers, declared payloads, settings): "
            "regenerate it rather than edit it.",
        },
        "defaultContentType": CONTENT_TYPE,
        "servers": servers,
        "channels": doc.channels,
        "operations": doc.operations,
        "components": components,
    }


def render(document: Mapping[str, Any], fmt: str = "json") -> str:
    """``document`` as text: JSON (or YAML), keys sorted, so the same code gives the same text."""
    if fmt == "yaml":
        import yaml

        return str(yaml.safe_dump(dict(document), sort_keys=True, allow_unicode=True, width=100))
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def parse(text: str, fmt: str = "json") -> Any:
    """A document read back from :func:`render`'s format (or any equivalent formatting)."""
    if fmt == "yaml":
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(str(exc)) from exc
    return json.loads(text)


def difference(committed: str, current: str, path: str, fmt: str = "json", limit: int = 40) -> str:
    """A short unified diff from ``committed`` to ``current`` ("" when they say the same)."""
    try:
        old = parse(committed, fmt)
    except ValueError as exc:
        return f"{path} is not {fmt.upper()}: {exc}\n"
    new = parse(current, fmt)
    if old == new:
        return ""
    lines = list(
        difflib.unified_diff(
            render(old, fmt).splitlines(keepends=True),
            render(new, fmt).splitlines(keepends=True),
            fromfile=f"{path} (committed)",
            tofile=f"{path} (from the code)",
            n=2,
        )
    )
    if len(lines) > limit:
        lines = [*lines[:limit], f"... {len(lines) - limit} more diff lines\n"]
    return "".join(lines)
