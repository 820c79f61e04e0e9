"""``manage.py asyncapi``: the project's AsyncAPI 3.0 document.

The documents of the test app and of the demo validate against the official AsyncAPI 3.0.0 JSON
Schema (vendored in ``asyncapi_schema/``, with its licence) and go through a parser nobody here
wrote (``asyncapi3``, from PyPI) and back unchanged; ``--check`` is the CI step: 0 when the
committed file says what the code says, 1 and a short diff otherwise.
"""

from __future__ import annotations

import dataclasses
import decimal
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import jsonschema
import pydantic
import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.contracts import published_registry, publishes
from reliable_messaging.contracts.asyncapi import (
    HEADER_SCHEMAS,
    asyncapi_document,
    our_headers,
    render,
)
from reliable_messaging.core import envelope
from reliable_messaging.core.registry import ConsumerRegistry, ConsumerSpec, consumer, registry
from tests.support import broker_connection, rabbitmqctl

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = Path(__file__).parent / "asyncapi_schema" / "asyncapi-3.0.0-without-id.json"
DEMO_DOCUMENT = ROOT / "demo_project" / "asyncapi.json"
VALIDATOR = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))


class Line(pydantic.BaseModel):
    sku: str
    quantity: int


class OrderPlaced(pydantic.BaseModel):
    order_id: int
    amount: decimal.Decimal
    lines: list[Line]
    note: str | None = None


@dataclasses.dataclass
class RefundIssued:
    order_id: int
    reason: str


class Shipped(TypedDict):
    order_id: int
    carrier: str


def handler(message: Any) -> None:
    pass


def problems(document: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message[:300]}"
        for error in VALIDATOR.iter_errors(document)
    ]


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    if isinstance(node, dict) and set(node) == {"$ref"}:  # a channel's message: a reference
        return resolve(document, node["$ref"])
    return node


def refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if isinstance(value.get("$ref"), str):
            yield value["$ref"]
        for item in value.values():
            yield from refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from refs(item)


def assert_round_trips(document: dict[str, Any]) -> None:
    """Parsed by asyncapi3 (its AsyncAPI 3.0 object model) and written back: the same document."""
    asyncapi3 = pytest.importorskip("asyncapi3")
    parsed = asyncapi3.AsyncAPI3.model_validate(document)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_none=True) == document


@pytest.fixture
def declared() -> Iterator[ConsumerRegistry]:
    """A registry of consumers with declared payloads, and published keys of their own."""
    consumers = ConsumerRegistry()
    kept: dict[str, Any] = {"registry": consumers}
    with published_registry.isolated():
        publishes("order.placed", OrderPlaced)
        publishes("refund.issued", RefundIssued)
        publishes("order.shipped", Shipped)
        consumer("billing", bindings=["order.placed"], payload=OrderPlaced, name="billing", **kept)(
            handler
        )
        consumer("timeline", bindings=["order.*"], ordered=True, max_age=30, name="tl", **kept)(
            handler
        )
        consumer(
            "refunds",
            name="refunds",
            bindings=["refund.issued"],
            payload=RefundIssued,
            retry_delays=[5, 60],
            max_attempts=7,
            **kept,
        )(handler)
        consumer("foreign", bindings=["partner.#"], name="foreign", **kept)(handler)
        yield consumers


def test_the_test_apps_document_is_valid_asyncapi_and_round_trips() -> None:
    out = io.StringIO()
    call_command("asyncapi", stdout=out)
    document = json.loads(out.getvalue())
    assert problems(document) == []
    queues = {channel["address"] for channel in document["channels"].values()}
    assert {spec.queue for spec in registry.all() if not spec.ordered} <= queues
    assert all(resolve(document, ref) for ref in refs(document))
    assert_round_trips(document)


def test_declared_payloads_become_messages_with_their_schemas(
    declared: ConsumerRegistry,
) -> None:
    document = asyncapi_document(title="shop", specs=declared.all())
    assert problems(document) == []
    for ref in refs(document):  # nested types hoisted into components: every $ref resolves
        resolve(document, ref)
    assert_round_trips(document)
    messages, schemas = document["components"]["messages"], document["components"]["schemas"]
    assert sorted(messages) == ["OrderPlaced", "RefundIssued", "Shipped", "untypedJson"]
    order = resolve(document, messages["OrderPlaced"]["payload"]["$ref"])
    assert "$defs" not in order
    assert order["properties"]["lines"]["items"] == {"$ref": "#/components/schemas/Line"}
    assert order["required"] == ["order_id", "amount", "lines"]
    assert schemas["Line"]["properties"]["sku"]["type"] == "string"
    assert resolve(document, messages["Shipped"]["payload"]["$ref"])["required"] == [
        "order_id",
        "carrier",
    ]
    # What the project publishes: a channel on the exchange and a send operation per key.
    sent = {
        resolve(document, op["channel"]["$ref"])["address"]: op
        for op in document["operations"].values()
        if op["action"] == "send"
    }
    assert sorted(sent) == ["order.placed", "order.shipped", "refund.issued"]
    channel = resolve(document, sent["order.placed"]["channel"]["$ref"])
    assert channel["bindings"]["amqp"]["is"] == "routingKey"
    assert channel["bindings"]["amqp"]["exchange"]["type"] == "topic"
    assert sent["order.placed"]["bindings"]["amqp"] | {"bindingVersion": None} == {
        "deliveryMode": 2,
        "mandatory": True,
        "bindingVersion": None,
    }
    # What it consumes: the declared type, else what of ours the bindings match, else any JSON.
    by_queue = {
        resolve(document, op["channel"]["$ref"])["title"]: [
            resolve(document, m["$ref"])["name"] for m in op["messages"]
        ]
        for op in document["operations"].values()
        if op["action"] == "receive"
    }
    assert by_queue == {
        "billing": ["OrderPlaced"],
        "refunds": ["RefundIssued"],
        "timeline": ["OrderPlaced", "Shipped"],
        "foreign": ["untypedJson"],
    }


def test_ordered_quorum_and_retry_properties_are_bindings_and_extensions(
    declared: ConsumerRegistry, settings: Any
) -> None:
    settings.RELIABLE_MESSAGING = {
        **settings.RELIABLE_MESSAGING,
        "QUEUE_TYPE": "quorum",
        "ORDERED_PARTITIONS": 3,
        "RETRY_DELAYS": [1, 10],
        "MAX_ATTEMPTS": 4,
        "EXCHANGE": "shop",
    }
    document = asyncapi_document(title="shop", specs=declared.all())
    assert problems(document) == []
    assert_round_trips(document)
    channels = {channel["title"]: channel for channel in document["channels"].values()}
    operations = {
        resolve(document, op["channel"]["$ref"])["title"]: op
        for op in document["operations"].values()
        if op["action"] == "receive"
    }
    billing = channels["billing"]
    assert billing["bindings"]["amqp"]["queue"] | {"vhost": None} == {
        "name": "billing",
        "durable": True,
        "exclusive": False,
        "autoDelete": False,
        "vhost": None,
    }
    assert billing["x-queue-arguments"]["x-queue-type"] == "quorum"
    assert billing["x-queue-arguments"]["x-dead-letter-routing-key"] == "billing.dead"
    assert "x-delivery-limit" in billing["x-queue-arguments"]
    assert billing["x-bound-to"] == [{"exchange": "shop", "routingKey": "order.placed"}]
    # Ordered: one queue per partition behind a consistent-hash exchange on the ordering key.
    timeline = channels["timeline"]
    assert timeline["address"] == "timeline.p{partition}"
    assert timeline["parameters"]["partition"]["enum"] == ["0", "1", "2"]
    assert timeline["x-queue-arguments"]["x-single-active-consumer"] is True
    assert timeline["x-ordered"]["partitions"] == ["timeline.p0", "timeline.p1", "timeline.p2"]
    assert timeline["x-ordered"]["hashHeader"] == envelope.ORDERING_KEY_HEADER
    assert timeline["x-ordered"]["hashExchangeBoundTo"] == [
        {"exchange": "shop", "routingKey": "order.*"}
    ]
    assert operations["timeline"]["x-max-age"] == 30
    # Retries: the consumer's own delays and attempts; a retry waits in the outbox, so no
    # channel of the broker's is there for it.
    refunds = operations["refunds"]
    assert refunds["bindings"]["amqp"]["ack"] is True
    assert (refunds["x-max-attempts"], refunds["x-retry-delays"]) == (7, [5.0, 60.0])
    assert "x-retry-via" not in refunds
    assert not [c for c in document["channels"].values() if ".delay." in c["address"]]
    assert operations["billing"]["x-retry-delays"] == [1.0, 10.0]
    assert operations["billing"]["x-max-attempts"] == 4


Topology = tuple[dict[str, Any], dict[str, Any], set[tuple[str, str, str]]]


def broker_topology(fragment: str) -> Topology:
    """The queues (arguments and flags) and exchanges (type and arguments) of the broker whose
    names hold ``fragment``, and the bindings (source, destination, key) into them."""

    def rows(kind: str, *columns: str) -> list[dict[str, Any]]:
        out = rabbitmqctl(f"list_{kind}", "-p", "/", *columns, "--formatter", "json")
        return list(json.loads(out or "[]"))

    def table(arguments: Any) -> dict[str, Any]:  # [[key, type, value], ...]
        return {item[0]: item[-1] for item in arguments or []}

    queues = {
        row["name"]: {
            "arguments": table(row["arguments"]),
            "durable": row["durable"],
            "autoDelete": row["auto_delete"],
        }
        for row in rows("queues", "name", "arguments", "durable", "auto_delete")
        if fragment in row["name"]
    }
    exchanges = {
        row["name"]: {"type": row["type"], "arguments": table(row["arguments"])}
        for row in rows("exchanges", "name", "type", "arguments")
        if fragment in row["name"]
    }
    bindings = {
        (row["source_name"], row["destination_name"], row["routing_key"])
        for row in rows("bindings", "source_name", "destination_name", "routing_key")
        if row["source_name"] and fragment in row["destination_name"]
    }
    return queues, exchanges, bindings


def described_topology(document: dict[str, Any]) -> Topology:
    """What the document says the broker has, in :func:`broker_topology`'s terms."""
    queues: dict[str, Any] = {}
    exchanges: dict[str, Any] = {}
    bindings: set[tuple[str, str, str]] = set()
    for channel in document["channels"].values():
        if "x-queue-arguments" not in channel:
            continue  # a published routing key: not a queue
        queue = channel["bindings"]["amqp"]["queue"]
        ordering = channel.get("x-ordered")
        for name in ordering["partitions"] if ordering else [queue["name"]]:
            queues[name] = {
                "arguments": channel["x-queue-arguments"],
                "durable": queue["durable"],
                "autoDelete": queue["autoDelete"],
            }
            for binding in channel["x-bound-to"]:
                bindings.add((binding["exchange"], name, binding.get("routingKey", "")))
        if ordering:
            exchanges[ordering["hashExchange"]] = {
                "type": ordering["hashExchangeType"],
                "arguments": {"hash-header": ordering["hashHeader"]},
            }
            for binding in ordering["hashExchangeBoundTo"]:
                bindings.add((binding["exchange"], ordering["hashExchange"], binding["routingKey"]))
    return queues, exchanges, bindings


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
@pytest.mark.parametrize("ordered", [False, True], ids=["plain", "ordered"])
def test_the_document_says_what_consume_declares_on_the_broker(
    ns: str, rm_settings: dict[str, Any], queue_type: str, ordered: bool
) -> None:
    """Every queue, exchange, argument and binding of the document, read back from RabbitMQ
    after the topology ``consume`` declares, and nothing else of the consumer's: the document
    describes the broker, not a wish."""
    spec = ConsumerSpec(
        name="c",
        queue=f"rmtest.{ns}.orders",
        handler=handler,
        bindings=("o.placed", "p.#"),
        ordered=ordered,
        retry_delays=(0.5, 3.0),
    )
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": queue_type}):
        connection = broker_connection()
        try:
            declare_topology(connection.channel(), [spec])
        finally:
            if connection.is_open:
                connection.close()
        document = asyncapi_document(title="t", specs=[spec], published={})
    assert problems(document) == []
    queues, exchanges, bindings = broker_topology(ns)
    # Quorum queues' .dead queues (where the broker puts a message past its delivery limit)
    # are named by the x-dead-letter-routing-key of the queues' arguments, not channels.
    dead = {f"{spec.queue}.dead", f"{spec.queue}.dead.kept"} if queue_type == "quorum" else set()
    assert dead <= set(queues)
    expected_queues, expected_exchanges, expected_bindings = described_topology(document)
    assert {n: q for n, q in queues.items() if n not in dead} == expected_queues
    assert {n: x for n, x in exchanges.items() if n != rm_settings["EXCHANGE"]} == (
        expected_exchanges
    )
    assert bindings == expected_bindings


def test_every_header_of_ours_is_in_the_document_and_described() -> None:
    document = asyncapi_document(title="t", specs=[], published={})
    trait = document["components"]["messageTraits"]["reliableMessagingHeaders"]
    listed = trait["headers"]["properties"]
    in_code = {
        value
        for name, value in vars(envelope).items()
        if name.endswith("_HEADER") and isinstance(value, str) and value.startswith("x-rm-")
    } - {envelope.UNDECODABLE_HEADER}
    assert in_code <= set(listed)
    assert {"traceparent", "tracestate", "x-rm-outbox-id", "x-rm-attempt"} <= set(listed)
    assert envelope.UNDECODABLE_HEADER not in listed  # set in-process, never sent
    # A header the code gains needs a line in HEADER_SCHEMAS: the document then says what it is.
    assert [h for h in our_headers() if h not in HEADER_SCHEMAS] == []


def test_the_broker_is_described_without_its_credentials(settings: Any) -> None:
    settings.RELIABLE_MESSAGING = {
        **settings.RELIABLE_MESSAGING,
        "BROKER_URL": "amqps://billing-svc:s3cr%40t@rabbit-1.internal:5671/shop?heartbeat=30;"
        "amqps://billing-svc:s3cr%40t@rabbit-2.internal/shop",
    }
    document = asyncapi_document(title="t", specs=[], published={})
    assert problems(document) == []
    text = render(document)
    assert "s3cr" not in text and "billing-svc" not in text and "heartbeat" not in text
    assert document["servers"] == {
        f"rabbitmq-{n}": {
            "host": f"rabbit-{n}.internal:5671",
            "protocol": "amqps",
            "protocolVersion": "0.9.1",
            "pathname": "/shop",
            "description": "RabbitMQ (BROKER_URL), virtual host 'shop'.",
            "security": [{"$ref": "#/components/securitySchemes/brokerUser"}],
        }
        for n in (1, 2)
    }
    assert document["components"]["securitySchemes"]["brokerUser"]["type"] == "userPassword"


def test_broker_url_describes_another_broker_than_the_settings() -> None:
    """What a CI job whose settings point at its own broker passes to describe production's."""
    out = io.StringIO()
    call_command(
        "asyncapi", broker_url="amqps://prod-user:hunter2@mq.example.internal/orders", stdout=out
    )
    document = json.loads(out.getvalue())
    assert "hunter2" not in out.getvalue() and "prod-user" not in out.getvalue()
    assert document["servers"]["rabbitmq"]["host"] == "mq.example.internal:5671"
    vhosts = {
        channel["bindings"]["amqp"]["queue"]["vhost"]
        for channel in document["channels"].values()
        if channel["bindings"]["amqp"]["is"] == "queue"
    }
    assert vhosts == {"orders"}


def test_the_output_is_deterministic_and_yaml_says_the_same(tmp_path: Path) -> None:
    first, second = io.StringIO(), io.StringIO()
    call_command("asyncapi", stdout=first)
    call_command("asyncapi", stdout=second)
    assert first.getvalue() == second.getvalue()
    yaml = pytest.importorskip("yaml")
    call_command("asyncapi", output=str(tmp_path / "doc.yaml"), stderr=io.StringIO())
    assert yaml.safe_load((tmp_path / "doc.yaml").read_text()) == json.loads(first.getvalue())


def test_check_exits_0_when_the_file_says_what_the_code_says_and_1_with_a_diff(
    tmp_path: Path,
) -> None:
    path = tmp_path / "asyncapi.json"
    call_command("asyncapi", output=str(path), stderr=io.StringIO())
    out = io.StringIO()
    call_command("asyncapi", check=str(path), stdout=out)
    assert "is up to date" in out.getvalue()
    # Formatting is not content: the same document indented otherwise passes.
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    call_command("asyncapi", check=str(path), stdout=io.StringIO())

    stale = json.loads(path.read_text())
    queue = next(iter(stale["channels"].values()))
    queue["address"] = "renamed.queue"
    path.write_text(json.dumps(stale))
    out = io.StringIO()
    with pytest.raises(CommandError) as raised:
        call_command("asyncapi", check=str(path), stdout=out)
    assert raised.value.returncode == 1
    assert "--output" in str(raised.value)
    assert '-      "address": "renamed.queue"' in out.getvalue()
    assert len(out.getvalue().splitlines()) <= 41

    with pytest.raises(CommandError) as raised:
        call_command("asyncapi", check=str(tmp_path / "missing.json"), stdout=io.StringIO())
    assert raised.value.returncode == 1 and "does not exist" in str(raised.value)


def run_demo_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RM_BROKER_URL", "DATABASE_URL")}
    env["DJANGO_SETTINGS_MODULE"] = "demo_project.settings"
    return subprocess.run(
        [sys.executable, "manage.py", "asyncapi", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_the_demos_committed_document_is_current_valid_and_round_trips(tmp_path: Path) -> None:
    result = run_demo_command("--check", str(DEMO_DOCUMENT))
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(DEMO_DOCUMENT.read_text())
    assert problems(document) == []
    channels = {channel["address"] for channel in document["channels"].values()}
    assert {"shop.billing", "shop.shipping", "shop.timeline.p{partition}"} <= channels

    stale = tmp_path / "asyncapi.json"
    stale.write_text(DEMO_DOCUMENT.read_text().replace('"shop.billing"', '"shop.billing2"'))
    result = run_demo_command("--check", str(stale))
    assert result.returncode == 1
    assert "shop.billing2" in result.stdout and "manage.py asyncapi --output" in result.stderr
    # Last: the version matrix's sessions have no asyncapi3, and skip only this.
    assert_round_trips(document)


def test_the_schema_check_fails_a_document_that_breaks_the_specification() -> None:
    """The validator is no rubber stamp: the official schema's rules reach the bindings."""
    document = asyncapi_document(title="t", specs=registry.all(), published={})
    channel = next(c for c in document["channels"].values() if "x-queue-arguments" in c)
    channel["bindings"]["amqp"]["is"] = "exchange"
    assert problems(document)


def test_the_docs_show_the_demos_document_as_it_is() -> None:
    """docs/contracts.md's excerpt of the demo's document is the committed document's."""
    page = (ROOT / "docs" / "contracts.md").read_text()
    block = page.split("<!-- tested: demo_billing -->\n```json\n", 1)[1].split("```", 1)[0]
    document = json.loads(DEMO_DOCUMENT.read_text())
    assert json.loads(block) == document["channels"]["queue_shop_billing"]
