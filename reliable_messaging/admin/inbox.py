"""The inbox in the admin ("was message X processed by consumer Y, and when?") and the
deliveries the crash guard watches: read-only, bounded lists (``scaling.BoundedListAdmin``)."""

from __future__ import annotations

from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from ..models import ProcessedMessage, SuspectDelivery
from .scaling import BoundedListAdmin, ReadOnlyAdmin, RegisteredConsumerFilter


@admin.register(ProcessedMessage)
class ProcessedMessageAdmin(ReadOnlyAdmin, BoundedListAdmin):
    """Answers "was message X processed by consumer Y, and when?"."""

    list_display = ("message_id", "consumer", "processed_at")
    list_filter = (RegisteredConsumerFilter, ("processed_at", admin.DateFieldListFilter))
    # "ID CONSUMER": each word must equal the message_id or the consumer, so the two together
    # find the one row that answers the question; exact matches use the table's indexes.
    search_fields = ("message_id",)  # only so that Django shows the search box
    exact_search_fields = ("message_id", "consumer")
    search_help_text = _(
        "An exact message_id, optionally followed by an exact consumer name "
        "(e.g. “0b6f…-9c1e billing.charge-order”)."
    )
    ordering = ("-processed_at",)


@admin.register(SuspectDelivery)
class SuspectDeliveryAdmin(ReadOnlyAdmin, BoundedListAdmin):
    """Deliveries the crash guard is watching: came back after their process went away. A row
    with deaths close to CRASH_LIMIT names a message that may be killing its consumers."""

    list_display = (
        "message_id",
        "consumer",
        "deaths",
        "running",
        "last_cause",
        "last_process",
        "updated_at",
    )
    list_filter = (RegisteredConsumerFilter, "last_cause", "running")
    search_fields = ("message_id",)
    exact_search_fields = ("message_id", "consumer")
    ordering = ("-updated_at",)
