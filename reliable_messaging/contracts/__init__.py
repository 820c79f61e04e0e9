"""Message contracts: payload types declared once, checked where a message is published and
where it is consumed (``docs/contracts.md``).

Public names::

    from reliable_messaging.contracts import publishes, published, Contract, PayloadInvalid

- ``publishes(routing_key, Type)``: ``publish(routing_key, ...)`` validates against ``Type``;
- ``@consumer(..., payload=Type)``: the handler's ``message.payload`` is a ``Type``, and a
  message that does not match is a dead letter ``invalid_payload`` before the handler runs;
- ``contract_of(Type)``: the :class:`Contract` of a type; ``published()``: every declared key.
"""

from __future__ import annotations

from ..core.contracts import Contract, ContractError, PayloadInvalid, contract_of
from .declarations import (
    consumer_payload_errors,
    contract_for,
    published,
    published_registry,
    publishes,
)

__all__ = [
    "Contract",
    "ContractError",
    "PayloadInvalid",
    "consumer_payload_errors",
    "contract_for",
    "contract_of",
    "published",
    "published_registry",
    "publishes",
]
