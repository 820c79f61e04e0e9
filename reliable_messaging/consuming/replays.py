"""The replay stage: what a processed copy settles, in the transaction that decided it.

A replayed copy (``x-rm-replay``) that is processed resolves its dead letter; one found
processed by another copy resolves it as such. Either way its ledger row is settled, naming
the trace it was decided in. A message an unordered consumer processes resolves any open dead
letter of it (an ordered consumer's keeps its key parked until replayed).
"""

from __future__ import annotations

from .. import tracing
from ..choices import ReplayOutcome
from ..core.envelope import REPLAY_HEADER, Message
from ..core.outcomes import OutcomeLabel
from ..dead_letters import ledger
from ..dead_letters.replay import mark_resolved, resolve_processed_copies
from .stage import DeliveryOutcome, Job, Stage


class ReplayLedger(Stage):
    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        name, using = job.name, job.processor.using
        if REPLAY_HEADER not in job.delivery.headers:
            ordered = job.processor.spec.ordered
            if done.label == OutcomeLabel.PROCESSED and done.copies_open and not ordered:
                resolve_processed_copies(name, [message.message_id], using)
            return
        if done.label not in (OutcomeLabel.PROCESSED, OutcomeLabel.DUPLICATE):
            return
        traced = tracing.ids_of(job.delivery)
        trace_id = traced[0] if traced else None
        if done.label == OutcomeLabel.PROCESSED:
            outcome = ReplayOutcome.PROCESSED
            mark_resolved(name, message.message_id, using, trace_id=trace_id)
        else:
            # Another copy (published twice, sent again by a relay) was processed after the
            # replay was queued: the dead letter is done with. Left "replayed", an ordered
            # consumer's would park its key for good.
            outcome = ReplayOutcome.DUPLICATE
            resolve_processed_copies(
                name,
                [message.message_id],
                using,
                by="its replay found it processed by another copy",
                trace_id=trace_id,
            )
        ledger.settle(
            job.delivery, name, message.message_id, outcome, using=using, trace_id=trace_id
        )
