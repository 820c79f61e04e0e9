"""The retry stage: a retry or a deferral waits in the outbox as a scheduled copy of the
original, written in the transaction that decided it (``docs/design.md#where-a-retry-waits``)."""

from __future__ import annotations

import hashlib
from typing import Any

from django.db import DatabaseError

from ..broker.stored_properties import retry_properties
from ..core.envelope import DEFERRALS_HEADER, REPLAY_ID_HEADER, Message
from ..core.outcomes import ScheduleRetry
from ..models import OutboxMessage
from .retries import raise_for_our_write
from .stage import Batch, DeliveryOutcome, Job, Stage


def copy_key(consumer: str, message_id: str, retry: ScheduleRetry) -> str:
    """The idempotency key of a copy: one per consumer, message, replay, attempt and deferral
    (a replay starts its attempts afresh)."""
    deferrals = retry.headers.get(DEFERRALS_HEADER, 0) if retry.deferred else 0
    replay = retry.headers.get(REPLAY_ID_HEADER, "")
    named = f"{consumer}\x00{message_id}\x00{replay}\x00{retry.next_attempt}\x00{deferrals}"
    return f"rm-retry:{hashlib.sha256(named.encode()).hexdigest()}"


def write_copy(job: Job, message: Message, retry: ScheduleRetry) -> None:
    """The scheduled row of ``job``'s copy, in the current transaction (or its own)."""
    delivery = job.delivery
    try:
        OutboxMessage.objects.using(job.processor.using).schedule_copy(
            message_id=message.message_id,
            queue=delivery.queue,
            body=delivery.body,
            properties=retry_properties(delivery.properties, retry.headers),
            delay=retry.delay,
            idempotency_key=copy_key(job.name, message.message_id, retry),
        )
    except DatabaseError as exc:
        raise_for_our_write(exc, f"the retry copy of message_id={message.message_id}")


class RetryRows(Stage):
    """Writes the copy of every delivery decided a retry or a deferral."""

    def open(self, batch: Batch) -> Any:
        # What an earlier stage settled before the transaction (the fast path's deferrals of
        # a message another consumer leases): each copy in a transaction of its own.
        for job, done in batch.outcomes():
            if isinstance(done.outcome, ScheduleRetry) and isinstance(job.message, Message):
                write_copy(job, job.message, done.outcome)
        return None

    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        if isinstance(done.outcome, ScheduleRetry):
            write_copy(job, message, done.outcome)
