"""The declared-payload stage (``@consumer(..., payload=Type)``): a mismatch is a dead letter
``invalid_payload`` (a duplicate if the inbox holds the message), a match reaches the handler as
the type's object through :attr:`Job.for_handler` (``docs/contracts.md``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.contracts import PayloadInvalid
from ..core.envelope import Message
from ..core.outcomes import FailureReason
from ..core.registry import ConsumerSpec
from ..models import ProcessedMessage
from .stage import DUPLICATE, DeliveryOutcome, Job, Stage


class DeclaredPayload(Stage):
    def applies_to(self, spec: ConsumerSpec) -> bool:
        return spec.payload is not None

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        spec = job.processor.spec
        assert spec.payload is not None
        try:
            typed = spec.payload.validate(message.payload)
        except PayloadInvalid as exc:
            inbox = ProcessedMessage.objects.using(job.processor.using)
            if inbox.has(spec.name, message.message_id):
                return DUPLICATE
            return job.processor.failures.dead_letter(
                job.delivery, message, FailureReason.INVALID_PAYLOAD, str(exc)
            )
        job.for_handler = dataclasses.replace(message, payload=typed)
        return None
