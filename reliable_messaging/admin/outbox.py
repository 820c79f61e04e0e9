"""The outbox in the admin: what waits, what failed and why; retry failed rows and cancel
scheduled ones. A bounded list (``scaling.BoundedListAdmin``) filtered by status only."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.timesince import timesince
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from ..broker.stored_properties import shown_properties
from ..choices import OutboxStatus
from ..managers import OutboxMessageQuerySet, waiting_since
from ..models import OutboxMessage
from ..publishing.scheduled import cancel_rows
from . import bodies, scaling


@admin.register(OutboxMessage)
class OutboxMessageAdmin(scaling.BoundedListAdmin):
    list_display = (
        "created_at",
        "message_id",
        "exchange",
        "routing_key",
        "ordering_key",
        "status_shown",
        "deliver_at",
        "attempts",
        "short_error",
        "sent_at",
    )
    list_filter = ("status",)
    search_fields = ("message_id",)  # only so that Django shows the search box
    exact_search_fields = ("message_id", "idempotency_key")
    search_help_text = _("An exact message_id or idempotency key.")
    ordering = ("-id",)
    actions = ["retry_failed", "cancel_scheduled"]
    # Everything read-only, the body and headers through blocks that cap what they show (a
    # retry copy's bytes and properties in their place).
    readonly_fields = (
        *(
            f.name
            for f in OutboxMessage._meta.fields
            if f.name not in ("id", "body", "headers", "raw_body", "raw_properties")
        ),
        "body_block",
        "headers_block",
    )
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxMessage]:
        # The list shows neither; the page reads the body's head alone (``body_block``).
        return super().get_queryset(request).defer("body", "headers", "raw_body")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        # The oldest by id, which the primary key of each partition answers (created_at has
        # no index: the relay never reads by it); a scheduled one waits since its due time.
        oldest = (
            OutboxMessage.objects.pending()
            .order_by("pk")
            .values_list(waiting_since(), flat=True)
            .first()
        )
        if oldest is not None:
            self.message_user(
                request,
                f"Oldest pending row waits for {timesince(oldest, timezone.now())}.",
                messages.INFO,
            )
        # The first entry of the scheduled rows' index, whichever wrote it: looking past a
        # consumer's retries for publish()'s first would read every one of them.
        first = (
            OutboxMessage.objects.filter(status=OutboxStatus.SCHEDULED)
            .order_by("next_attempt_at")
            .values_list("next_attempt_at", "raw_properties")
            .first()
        )
        if first is not None:
            due = f"{first[0]:%Y-%m-%d %H:%M:%S %Z}"
            self.message_user(
                request,
                f"Next scheduled message is due at {due}."
                if first[1] is None
                else f"Next scheduled row is a consumer's retry or deferral, due at {due}.",
                messages.INFO,
            )
        return super().changelist_view(request, extra_context)

    @admin.display(description=_("status"), ordering="status")
    def status_shown(self, obj: OutboxMessage) -> str:
        """The status, and for a consumer's copy what it is: the only copy of a delivery that
        failed or was deferred, which the cancel action leaves alone."""
        status = obj.get_status_display()
        if obj.raw_properties is None:
            return status
        return gettext("%(status)s: a consumer's retry or deferral") % {"status": status}

    @admin.display(description="last error")
    def short_error(self, obj: OutboxMessage) -> str:
        return obj.last_error if len(obj.last_error) <= 80 else obj.last_error[:79] + "…"

    @admin.display(description=_("body"))
    def body_block(self, obj: OutboxMessage) -> str:
        field = "body" if obj.raw_properties is None else "raw_body"
        rows = OutboxMessage.objects.using(obj._state.db)
        head, size = bodies.head_and_size(rows, obj.pk, field)
        name = f"{self.admin_site.name}:reliable_messaging_outboxmessage_body"
        url = reverse(name, args=[obj.pk])
        pretty = bodies.pretty_body(head, size)
        if pretty is not None:
            return bodies.shown_text(pretty, url)
        return bodies.raw_body(head, size, url)

    @admin.display(description=_("headers"))
    def headers_block(self, obj: OutboxMessage) -> str:
        if obj.raw_properties is not None:
            # A retry copy: the original's properties and headers, as pika reads them back.
            shown = shown_properties(obj.raw_properties)
            return bodies.shown_text("\n".join(f"{k}: {v!r}" for k, v in shown.items()))
        return bodies.shown_json(obj.headers)

    def body_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The whole body as a file: for those who may see the row."""
        obj = self.get_object(request, object_id)
        if obj is None:
            raise Http404(gettext("No outbox message with id %(id)s.") % {"id": object_id})
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        if obj.raw_body is not None:
            return bodies.download(obj, bytes(obj.raw_body))
        return bodies.download(obj, obj.body.encode(), "application/json")

    def get_urls(self) -> list[URLPattern]:
        body = path(
            "<path:object_id>/body/",
            self.admin_site.admin_view(self.body_view),
            name="reliable_messaging_outboxmessage_body",
        )
        return [body, *super().get_urls()]

    @admin.action(description="Retry the selected failed rows", permissions=["change"])
    def retry_failed(self, request: HttpRequest, queryset: OutboxMessageQuerySet) -> None:
        count = queryset.retry_failed()
        self.message_user(
            request,
            ngettext("%d failed row is pending again.", "%d failed rows are pending again.", count)
            % count,
            messages.SUCCESS,
        )

    @admin.action(description="Cancel the selected scheduled messages", permissions=["change"])
    def cancel_scheduled(self, request: HttpRequest, queryset: OutboxMessageQuerySet) -> None:
        """Cancel each selected row that still waits for its due time (a deferred task with
        its result); the others (sent, made pending meanwhile, a consumer's retry) are left
        alone and counted."""
        chosen = list(queryset.values_list("pk", "status"))
        # A consumer's retry copy (raw_properties): never cancelled (publishing/scheduled.py).
        copies = queryset.filter(status=OutboxStatus.SCHEDULED, raw_properties__isnull=False)
        kept = set(copies.values_list("pk", flat=True))
        # By id: another row may share a selected row's message_id (publish() allows it).
        cancelled, tasks = cancel_rows(
            [pk for pk, status in chosen if status == OutboxStatus.SCHEDULED and pk not in kept],
            queryset.db,
        )
        self.message_user(
            request,
            ngettext(
                "%d scheduled message cancelled.", "%d scheduled messages cancelled.", cancelled
            )
            % cancelled,
            messages.SUCCESS,
        )
        if tasks:
            self.message_user(
                request,
                ngettext(
                    "%d of them was a task's (enqueued with run_after): its result is deleted "
                    "with it, as if never enqueued.",
                    "%d of them were tasks' (enqueued with run_after): their results are "
                    "deleted with them, as if never enqueued.",
                    tasks,
                )
                % tasks,
                messages.SUCCESS,
            )
        if kept:
            self.message_user(
                request,
                ngettext(
                    "%d selected row is a consumer's retry of a failed delivery, not a scheduled "
                    "message: left alone (the only copy of that delivery, its cancel would lose "
                    "the message for its consumer).",
                    "%d selected rows are a consumer's retries of failed deliveries, not "
                    "scheduled messages: left alone (each the only copy of its delivery, their "
                    "cancel would lose the messages for their consumers).",
                    len(kept),
                )
                % len(kept),
                messages.WARNING,
            )
        left = len(chosen) - cancelled - len(kept)
        if left:
            self.message_user(
                request,
                ngettext(
                    "%d selected row was not waiting for its due time (sent or due already): "
                    "left alone.",
                    "%d selected rows were not waiting for their due time (sent or due "
                    "already): left alone.",
                    left,
                )
                % left,
                messages.WARNING,
            )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
