"""What the contract tests share: a consumer whose handler records what it was given, run by a
ConsumerService in a thread of this process against the real broker and database."""

from __future__ import annotations

import threading
from typing import Any

from reliable_messaging import Message
from reliable_messaging.contracts import contract_of
from reliable_messaging.core.outcomes import Acknowledge, Outcome
from reliable_messaging.core.registry import ConsumerSpec
from tests.support import wait_until


class Handled:
    """The handlers' record (what each was given) and the service's outcomes, by consumer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.payloads: dict[str, list[Any]] = {}
        self.outcomes: dict[str, list[tuple[str | None, Outcome]]] = {}

    def on_outcome(self, spec: ConsumerSpec, delivery: Any, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.setdefault(spec.name, []).append((delivery.message_id, outcome))

    def results(self, name: str) -> dict[str | None, list[str]]:
        """message_id → what became of each of its deliveries (``processed``, ``dead_lettered``
        with its reason, or the outcome's class name)."""
        found: dict[str | None, list[str]] = {}
        with self.lock:
            for message_id, outcome in self.outcomes.get(name, []):
                if isinstance(outcome, Acknowledge):
                    word = str(outcome.result)
                    if outcome.reason:
                        word += f":{outcome.reason}"
                else:
                    word = type(outcome).__name__
                found.setdefault(message_id, []).append(word)
        return found

    def given(self, name: str) -> list[Any]:
        with self.lock:
            return list(self.payloads.get(name, []))

    def wait(self, name: str, count: int, timeout: float = 30) -> None:
        def enough() -> bool:
            with self.lock:
                return len(self.outcomes.get(name, [])) >= count

        wait_until(enough, timeout=timeout, message=f"{count} outcome(s) for {name}")


def recording_spec(
    ns: str,
    label: str,
    handled: Handled,
    payload: Any,
    bindings: tuple[str, ...] = ("order.*",),
    **options: Any,
) -> ConsumerSpec:
    """A consumer named and queued ``<ns>.<label>`` declaring ``payload`` (and ``options``, such
    as ``ordered=True``); its handler records ``message.payload`` (the typed object)."""
    name = f"{ns}.{label}"

    def handler(message: Message) -> None:
        with handled.lock:
            handled.payloads.setdefault(name, []).append(message.payload)

    return ConsumerSpec(
        name=name,
        queue=name,
        handler=handler,
        bindings=bindings,
        payload=contract_of(payload) if payload is not None else None,
        **options,
    )
