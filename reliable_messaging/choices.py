"""The fixed vocabularies of the models, apart so that the managers can name them."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from .core.outcomes import FailureReason


class DeadLetterReason(models.TextChoices):
    """:class:`~reliable_messaging.core.outcomes.FailureReason`, with the admin's labels."""

    PERMANENT = FailureReason.PERMANENT.value, _("permanent error")
    RETRIES_EXHAUSTED = FailureReason.RETRIES_EXHAUSTED.value, _("retries exhausted")
    INVALID_JSON = FailureReason.INVALID_JSON.value, _("invalid JSON")
    INVALID_UTF8 = FailureReason.INVALID_UTF8.value, _("invalid UTF-8")
    EMPTY_BODY = FailureReason.EMPTY_BODY.value, _("empty body")
    MISSING_MESSAGE_ID = FailureReason.MISSING_MESSAGE_ID.value, _("missing message_id")
    BODY_TOO_LARGE = FailureReason.BODY_TOO_LARGE.value, _("body too large")
    UNSUPPORTED_CONTENT_TYPE = (
        FailureReason.UNSUPPORTED_CONTENT_TYPE.value,
        _("unsupported content type"),
    )
    INVALID_HEADERS = FailureReason.INVALID_HEADERS.value, _("invalid headers")
    NO_HANDLER = FailureReason.NO_HANDLER.value, _("no handler for the queue")
    UNEXPECTED_ROUTING_KEY = (
        FailureReason.UNEXPECTED_ROUTING_KEY.value,
        _("routing key matches no binding"),
    )
    PARKED = FailureReason.PARKED.value, _("parked behind an earlier dead letter of its key")
    WORKER_CRASHED = (
        FailureReason.WORKER_CRASHED.value,
        _("the worker process died while handling it"),
    )
    TIMEOUT = FailureReason.TIMEOUT.value, _("the handler ran past its time limit")
    CONSUMER_ERROR = FailureReason.CONSUMER_ERROR.value, _("the consumer failed on it")
    DELIVERY_LIMIT = (
        FailureReason.DELIVERY_LIMIT.value,
        _("the broker's delivery limit was reached"),
    )
    EXPIRED = FailureReason.EXPIRED.value, _("expired before it was handled")
    INVALID_PAYLOAD = (
        FailureReason.INVALID_PAYLOAD.value,
        _("the payload does not match its declared type"),
    )


class DeadLetterStatus(models.TextChoices):
    DEAD = "dead", _("dead")
    REPLAYED = "replayed", _("replayed, awaiting outcome")
    RESOLVED = "resolved", _("resolved")
    DISCARDED = "discarded", _("discarded")


class OutboxStatus(models.TextChoices):
    # Waiting for its due time (``publish(deliver_at=...)``); the relay makes it pending then.
    SCHEDULED = "scheduled", _("scheduled")
    PENDING = "pending", _("pending")
    SENT = "sent", _("sent")
    FAILED = "failed", _("failed")
    # An event no queue was bound for (nobody subscribes yet): terminal, like sent.
    UNROUTED = "unrouted", _("unrouted")


# Dead-letter statuses awaiting an outcome: they hold back an ordered consumer's key.
OPEN_DEAD_LETTER_STATUSES = (DeadLetterStatus.DEAD, DeadLetterStatus.REPLAYED)


class OperationKind(models.TextChoices):
    REPLAY = "replay", _("replay")
    DISCARD = "discard", _("discard")


class OperationState(models.TextChoices):
    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    DONE = "done", _("done")
    CANCELLED = "cancelled", _("cancelled")
    FAILED = "failed", _("failed")


UNFINISHED_OPERATION_STATES = (OperationState.PENDING, OperationState.RUNNING)


class ReplayKind(models.TextChoices):
    REPLAY = "replay", _("replay")
    FORCED = "forced", _("forced replay")  # the consumer's inbox row was removed for it
    EDITED = "edited", _("edited replay")  # a corrected copy under a new message_id


class ReplayOutcome(models.TextChoices):
    """What became of a replayed copy (the replay ledger)."""

    IN_FLIGHT = "in_flight", _("in flight")
    PROCESSED = "processed", _("processed")
    DUPLICATE = "duplicate", _("duplicate (skipped)")  # already processed by another copy
    FAILED_AGAIN = "failed_again", _("failed again")


class GroupState(models.TextChoices):
    """A failure group's place in its lifecycle; ``new`` (no row) and ``regressed`` (failures
    after it was resolved) are not stored."""

    NEW = "new", _("new")
    ACKNOWLEDGED = "acknowledged", _("acknowledged")
    RESOLVED = "resolved", _("resolved")
    REGRESSED = "regressed", _("regressed")


STORED_GROUP_STATES = (GroupState.ACKNOWLEDGED, GroupState.RESOLVED)


class TaskRunStatus(models.TextChoices):
    """``django.tasks``' ``TaskResultStatus``, value for value, without importing it."""

    READY = "READY", _("ready")  # enqueued, or waiting for its next attempt
    RUNNING = "RUNNING", _("running")
    FAILED = "FAILED", _("failed")  # a dead letter now
    SUCCESSFUL = "SUCCESSFUL", _("successful")
