"""The declared-payload stage: a message that does not match its consumer's declared type
(``@consumer(..., payload=Type)``) is a dead letter ``invalid_payload`` before the handler runs.

Retrying cannot make a payload match, so no attempt is spent: the dead letter holds the raw body
byte for byte and the validation errors (each field's path and what is wrong, never the value),
and replays as usual once the type or the data is fixed. A message that matches reaches the
handler as the type's object (``message.payload``), through :attr:`Job.for_handler`.

A message the inbox already holds is a duplicate, not a dead letter: it was handled under the
type of its time (a redelivery across a deploy that tightened the type).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.contracts import PayloadInvalid
from ..core.envelope import Message
from ..core.outcomes import FailureReason
from ..models import ProcessedMessage
from .stage import DUPLICATE, DeliveryOutcome, Job, Stage


class DeclaredPayload(Stage):
    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        spec = job.processor.spec
        if spec.payload is None:
            return None
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
