"""The outbox in the admin: what waits to be sent, what failed and why, and a way to send the
failed rows again."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.http import HttpRequest
from django.utils import timezone
from django.utils.timesince import timesince
from django.utils.translation import ngettext

from ..managers import OutboxMessageQuerySet
from ..models import OutboxMessage


@admin.register(OutboxMessage)
class OutboxMessageAdmin(admin.ModelAdmin):
    list_display = (
        "created_at",
        "message_id",
        "exchange",
        "routing_key",
        "ordering_key",
        "status",
        "attempts",
        "short_error",
        "sent_at",
    )
    list_filter = ("status", "exchange", "routing_key")
    search_fields = ("=message_id", "=idempotency_key", "=ordering_key", "last_error")
    date_hierarchy = "created_at"
    ordering = ("-id",)
    actions = ["retry_failed"]
    readonly_fields = [f.name for f in OutboxMessage._meta.fields]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        oldest = OutboxMessage.objects.oldest_pending_at()
        if oldest is not None:
            self.message_user(
                request,
                f"Oldest pending row waits for {timesince(oldest, timezone.now())}.",
                messages.INFO,
            )
        return super().changelist_view(request, extra_context)

    @admin.display(description="last error")
    def short_error(self, obj: OutboxMessage) -> str:
        return obj.last_error if len(obj.last_error) <= 80 else obj.last_error[:79] + "…"

    @admin.action(description="Retry the selected failed rows", permissions=["change"])
    def retry_failed(self, request: HttpRequest, queryset: OutboxMessageQuerySet) -> None:
        count = queryset.retry_failed()
        self.message_user(
            request,
            ngettext("%d failed row is pending again.", "%d failed rows are pending again.", count)
            % count,
            messages.SUCCESS,
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
