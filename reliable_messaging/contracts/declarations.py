"""The routing keys the project publishes, each with its declared payload type:
``publishes("order.placed", OrderPlaced)`` in an app's ``contracts.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from ..core.contracts import Contract, ContractError, PayloadInvalid, contract_of
from ..core.registry import KeyedRegistry, registry

T = TypeVar("T")


class PublishedRegistry(KeyedRegistry[Contract]):
    """Routing key → contract, one declaration per key."""

    def declare(self, routing_key: str, contract: Contract) -> None:
        if not isinstance(routing_key, str) or not routing_key.strip():
            raise ContractError("publishes(routing_key, ...) needs a non-empty routing key")
        if "*" in routing_key.split(".") or "#" in routing_key.split("."):
            raise ContractError(
                f"publishes({routing_key!r}): a published message has one routing key, not a "
                f"pattern; declare each key"
            )
        with self._lock:
            existing = self._entries.get(routing_key)
            if existing is not None and existing != contract:
                raise ContractError(
                    f"routing key {routing_key!r} is declared with {existing.name} and with "
                    f"{contract.name}: one key carries one payload type (a new shape is a new "
                    f"key, or a field added with a default: docs/contracts.md)"
                )
            self._entries[routing_key] = contract

    def get(self, routing_key: str) -> Contract | None:
        return self._entries.get(routing_key)

    def all(self) -> dict[str, Contract]:
        return dict(sorted(self._entries.items()))


published_registry = PublishedRegistry()


@overload
def publishes(routing_key: str) -> Callable[[type[T]], type[T]]: ...
@overload
def publishes(routing_key: str, payload_type: type[T]) -> type[T]: ...
def publishes(routing_key: str, payload_type: Any = None) -> Any:
    """Declare that messages published with ``routing_key`` carry ``payload_type`` (a pydantic
    v2 model, a dataclass or a TypedDict); as a class decorator without ``payload_type``."""

    def declare(tp: type[T]) -> type[T]:
        published_registry.declare(routing_key, contract_of(tp))
        return tp

    return declare if payload_type is None else declare(payload_type)


def published() -> dict[str, Contract]:
    """Routing key → contract of every declared published message, sorted by key."""
    return published_registry.all()


def contract_for(routing_key: str) -> Contract | None:
    """The contract ``publish(routing_key, ...)`` checks, None when the key is not declared."""
    return published_registry.get(routing_key)


def consumer_payload_errors(consumer: str, payload: Any) -> list[dict[str, str]] | None:
    """What is wrong with ``payload`` for the registered consumer named ``consumer`` (the
    admin's view of a dead letter and of an edit): None when that consumer declares no payload
    type (or is not registered here), an empty list when the payload matches it."""
    try:
        contract = registry.get(consumer).payload
    except KeyError:
        return None
    if contract is None:
        return None
    try:
        contract.validate(payload)
    except PayloadInvalid as exc:
        return exc.errors
    return []
