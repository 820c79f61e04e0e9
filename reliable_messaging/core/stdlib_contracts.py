"""Payload contracts of stdlib types, a dataclass or a ``TypedDict``, checked without pydantic;
the annotations understood are listed in ``docs/contracts.md``."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import math
import types
import typing
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

_Location = tuple[str | int, ...]
_INVALID = object()


class UnsupportedType(TypeError):
    """An annotation this module cannot check (the declaration is refused)."""


# Wrappers whose first argument is the field's type (Annotated's metadata, a TypedDict's keys).
_WRAPPERS = (typing.Annotated, typing.NotRequired, typing.Required)

_FORMATS: dict[Any, str] = {
    dt.datetime: "date-time",
    dt.date: "date",
    dt.time: "time",
    uuid.UUID: "uuid",
}


def _is_object_type(tp: Any) -> bool:
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or is_typeddict(tp))


def _hints(tp: Any) -> dict[str, Any]:
    try:
        return get_type_hints(tp, include_extras=True)
    except Exception as exc:
        raise UnsupportedType(f"the annotations of {tp.__name__} cannot be read: {exc}") from exc


class _Validation:
    """One validation: the errors found so far, with their paths. Its types are ones
    :func:`json_schema` accepted (``contract_of`` builds the schema first), so an annotation it
    cannot check is refused there, not here."""

    def __init__(self) -> None:
        self.errors: list[tuple[_Location, str]] = []

    def fail(self, location: _Location, message: str) -> Any:
        self.errors.append((location, message))
        return _INVALID

    def value(self, tp: Any, data: Any, at: _Location) -> Any:
        origin, args = get_origin(tp), get_args(tp)
        if tp is Any or tp is object:
            return data
        if origin in _WRAPPERS:
            return self.value(args[0], data, at)
        if tp is None or tp is type(None):
            return None if data is None else self.fail(at, "Input should be null")
        if origin is Union or origin is types.UnionType:
            return self._union(args, data, at)
        if origin is Literal:
            if any(data == choice and type(data) is type(choice) for choice in args):
                return data
            return self.fail(at, "Input should be " + " or ".join(repr(a) for a in args))
        if tp is bool:
            return data if isinstance(data, bool) else self.fail(at, "Input should be a boolean")
        if tp is int:
            if isinstance(data, int) and not isinstance(data, bool):
                return data
            return self.fail(at, "Input should be an integer")
        if tp is float:
            if isinstance(data, int | float) and not isinstance(data, bool):
                return float(data)
            return self.fail(at, "Input should be a number")
        if tp is str:
            return data if isinstance(data, str) else self.fail(at, "Input should be a string")
        if tp is decimal.Decimal:
            return self._decimal(data, at)
        if tp in _FORMATS:
            return self._formatted(tp, data, at)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            try:
                return tp(data)
            except ValueError:
                allowed = " or ".join(repr(member.value) for member in tp)
                return self.fail(at, f"Input should be {allowed}")
        if tp in (list, tuple) or origin in (list, tuple, Sequence):
            return self._items(tp, origin, args, data, at)
        if tp is dict or origin in (dict, Mapping):
            return self._mapping(args, data, at)
        return self.object(tp, data, at)  # a dataclass or a TypedDict

    def _union(self, args: tuple[Any, ...], data: Any, at: _Location) -> Any:
        if data is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            attempt = _Validation()
            result = attempt.value(option, data, at)
            if not attempt.errors:
                return result
        if len(options) == 1:
            return self.value(options[0], data, at)  # its own errors, which say more
        names = ", ".join(getattr(o, "__name__", repr(o)) for o in options)
        return self.fail(at, f"Input should match one of: {names}")

    def _decimal(self, data: Any, at: _Location) -> Any:
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            return self.fail(at, "Decimal input should be a number or a string")
        if isinstance(data, float) and not math.isfinite(data):
            return self.fail(at, "Input should be a finite number")
        try:
            number = decimal.Decimal(str(data).strip())
        except decimal.InvalidOperation:
            return self.fail(at, "Input should be a valid decimal")
        if not number.is_finite():
            return self.fail(at, "Input should be a finite number")
        return number

    def _formatted(self, tp: Any, data: Any, at: _Location) -> Any:
        label = _FORMATS[tp]
        if not isinstance(data, str):
            return self.fail(at, f"Input should be a {label} string")
        try:
            if tp is uuid.UUID:
                return uuid.UUID(data)
            return tp.fromisoformat(data)
        except ValueError:
            return self.fail(at, f"Input should be a valid {label}")

    def _items(self, tp: Any, origin: Any, args: tuple[Any, ...], data: Any, at: _Location) -> Any:
        if not isinstance(data, list | tuple):
            return self.fail(at, "Input should be a valid list")
        item = args[0] if args else Any
        values = [self.value(item, element, (*at, i)) for i, element in enumerate(data)]
        return tuple(values) if (tp is tuple or origin is tuple) else values

    def _mapping(self, args: tuple[Any, ...], data: Any, at: _Location) -> Any:
        if not isinstance(data, Mapping):
            return self.fail(at, "Input should be a valid dictionary")
        item = args[1] if args else Any
        return {key: self.value(item, value, (*at, key)) for key, value in data.items()}

    def object(self, tp: Any, data: Any, at: _Location) -> Any:
        """A dataclass's or a TypedDict's object from a JSON object."""
        if not isinstance(data, Mapping):
            return self.fail(at, "Input should be an object")
        hints = _hints(tp)
        values: dict[str, Any] = {}
        before = len(self.errors)
        for name, required in _fields(tp, hints):
            if name not in data:
                if required:
                    self.fail((*at, name), "Field required")
                continue
            values[name] = self.value(hints[name], data[name], (*at, name))
        if len(self.errors) > before:
            return _INVALID
        if is_typeddict(tp):
            return values
        try:
            return tp(**values)
        except (TypeError, ValueError) as exc:  # its __post_init__ refused it
            return self.fail(at, f"Value error, {exc}")


def _fields(tp: Any, hints: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each field's name and whether it is required."""
    if is_typeddict(tp):
        # Python 3.11 reads NotRequired in a string annotation (``from __future__ import
        # annotations``) into __required_keys__ wrongly: the resolved hint says it.
        def required(name: str) -> bool:
            wrapper = get_origin(hints[name])
            if wrapper in (typing.NotRequired, typing.Required):
                return wrapper is typing.Required
            return name in tp.__required_keys__

        return [(name, required(name)) for name in hints]
    missing = dataclasses.MISSING
    return [
        (f.name, f.default is missing and f.default_factory is missing)
        for f in dataclasses.fields(tp)
        if f.init
    ]


class _Schema:
    """The JSON Schema of a stdlib type, nested types under ``$defs``."""

    def __init__(self, ref_template: str) -> None:
        self.ref_template = ref_template
        self.defs: dict[str, Any] = {}
        self.building: set[Any] = set()

    def of(self, tp: Any) -> dict[str, Any]:
        origin, args = get_origin(tp), get_args(tp)
        if tp is Any or tp is object:
            return {}
        if origin in _WRAPPERS:
            return self.of(args[0])
        if tp is None or tp is type(None):
            return {"type": "null"}
        if origin is Union or origin is types.UnionType:
            return {"anyOf": [self.of(a) for a in args]}
        if origin is Literal:
            return {"enum": list(args)}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if tp in simple:
            return {"type": simple[tp]}
        if tp is decimal.Decimal:
            return {"anyOf": [{"type": "number"}, {"type": "string"}]}
        if tp in _FORMATS:
            return {"type": "string", "format": _FORMATS[tp]}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return {"enum": [member.value for member in tp], "title": tp.__name__}
        if tp in (list, tuple) or origin in (list, tuple, Sequence):
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                raise UnsupportedType(f"{tp!r}: only tuple[X, ...] is supported without pydantic")
            return {"type": "array", "items": self.of(args[0]) if args else {}}
        if tp is dict or origin in (dict, Mapping):
            if args and args[0] is not str:
                raise UnsupportedType("only dict[str, X] is supported: JSON keys are strings")
            return {"type": "object", "additionalProperties": self.of(args[1]) if args else {}}
        if _is_object_type(tp):
            if tp.__name__ not in self.defs:
                self.defs[tp.__name__] = self.object(tp)
            return {"$ref": self.ref_template.format(model=tp.__name__)}
        raise UnsupportedType(f"a field of type {tp!r} is not supported without pydantic")

    def object(self, tp: Any) -> dict[str, Any]:
        if tp in self.building:
            raise UnsupportedType(f"{tp.__name__} is recursive: declare it with pydantic")
        self.building.add(tp)
        hints = _hints(tp)
        fields = _fields(tp, hints)
        schema: dict[str, Any] = {
            "title": tp.__name__,
            "type": "object",
            "properties": {name: self.of(hints[name]) for name, _ in fields},
        }
        self.building.discard(tp)
        required = [name for name, needed in fields if needed]
        if required:
            schema["required"] = required
        return schema


def jsonable(value: Any) -> Any:
    """An object of a stdlib payload type as JSON (Decimal and UUID as strings, dates in ISO
    8601), as ``MessageJSONEncoder`` writes them."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return value


def validate(tp: Any, data: Any) -> tuple[Any, list[tuple[_Location, str]]]:
    """``data`` (decoded JSON, or an object of the dataclass ``tp``) as an object of ``tp``,
    and the errors found (each field's location and what is wrong; the object is None then)."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = jsonable(data)  # checked in its JSON form, as a consumer will see it
    validation = _Validation()
    result = validation.object(tp, data, ())
    return (None if validation.errors else result), validation.errors


def json_schema(tp: Any, ref_template: str) -> dict[str, Any]:
    """The JSON Schema of the dataclass or TypedDict ``tp``."""
    schema = _Schema(ref_template)
    top = schema.object(tp)
    if schema.defs:
        top["$defs"] = schema.defs
    return top
