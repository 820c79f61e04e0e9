"""The inbox in the admin: "was message X processed by consumer Y, and when?", and the
deliveries the crash guard is watching. Read-only: rows here are the consumers' memory.

Both tables are large (the inbox holds every message of the retention period), so the lists
take their consumer filter from the registry and count with the planner's estimate past a few
thousand rows; the search takes exact ids, which the indexes answer.
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import cached_property
from django.utils.translation import gettext_lazy as _

from ..models import ProcessedMessage, SuspectDelivery
from ..registry import registry


class RegisteredConsumerFilter(admin.SimpleListFilter):
    """Consumers from the registry: a DISTINCT over the whole inbox would scan it every time."""

    title = _("consumer")
    parameter_name = "consumer"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = [spec.name for spec in registry]
        value = self.value()
        if value is not None and value not in names:
            names.append(value)  # a consumer since removed, reached through a link
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(consumer=value)


class EstimatedCountPaginator(Paginator):
    """Counts only what is small: on PostgreSQL a list whose planner's estimate passes
    ``EXACT_UP_TO`` rows shows that estimate instead of counting (the inbox holds a billion
    rows; counting them, or a consumer's share, takes minutes), as large Django sites do."""

    EXACT_UP_TO = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if isinstance(queryset, QuerySet):
            connection = connections[queryset.db]
            if connection.vendor == "postgresql":
                sql, params = queryset.order_by().query.sql_with_params()
                with connection.cursor() as cursor:
                    cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
                    plan = cursor.fetchone()[0]
                plan = json.loads(plan) if isinstance(plan, str) else plan
                estimate = int(plan[0]["Plan"]["Plan Rows"])
                if estimate > self.EXACT_UP_TO:
                    return estimate
        return int(super().count)


@admin.register(ProcessedMessage)
class ProcessedMessageAdmin(admin.ModelAdmin):
    """Answers "was message X processed by consumer Y, and when?"."""

    list_display = ("message_id", "consumer", "processed_at")
    list_filter = (RegisteredConsumerFilter,)
    # "ID CONSUMER": each word must equal the message_id or the consumer, so the two together
    # find the one row that answers the question; exact matches use the table's indexes.
    search_fields = ("=message_id", "=consumer")
    search_help_text = _(
        "An exact message_id, optionally followed by an exact consumer name "
        "(e.g. “0b6f…-9c1e billing.charge-order”)."
    )
    date_hierarchy = "processed_at"
    ordering = ("-processed_at",)
    show_full_result_count = False
    paginator = EstimatedCountPaginator

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(SuspectDelivery)
class SuspectDeliveryAdmin(admin.ModelAdmin):
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
    search_fields = ("=message_id", "=consumer")
    ordering = ("-updated_at",)
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
