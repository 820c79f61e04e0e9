"""The routing-key stage: a message that matches none of its consumer's bindings is a dead
letter (it reached the queue some other way; the consumer never asked for it)."""

from __future__ import annotations

from typing import Any

from ..core.envelope import Message
from ..core.outcomes import FailureReason
from ..core.registry import ConsumerSpec
from ..core.routing import topic_matches
from .stage import DeliveryOutcome, Job, Stage


class UnexpectedRoutingKey(Stage):
    def applies_to(self, spec: ConsumerSpec) -> bool:
        return bool(spec.bindings)  # bound outside the app: nothing to compare with

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        bindings = job.processor.spec.bindings
        for binding in bindings:
            if topic_matches(binding, message.routing_key):
                return None
        return job.processor.failures.dead_letter(
            job.delivery,
            message,
            FailureReason.UNEXPECTED_ROUTING_KEY,
            f"routing key {message.routing_key!r} matches none of the consumer's bindings "
            f"{list(bindings)!r}: the message reached the queue some other way "
            f"(published straight to the queue, or a stale binding)",
        )
