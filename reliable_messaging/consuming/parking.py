"""The parked-key stage: an ordered consumer's message behind an open dead letter of its key
is parked as a dead letter too (a replayed one only behind older dead letters than its own)."""

from __future__ import annotations

from typing import Any

from ..core.envelope import REPLAY_HEADER, Message
from ..core.outcomes import FailureReason, OutcomeLabel
from ..core.registry import ConsumerSpec
from ..dead_letters import ledger
from ..models import DeadLetter
from .stage import DeliveryOutcome, Job, Stage


class ParkedKeys(Stage):
    def applies_to(self, spec: ConsumerSpec) -> bool:
        return spec.ordered

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        blocker = _blocking_dead_letter(job, message)
        if blocker is None:
            return None
        return job.processor.failures.dead_letter(
            job.delivery,
            message,
            FailureReason.PARKED,
            f"ordering key {message.ordering_key!r} is parked behind dead letter "
            f"#{blocker.pk} (message_id={blocker.message_id}); replay or discard that one "
            f"first, then replay this one (replaying the key's dead letters oldest first "
            f"keeps their order)",
            label=OutcomeLabel.PARKED,
        )


def _blocking_dead_letter(job: Job, message: Message) -> DeadLetter | None:
    """The earliest unresolved dead letter of the message's key (an ordered consumer's)."""
    spec, using = job.processor.spec, job.processor.using
    if message.ordering_key is None:
        return None
    letters = DeadLetter.objects.using(using)
    blocking = (
        letters.open()
        .filter(consumer=spec.name, ordering_key=message.ordering_key)
        .exclude(message_id=message.message_id)
    )
    if REPLAY_HEADER in job.delivery.headers:
        # An edited copy's own dead letter is the one it was edited from (the ledger says).
        own = ledger.replayed_dead_letter(job.delivery, spec.name, message.message_id, using)
        if own is None:
            own = letters.of(spec.name, message.message_id).values_list("pk", flat=True).first()
        if own is not None:
            blocking = blocking.filter(pk__lt=own)
    return blocking.order_by("pk").first()
