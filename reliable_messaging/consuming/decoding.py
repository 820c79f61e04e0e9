"""The decoding stage: a delivery that could not be decoded is a dead letter at once.

A body that is not JSON, one past ``MAX_BODY_BYTES``, headers that could not be read, or a
message with no message_id (:func:`reliable_messaging.core.envelope.decode_delivery` says which
and why) can never be handled: retrying it would fail the same way, and without a message_id
the inbox cannot claim it. This stage screens first, so every later screen, the handler and the
``decided`` hooks are given a decoded :class:`~reliable_messaging.core.envelope.Message`.
"""

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
