"""The replay stage: what a processed copy settles, in the transaction that decided it.

A replayed copy (``x-rm-replay``) that is processed resolves its dead letter; one found
processed by another copy resolves it as such. Either way its ledger row is settled, naming
the trace it was decided in. A message an unordered consumer processes resolves any open dead
letter of it (an ordered consumer's keeps its key parked until replayed). The ledger
(:func:`reliable_messaging.dead_letters.ledger.settle_processed`) does all of it; this stage
says when.
"""

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
