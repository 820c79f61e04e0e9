"""The log stage: one line per delivery once its outcome committed (a line saying
"processed" is true), in the consumer's log ``reliable_messaging.consuming.processing``."""

from __future__ import annotations

import logging
from typing import Any

from ..core.envelope import DecodeError
from ..core.outcomes import Acknowledge, OutcomeLabel, RetryInPlace, ScheduleRetry
from .stage import Batch, DeliveryOutcome, Job, Stage

logger = logging.getLogger("reliable_messaging.consuming.processing")


class OutcomeLog(Stage):
    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if error is not None:
            return
        info = logger.isEnabledFor(logging.INFO)  # else no line of _INFO_LABELS is kept
        for job, done in batch.outcomes():
            if info or done.label not in _INFO_LABELS:
                log_outcome(job, done)


_INFO_LABELS = frozenset({OutcomeLabel.PROCESSED, OutcomeLabel.DUPLICATE, OutcomeLabel.EXPIRED})


def log_outcome(job: Job, done: DeliveryOutcome) -> None:
    outcome, label = done.outcome, done.label
    retry = outcome if isinstance(outcome, ScheduleRetry | RetryInPlace) else None
    if label in _INFO_LABELS or (retry is not None and retry.deferred):
        level = logging.INFO
    elif isinstance(outcome, Acknowledge):  # a dead letter, or parked
        level = logging.ERROR
    elif retry is not None:
        level = logging.WARNING
    else:
        return
    # Nothing is formatted for a line the log would drop (INFO ones, in most deployments).
    if not logger.isEnabledFor(level):
        return
    message = job.message
    attempt = 1 if isinstance(message, DecodeError) else message.attempt
    head = f"message_id={message.message_id or '-'} consumer={job.name} attempt={attempt}"
    why = f"{type(done.error).__name__}: {done.error}" if done.error is not None else done.detail
    took = f" duration_ms={done.duration * 1000:.1f}" if done.duration is not None else ""
    if label == OutcomeLabel.PROCESSED:
        logger.info("processed %s outcome=processed%s", head, took)
    elif label == OutcomeLabel.DUPLICATE:
        logger.info(
            "duplicate %s outcome=duplicate: already processed%s, acked without running the "
            "handler",
            head,
            " (fast path)" if done.from_cache else "",
        )
    elif label == OutcomeLabel.EXPIRED:
        logger.info(
            "expired %s outcome=expired: %s; acked without running the handler",
            head,
            outcome.reason if isinstance(outcome, Acknowledge) else why,
        )
    elif isinstance(outcome, Acknowledge):  # a dead letter, or parked
        logger.error(
            "dead-lettering %s outcome=%s reason=%s%s: %s", head, label, outcome.reason, took, why
        )
    elif retry is not None and retry.deferred:
        logger.info(
            "%s outcome=deferred: %s; it comes back in %.3gs", head, done.detail, retry.delay
        )
    elif retry is not None:
        logger.warning(
            "retrying %s outcome=retry next_attempt=%d in %.3gs%s%s: %s",
            head,
            retry.next_attempt,
            retry.delay,
            " in place (ordered)" if isinstance(retry, RetryInPlace) else "",
            took,
            why,
        )
