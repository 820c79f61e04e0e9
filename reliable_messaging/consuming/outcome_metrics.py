"""The metrics stage: each committed outcome counted, with its handler's and its end-to-end
time (see :mod:`reliable_messaging.metrics` for the series)."""

from __future__ import annotations

import time
from typing import Any

from .. import metrics, tracing
from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from .stage import Batch, Stage


class OutcomeMetrics(Stage):
    def open(self, batch: Batch) -> Any:
        return time.perf_counter()

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if error is not None:
            return
        now, processing = time.time(), time.perf_counter() - state
        for job, done in batch.outcomes():
            metrics.consumer_outcome(job.name, done.label, done.duration)
            message = job.message
            published_at = message.published_at if isinstance(message, Message) else None
            critical = None
            if published_at is not None and done.label == OutcomeLabel.PROCESSED:
                critical = now - published_at.timestamp()
            metrics.delivery_times(
                job.name, processing, critical, tracing.sampled_trace_id(job.delivery)
            )
