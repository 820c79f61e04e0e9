"""The decoding stage, the first screen: a delivery that could not be decoded
(:func:`~reliable_messaging.core.envelope.decode_delivery` says why) is a dead letter at once."""

from __future__ import annotations

from typing import Any

from ..core.envelope import DecodeError, Message
from .stage import DeliveryOutcome, Job, Stage


class Undecodable(Stage):
    def screen(
        self, job: Job, message: Message | DecodeError, state: Any
    ) -> DeliveryOutcome | None:
        if isinstance(message, Message):
            return None
        return job.processor.failures.dead_letter(
            job.delivery, message, message.reason, message.detail
        )
