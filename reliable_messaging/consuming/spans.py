"""The tracing stage: a ``process`` span per delivery (:mod:`reliable_messaging.tracing`),
current while its handler runs."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from .. import tracing
from ..core.envelope import Message
from ..core.outcomes import Acknowledge, OutcomeLabel
from .stage import SITS_OUT, Batch, DeliveryOutcome, Job, Stage

FAILED = frozenset({OutcomeLabel.DEAD_LETTERED, OutcomeLabel.PARKED, OutcomeLabel.RETRIED})


class Spans(Stage):
    def open(self, batch: Batch) -> Any:
        started = tracing.start_deliveries((job.delivery, job.name) for job in batch.jobs)
        return SITS_OUT if started is None else started  # None: tracing is off

    def handling(self, job: Job, message: Message, state: Any) -> AbstractContextManager[Any]:
        return tracing.handling(job.delivery)

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if error is None:
            for job, done in batch.outcomes():
                if done.label in FAILED:
                    tracing.delivery_failed(job.delivery, _described(job, done), done.error)
        outcomes = None if error is not None else [d.outcome if d else None for d in batch.decided]
        tracing.end_deliveries(state, [job.delivery for job in batch.jobs], outcomes, error)


def _described(job: Job, done: DeliveryOutcome) -> str:
    if done.error is not None:
        return f"{type(done.error).__name__}: {done.error}"
    reason = done.outcome.reason if isinstance(done.outcome, Acknowledge) else done.label
    return f"{reason}: {done.detail}"
