"""Declared payload types: a :class:`Contract` validates a JSON payload against a pydantic v2
model, a dataclass or a ``TypedDict``, and gives its JSON Schema; its errors name fields, never
values (``docs/contracts.md``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, is_dataclass
from typing import TYPE_CHECKING, Any, is_typeddict

from ..exceptions import PermanentError, ReliableMessagingError
from . import stdlib_contracts
from .envelope import encode_payload

if TYPE_CHECKING:
    from pydantic import ValidationError

# The JSON pointer template of a nested type's definition, as pydantic writes it.
DEFAULT_REF_TEMPLATE = "#/$defs/{model}"
# Errors kept in a PayloadInvalid: a payload of ten thousand bad items stays readable.
MAX_ERRORS = 50


class ContractError(ReliableMessagingError):
    """A payload type cannot be declared (an unsupported type or field annotation, or a
    routing key declared twice with different types)."""

    default_message = "invalid payload declaration"


class PayloadInvalid(PermanentError):
    """A payload does not match its declared type; ``errors``: one ``{"path", "message"}`` per
    problem, never the value. A :class:`~reliable_messaging.PermanentError`."""

    def __init__(self, contract: str, errors: list[dict[str, str]]) -> None:
        self.contract = contract
        self.errors = errors[:MAX_ERRORS]
        more = len(errors) - len(self.errors)
        lines = [f"{error['path'] or '(payload)'}: {error['message']}" for error in self.errors]
        if more:
            lines.append(f"... and {more} more")
        count = f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
        super().__init__(f"the payload does not match {contract} ({count}):\n" + "\n".join(lines))


def field_path(location: tuple[str | int, ...] | list[str | int]) -> str:
    """``("items", 0, "sku")`` as ``"items[0].sku"``."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


@dataclass(frozen=True)
class Contract(ABC):
    """A declared payload type. Two contracts of the same type are equal."""

    type: Any

    @property
    def name(self) -> str:
        """The type's name (``OrderPlaced``)."""
        return str(getattr(self.type, "__name__", repr(self.type)))

    @abstractmethod
    def validate(self, data: Any) -> Any:
        """The typed object from decoded JSON (or an object of the type, checked again);
        raises :class:`PayloadInvalid`."""

    @abstractmethod
    def to_json(self, obj: Any) -> Any:
        """``obj`` (of the type) as a JSON-able value: what is published."""

    @abstractmethod
    def json_schema(self, ref_template: str = DEFAULT_REF_TEMPLATE) -> dict[str, Any]:
        """The payload's JSON Schema; nested types under ``$defs``, referred to by
        ``ref_template`` (``{model}`` is replaced by the type's name)."""

    def encode(self, obj: Any) -> bytes:
        """``obj`` (of the type) as the message's UTF-8 JSON body: ``to_json``, encoded as
        ``publish()`` encodes any payload."""
        return encode_payload(self.to_json(obj))


class PydanticContract(Contract):
    """A pydantic v2 model, validated in lax mode (extra fields ignored) through the model's
    own validator and serializer, which saves the frames ``model_validate`` adds
    (``docs/contracts.md``)."""

    def validate(self, data: Any) -> Any:
        if isinstance(data, self.type):
            # Built with model_construct(), or changed since: checked in its JSON form.
            data = data.model_dump(mode="json", warnings=False)
        try:
            return self.type.__pydantic_validator__.validate_python(data)
        except _pydantic_validation_error() as exc:
            raise PayloadInvalid(
                self.name,
                [
                    # Only the location and the message: each error's "input" holds the value.
                    {"path": field_path(error["loc"]), "message": error["msg"]}
                    for error in exc.errors()
                ],
            ) from None  # the cause's text would show the values
        except Exception as exc:  # noqa: BLE001 - a validator of the model's own failed
            raise _validator_failed(self.name, exc) from None

    def to_json(self, obj: Any) -> Any:
        return obj.model_dump(mode="json")

    def encode(self, obj: Any) -> bytes:
        # pydantic's own serializer writes the same JSON (Decimal and UUID as text, dates in
        # ISO 8601) as UTF-8 bytes, without a dict or a str in between.
        return bytes(self.type.__pydantic_serializer__.to_json(obj))

    def json_schema(self, ref_template: str = DEFAULT_REF_TEMPLATE) -> dict[str, Any]:
        return dict(self.type.model_json_schema(ref_template=ref_template))


def _pydantic_validation_error() -> type[ValidationError]:
    """pydantic's ``ValidationError`` (imported only once a pydantic contract's check fails)."""
    from pydantic import ValidationError

    return ValidationError


class StdlibContract(Contract):
    """A dataclass or a ``TypedDict``, checked by :mod:`.stdlib_contracts` (also when pydantic
    is installed: a service's checks do not change with what else is installed)."""

    def validate(self, data: Any) -> Any:
        try:
            result, errors = stdlib_contracts.validate(self.type, data)
        except Exception as exc:  # noqa: BLE001 - the dataclass's __post_init__ failed
            raise _validator_failed(self.name, exc) from None
        if errors:
            raise PayloadInvalid(
                self.name, [{"path": field_path(at), "message": text} for at, text in errors]
            )
        return result

    def to_json(self, obj: Any) -> Any:
        return stdlib_contracts.jsonable(obj)

    def json_schema(self, ref_template: str = DEFAULT_REF_TEMPLATE) -> dict[str, Any]:
        try:
            return stdlib_contracts.json_schema(self.type, ref_template)
        except stdlib_contracts.UnsupportedType as exc:
            raise ContractError(f"{self.name}: {exc}") from None


def _validator_failed(contract: str, exc: Exception) -> PayloadInvalid:
    """A validator of the type's own raised something other than a validation error: the
    payload cannot pass, now or on a retry. Its type only: its text may quote the value."""
    return PayloadInvalid(
        contract,
        [{"path": "", "message": f"the type's own validation raised {type(exc).__name__}"}],
    )


def _is_pydantic_model(tp: Any) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:
        return False
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def contract_of(tp: Any) -> Contract:
    """The contract of ``tp``: a pydantic v2 model, a dataclass or a ``TypedDict`` (or a
    :class:`Contract`, returned as it is); anything else raises :class:`ContractError`."""
    if isinstance(tp, Contract):
        return tp
    if _is_pydantic_model(tp):
        return PydanticContract(tp)
    if isinstance(tp, type) and (is_dataclass(tp) or is_typeddict(tp)):
        contract = StdlibContract(tp)
        contract.json_schema()  # an annotation it cannot check fails here, at the declaration
        return contract
    raise ContractError(
        f"{tp!r} cannot be a payload type: declare a pydantic v2 model (pip install "
        f'"reliable-messaging[contracts]"), a dataclass or a TypedDict'
    )
