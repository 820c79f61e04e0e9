"""The fixed vocabularies of the models: why a message is a dead letter, and the statuses of
dead letters and outbox rows.

They live apart from the models so that the managers (``managers.py``), which the models
import, can name them without an import circle; ``reliable_messaging.models`` re-exports them,
so code that imports them from there keeps working.
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class DeadLetterReason(models.TextChoices):
    PERMANENT = "permanent", _("permanent error")
    RETRIES_EXHAUSTED = "retries_exhausted", _("retries exhausted")
    INVALID_JSON = "invalid_json", _("invalid JSON")
    INVALID_UTF8 = "invalid_utf8", _("invalid UTF-8")
    EMPTY_BODY = "empty_body", _("empty body")
    MISSING_MESSAGE_ID = "missing_message_id", _("missing message_id")
    BODY_TOO_LARGE = "body_too_large", _("body too large")
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type", _("unsupported content type")
    INVALID_HEADERS = "invalid_headers", _("invalid headers")
    NO_HANDLER = "no_handler", _("no handler for the queue")
    UNEXPECTED_ROUTING_KEY = "unexpected_routing_key", _("routing key matches no binding")
    # Ordered consumers: a later message of a key whose earlier message is a dead letter.
    PARKED = "parked", _("parked behind an earlier dead letter of its key")
    # The process died (killed, or exited past the handler's time limit) CRASH_LIMIT times
    # while handling it.
    WORKER_CRASHED = "worker_crashed", _("the worker process died while handling it")
    TIMEOUT = "timeout", _("the handler ran past its time limit")
    # Our own code (not the handler) failed on it again and again.
    CONSUMER_ERROR = "consumer_error", _("the consumer failed on it")
    # A quorum queue's x-delivery-limit was reached: the broker dead-lettered it to us.
    DELIVERY_LIMIT = "delivery_limit", _("the broker's delivery limit was reached")


class DeadLetterStatus(models.TextChoices):
    DEAD = "dead", _("dead")
    REPLAYED = "replayed", _("replayed, awaiting outcome")
    RESOLVED = "resolved", _("resolved")
    DISCARDED = "discarded", _("discarded")


class OutboxStatus(models.TextChoices):
    PENDING = "pending", _("pending")
    SENT = "sent", _("sent")
    FAILED = "failed", _("failed")
    # An event the broker returned because no queue was bound for it: nobody subscribes to it
    # yet, which is normal in publish-subscribe. Terminal, like sent (see REQUIRE_ROUTE).
    UNROUTED = "unrouted", _("unrouted")


# Dead-letter statuses still awaiting an outcome: a dead letter not yet replayed or discarded,
# or a replay not yet decided. They hold back an ordered consumer's key, and a later copy of
# the message that is processed resolves them.
OPEN_DEAD_LETTER_STATUSES = (DeadLetterStatus.DEAD, DeadLetterStatus.REPLAYED)
