"""The replay stage: what a processed or duplicate copy settles in the replay ledger
(:func:`~reliable_messaging.dead_letters.ledger.settle_processed`), in the transaction that
decided it."""

from __future__ import annotations

from typing import Any

from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from ..dead_letters import ledger
from .stage import DeliveryOutcome, Job, Stage


class ReplayLedger(Stage):
    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        if done.label in (OutcomeLabel.PROCESSED, OutcomeLabel.DUPLICATE):
            ledger.settle_processed(
                job.delivery,
                job.name,
                message.message_id,
                using=job.processor.using,
                duplicate=done.label == OutcomeLabel.DUPLICATE,
                resolve_open=done.copies_open and not job.processor.spec.ordered,
            )
