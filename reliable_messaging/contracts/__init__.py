"""Message contracts: payload types declared once, checked where a message is published
(``publishes``) and where it is consumed (``@consumer(..., payload=Type)``); see
``docs/contracts.md``."""

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
