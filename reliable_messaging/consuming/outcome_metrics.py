"""The metrics stage: each committed outcome counted, with its handler's and its end-to-end
time (see :mod:`reliable_messaging.metrics` for the series)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .. import metrics, tracing
from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from .stage import Batch, DeliveryOutcome, Job, Stage


class OutcomeMetrics(Stage):
    def open(self, batch: Batch) -> Any:
        return time.perf_counter()

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if error is not None:
            return
        now, processing = time.time(), time.perf_counter() - state
        if tracing.active():  # each observation with its span's trace id as its exemplar
            for job, done in batch.outcomes():
                metrics.consumer_outcomes(job.name, {done.label: 1}, _durations(done))
                trace_id = tracing.sampled_trace_id(job.delivery)
                metrics.delivery_times(job.name, processing, _critical(job, done, now), trace_id)
            return
        # Counted per consumer for the batch: each series changed once, not per delivery.
        counted: dict[str, _Counted] = {}
        for job, done in batch.outcomes():
            seen = counted.get(job.name)
            if seen is None:
                seen = counted[job.name] = _Counted({}, [], [])
            seen.labels[done.label] = seen.labels.get(done.label, 0) + 1
            if done.duration is not None:
                seen.durations.append(done.duration)
            critical = _critical(job, done, now)
            if critical is not None:
                seen.critical.append(critical)
        for consumer, seen in counted.items():
            metrics.consumer_outcomes(consumer, seen.labels, seen.durations)
            metrics.batch_times(consumer, processing, sum(seen.labels.values()), seen.critical)


@dataclass
class _Counted:
    """One consumer's deliveries in a batch: how many of each outcome, its handlers' run times
    and the processed ones' times since their publish."""

    labels: dict[str, int]
    durations: list[float]
    critical: list[float]


def _durations(done: DeliveryOutcome) -> list[float]:
    return [] if done.duration is None else [done.duration]


def _critical(job: Job, done: DeliveryOutcome, now: float) -> float | None:
    """Seconds from the message's publish to ``now``, for a processed one that says when."""
    message = job.message
    if done.label != OutcomeLabel.PROCESSED or not isinstance(message, Message):
        return None
    return None if message.published_at is None else now - message.published_at.timestamp()
