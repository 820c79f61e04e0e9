"""Admin pages for the inbox and the dead letters."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince
from django.utils.translation import ngettext

from .models import DeadLetter, OutboxMessage, OutboxStatus, ProcessedMessage


@admin.register(ProcessedMessage)
class ProcessedMessageAdmin(admin.ModelAdmin):
    """Answers "was message X processed by consumer Y, and when?"."""

    list_display = ("message_id", "consumer", "processed_at")
    list_filter = ("consumer",)
    search_fields = ("=message_id", "consumer")
    date_hierarchy = "processed_at"
    ordering = ("-processed_at",)
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(DeadLetter)
class DeadLetterAdmin(admin.ModelAdmin):
    list_display = (
        "last_failed_at",
        "consumer",
        "queue",
        "routing_key",
        "message_id",
        "reason",
        "exception_type",
        "short_message",
        "attempts",
        "status",
    )
    list_filter = ("status", "reason", "consumer", "queue", "exception_type")
    search_fields = ("=message_id", "exception_message")
    date_hierarchy = "last_failed_at"
    readonly_fields = (
        "message_id",
        "consumer",
        "queue",
        "exchange",
        "routing_key",
        "reason",
        "status",
        "attempts",
        "replay_count",
        "first_failed_at",
        "last_failed_at",
        "exception_type",
        "exception_message",
        "pretty_payload",
        "pretty_headers",
        "raw_body",
        "traceback_block",
        "created_at",
        "updated_at",
    )
    exclude = ("payload", "headers", "body", "traceback", "history", "content_type")

    @admin.display(description="message")
    def short_message(self, obj: DeadLetter) -> str:
        text = obj.exception_message.splitlines()[0] if obj.exception_message else ""
        return text if len(text) <= 80 else text[:79] + "…"

    @admin.display(description="payload")
    def pretty_payload(self, obj: DeadLetter) -> str:
        if obj.payload is None:
            return "(not JSON: see the raw body)"
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))

    @admin.display(description="headers")
    def pretty_headers(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.headers, indent=2, ensure_ascii=False))

    @admin.display(description="raw body")
    def raw_body(self, obj: DeadLetter) -> str:
        body = bytes(obj.body)
        return format_html("<pre>{}</pre>", body.decode("utf-8", errors="backslashreplace"))

    @admin.display(description="traceback")
    def traceback_block(self, obj: DeadLetter) -> str:
        return format_html("<pre>{}</pre>", obj.traceback)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


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
        oldest = (
            OutboxMessage.objects.pending()
            .order_by("created_at")
            .values_list("created_at", flat=True)
            .first()
        )
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
    def retry_failed(self, request: HttpRequest, queryset: QuerySet) -> None:
        count = queryset.filter(status=OutboxStatus.FAILED).update(
            status=OutboxStatus.PENDING, attempts=0, next_attempt_at=timezone.now()
        )
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
