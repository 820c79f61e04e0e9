"""Declared payload types as pure logic: what a contract accepts and refuses, the field paths of
its errors (never the values), its JSON form and schema, for pydantic v2 models and for the
stdlib dataclasses and TypedDicts checked without pydantic."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import pydantic
import pytest

from reliable_messaging import PermanentError
from reliable_messaging.contracts import (
    Contract,
    ContractError,
    PayloadInvalid,
    contract_of,
    published,
    published_registry,
    publishes,
)
from reliable_messaging.core.registry import ConsumerRegistry, consumer

SECRET = "card-4111-1111"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    quantity: int = 1


@dataclasses.dataclass(frozen=True)
class Order:
    order_id: int
    amount: decimal.Decimal
    lines: list[Line]
    placed_at: dt.datetime | None = None
    colour: Colour = Colour.RED
    kind: Literal["retail", "trade"] = "retail"
    reference: uuid.UUID | None = None
    tags: dict[str, str] = dataclasses.field(default_factory=dict)


class OrderDict(TypedDict):
    order_id: int
    note: NotRequired[str]
    lines: list[Line]


class LineModel(pydantic.BaseModel):
    sku: str
    quantity: int = 1


class OrderModel(pydantic.BaseModel):
    order_id: int
    amount: decimal.Decimal
    lines: list[LineModel]


def errors_of(contract: Contract, data: Any) -> list[dict[str, str]]:
    with pytest.raises(PayloadInvalid) as caught:
        contract.validate(data)
    return caught.value.errors


# --------------------------------------------------------------------------- stdlib types


def test_a_dataclass_payload_becomes_the_typed_object() -> None:
    order = contract_of(Order).validate(
        {
            "order_id": 7,
            "amount": "9.99",
            "lines": [{"sku": "a"}, {"sku": "b", "quantity": 2}],
            "placed_at": "2026-11-29T10:00:00+00:00",
            "colour": "blue",
            "reference": "12345678-1234-5678-1234-567812345678",
            "unknown": "ignored, as a newer producer's field is",
        }
    )
    assert order == Order(
        order_id=7,
        amount=decimal.Decimal("9.99"),
        lines=[Line("a"), Line("b", 2)],
        placed_at=dt.datetime(2026, 11, 29, 10, tzinfo=dt.UTC),
        colour=Colour.BLUE,
        reference=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    )


def test_the_errors_name_every_field_by_its_path_and_never_its_value() -> None:
    errors = errors_of(
        contract_of(Order),
        {"order_id": SECRET, "amount": SECRET, "lines": [{"sku": "a"}, {"quantity": SECRET}]},
    )
    assert errors == [
        {"path": "order_id", "message": "Input should be an integer"},
        {"path": "amount", "message": "Input should be a valid decimal"},
        {"path": "lines[1].sku", "message": "Field required"},
        {"path": "lines[1].quantity", "message": "Input should be an integer"},
    ]
    with pytest.raises(PayloadInvalid) as caught:
        contract_of(Order).validate({"order_id": SECRET, "amount": 1, "lines": []})
    assert SECRET not in str(caught.value)
    assert "order_id: Input should be an integer" in str(caught.value)


def test_a_payload_that_is_no_object_is_one_error_at_the_top() -> None:
    assert errors_of(contract_of(Order), [1, 2]) == [
        {"path": "", "message": "Input should be an object"}
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("order_id", True, "Input should be an integer"),  # a bool is no integer in JSON
        ("amount", "NaN", "Input should be a finite number"),
        ("amount", False, "Decimal input should be a number or a string"),
        ("placed_at", "yesterday", "Input should be a valid date-time"),
        ("colour", "green", "Input should be 'red' or 'blue'"),
        ("kind", "wholesale", "Input should be 'retail' or 'trade'"),
        ("reference", "not-a-uuid", "Input should be a valid uuid"),
        ("tags", {"a": 1}, "Input should be a string"),
        ("lines", {"sku": "a"}, "Input should be a valid list"),
    ],
)
def test_each_kind_of_field_refuses_what_it_cannot_hold(
    field: str, value: Any, message: str
) -> None:
    payload = {"order_id": 1, "amount": "1", "lines": [], field: value}
    errors = errors_of(contract_of(Order), payload)
    assert [e["message"] for e in errors] == [message]
    assert errors[0]["path"].startswith(field)


def test_a_typed_dict_keeps_only_its_keys_and_may_miss_the_not_required() -> None:
    contract = contract_of(OrderDict)
    assert contract.validate({"order_id": 1, "lines": [], "extra": 2}) == {
        "order_id": 1,
        "lines": [],
    }
    assert errors_of(contract, {"note": 3}) == [
        {"path": "order_id", "message": "Field required"},
        {"path": "note", "message": "Input should be a string"},
        {"path": "lines", "message": "Field required"},
    ]


def test_the_json_form_is_what_the_message_encoder_writes() -> None:
    contract = contract_of(Order)
    order = Order(
        order_id=1,
        amount=decimal.Decimal("9.90"),
        lines=[Line("a")],
        placed_at=dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    )
    as_json = contract.to_json(order)
    assert as_json == {
        "order_id": 1,
        "amount": "9.90",
        "lines": [{"sku": "a", "quantity": 1}],
        "placed_at": "2026-01-02T03:04:05+00:00",
        "colour": "red",
        "kind": "retail",
        "reference": None,
        "tags": {},
    }
    assert contract.validate(json.loads(json.dumps(as_json))) == order
    # An object of the type is checked in its JSON form, as a consumer will see it.
    assert contract.validate(order) == order


def test_the_json_schema_of_a_dataclass_puts_nested_types_under_defs() -> None:
    schema = contract_of(Order).json_schema(ref_template="#/components/schemas/{model}")
    assert schema["title"] == "Order"
    assert schema["required"] == ["order_id", "amount", "lines"]
    assert schema["properties"]["lines"] == {
        "type": "array",
        "items": {"$ref": "#/components/schemas/Line"},
    }
    assert schema["properties"]["placed_at"] == {
        "anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]
    }
    assert schema["$defs"]["Line"]["required"] == ["sku"]


def test_what_the_stdlib_path_cannot_check_is_refused_at_the_declaration() -> None:
    @dataclasses.dataclass
    class WithSet:
        ids: set[int]

    @dataclasses.dataclass
    class Node:
        children: list[Node]

    with pytest.raises(ContractError, match="not supported without pydantic"):
        contract_of(WithSet)
    with pytest.raises(ContractError, match=r"cannot be read|recursive"):
        contract_of(Node)
    with pytest.raises(ContractError, match="pydantic v2 model"):
        contract_of(dict)


def test_a_dataclass_that_refuses_itself_is_a_value_error_at_its_path() -> None:
    @dataclasses.dataclass
    class Positive:
        amount: int

        def __post_init__(self) -> None:
            if self.amount <= 0:
                raise ValueError("amount must be positive")

    assert errors_of(contract_of(Positive), {"amount": -1}) == [
        {"path": "", "message": "Value error, amount must be positive"}
    ]


# --------------------------------------------------------------------------- pydantic


def test_a_pydantic_model_validates_with_its_paths_and_no_input() -> None:
    contract = contract_of(OrderModel)
    assert contract.name == "OrderModel"
    order = contract.validate({"order_id": 1, "amount": "2.50", "lines": [{"sku": "x"}]})
    assert order == OrderModel(
        order_id=1, amount=decimal.Decimal("2.50"), lines=[LineModel(sku="x")]
    )
    assert contract.to_json(order) == {
        "order_id": 1,
        "amount": "2.50",
        "lines": [{"sku": "x", "quantity": 1}],
    }
    with pytest.raises(PayloadInvalid) as caught:
        contract.validate({"order_id": SECRET, "amount": "1", "lines": [{"quantity": 1}]})
    assert caught.value.errors == [
        {
            "path": "order_id",
            "message": "Input should be a valid integer, unable to parse string as an integer",
        },
        {"path": "lines[0].sku", "message": "Field required"},
    ]
    assert SECRET not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    schema = contract.json_schema()
    assert schema["title"] == "OrderModel"
    assert schema["properties"]["lines"]["items"] == {"$ref": "#/$defs/LineModel"}


def test_a_model_built_without_validation_is_checked_again() -> None:
    sneaky = OrderModel.model_construct(order_id="x", amount=decimal.Decimal(1), lines=[])
    with pytest.raises(PayloadInvalid, match="order_id"):
        contract_of(OrderModel).validate(sneaky)


def test_payload_invalid_is_a_permanent_error_and_caps_its_errors() -> None:
    exc = PayloadInvalid("T", [{"path": f"x[{i}]", "message": "bad"} for i in range(60)])
    assert isinstance(exc, PermanentError)
    assert len(exc.errors) == 50
    assert str(exc).startswith("the payload does not match T (60 errors):")
    assert str(exc).endswith("... and 10 more")


# --------------------------------------------------------------------------- declarations


def test_publishes_declares_one_type_per_routing_key() -> None:
    with published_registry.isolated():
        publishes("order.placed", OrderModel)

        @publishes("order.shipped")
        @dataclasses.dataclass
        class Shipped:
            order_id: int

        publishes("order.placed", OrderModel)  # the same module imported again
        assert list(published()) == ["order.placed", "order.shipped"]
        assert published()["order.shipped"].name == "Shipped"
        with pytest.raises(ContractError, match="declared with OrderModel and with Order"):
            publishes("order.placed", Order)
        with pytest.raises(ContractError, match="not a pattern"):
            publishes("order.*", Order)
    assert "order.shipped" not in published()


def test_consumer_payload_sets_the_specs_contract() -> None:
    registry = ConsumerRegistry()

    @consumer("q.orders", bindings=["order.placed"], payload=OrderModel, registry=registry)
    def handle(message: Any) -> None: ...

    @consumer("q.plain", registry=registry)
    def plain(message: Any) -> None: ...

    payloads = {spec.queue: spec.payload for spec in registry}
    assert payloads == {"q.orders": contract_of(OrderModel), "q.plain": None}
    with pytest.raises(ContractError):
        consumer("q.bad", payload=int, registry=registry)


# --------------------------------------------------------------------------- without pydantic

WITHOUT_PYDANTIC = """
import dataclasses, sys
sys.modules["pydantic"] = None
from reliable_messaging.contracts import PayloadInvalid, contract_of

@dataclasses.dataclass
class Paid:
    order_id: int
    amount: str = "0"

contract = contract_of(Paid)
print(contract.validate({"order_id": 3}))
try:
    contract.validate({"order_id": "three"})
except PayloadInvalid as exc:
    print(exc.errors)
try:
    contract_of(object)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_dataclasses_are_checked_without_pydantic_installed() -> None:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYDANTIC],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Paid(order_id=3, amount='0')"
    assert lines[1] == "[{'path': 'order_id', 'message': 'Input should be an integer'}]"
    assert lines[2].startswith("ContractError")
    assert 'pip install "reliable-messaging[contracts]"' in lines[2]


def test_a_validator_that_fails_otherwise_is_an_invalid_payload_without_its_text() -> None:
    class Picky(pydantic.BaseModel):
        code: str

        @pydantic.field_validator("code")
        @classmethod
        def look_up(cls, value: str) -> str:
            return {"known": value}[value]  # KeyError quoting the value

    @dataclasses.dataclass
    class Strict:
        code: str

        def __post_init__(self) -> None:
            raise LookupError(self.code)

    for contract in (contract_of(Picky), contract_of(Strict)):
        with pytest.raises(PayloadInvalid) as caught:
            contract.validate({"code": SECRET})
        assert caught.value.errors[0]["path"] == ""
        assert "the type's own validation raised" in caught.value.errors[0]["message"]
        assert SECRET not in str(caught.value)
