"""What keeps the admin's lists fast with a million rows: their filters, counts and searches
(``docs/design.md#the-admin-with-a-million-rows``)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import SEARCH_VAR
from django.core.exceptions import EmptyResultSet
from django.core.paginator import Paginator
from django.db import OperationalError, connections, router, transaction
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.functional import cached_property
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from ..core.registry import registry
from ..dead_letters.selection import search_words
from ..models import DeadLetterGroup

# A filtered list counts its rows up to this many and says "more than" past it.
COUNT_UP_TO = 10_000
# Each statement of a list with a search may run this long on PostgreSQL before it is stopped.
SEARCH_TIMEOUT_MS = 250
# PostgreSQL's SQLSTATE of a statement stopped by statement_timeout (query_canceled).
QUERY_CANCELED = "57014"


class FieldFilter(admin.SimpleListFilter):
    """Rows whose field named like the parameter equals the value chosen, offered among the
    ``known()`` values (none read from a large table: a DISTINCT would scan it)."""

    parameter_name: str

    def known(self) -> list[str]:
        return []

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = set(self.known())
        value = self.value()
        if value is not None:
            values.add(value)  # since removed, reached through a link: offered, so Django keeps it
        return [(value, value) for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(**{self.parameter_name: value})


class GroupValueFilter(FieldFilter):
    """The values of one field of the dead letters, from the failure groups and ``known()``
    (the registry's values, worth offering even without a dead letter)."""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        grouped = DeadLetterGroup.objects.values_of(self.parameter_name)
        return sorted({*super().lookups(request, model_admin), *((v, v) for v in grouped)})


class RegisteredConsumerFilter(FieldFilter):
    """Consumers from the registry: a DISTINCT over a large table would scan it every time."""

    title = _("consumer")
    parameter_name = "consumer"

    def known(self) -> list[str]:
        return [spec.name for spec in registry]


class ConsumerFilter(GroupValueFilter, RegisteredConsumerFilter):
    """The registry's consumers and the failure groups' (those gone from the registry)."""


class QueueFilter(GroupValueFilter):
    title = _("queue")
    parameter_name = "queue"

    def known(self) -> list[str]:
        return [spec.queue for spec in registry]


class ExceptionTypeFilter(GroupValueFilter):
    title = _("exception type")
    parameter_name = "exception_type"


class FailureGroupFilter(FieldFilter):
    """Dead letters of one fingerprint, from the failure groups page: it offers the one chosen
    only (Django drops the filter of a list filter without choices)."""

    title = _("failure group")
    parameter_name = "fingerprint"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        if value is None:
            return []
        group = DeadLetterGroup.objects.of_fingerprint(value)
        kind = group["exception_type"] or group["reason"]
        if not kind:
            label = value or gettext("(no fingerprint)")
        else:
            label = f"{kind.rsplit('.', 1)[-1]} · {value[:8] or '-'}"
        return [(value, label)]


class BoundedCountPaginator(Paginator):
    """A count that never reads the whole table: PostgreSQL's estimate past ``COUNT_UP_TO``
    (``estimated``), else a count up to ``COUNT_UP_TO`` + 1 (``capped`` when it reaches it)."""

    COUNT_UP_TO = COUNT_UP_TO  # for the template
    estimated = False
    capped = False

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return int(super().count)
        estimate = self._estimate(queryset)
        if estimate is not None and estimate > COUNT_UP_TO:
            self.estimated = True
            return estimate
        counted = queryset[: COUNT_UP_TO + 1].count()
        self.capped = counted > COUNT_UP_TO
        return counted

    @staticmethod
    def _estimate(queryset: QuerySet[Any]) -> int | None:
        connection = connections[queryset.db]
        if connection.vendor != "postgresql":
            return None
        try:
            sql, params = queryset.order_by().query.sql_with_params()
        except EmptyResultSet:  # queryset.none(): a refused search
            return 0
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        return int(plan[0]["Plan"]["Plan Rows"])


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows the app writes: never added or changed by hand (changes go through services)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class BoundedListAdmin(admin.ModelAdmin):
    """A list over a large table: a bounded count, exact searches (each word equal to one of
    ``exact_search_fields``), and a search PostgreSQL stops past ``SEARCH_TIMEOUT_MS``."""

    paginator = BoundedCountPaginator
    show_full_result_count = False
    exact_search_fields: tuple[str, ...] = ()
    search_timeout_ms = SEARCH_TIMEOUT_MS

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        for word in search_words(search_term):
            queryset = queryset.filter(
                Q.create([(field, word) for field in self.exact_search_fields], connector=Q.OR)
            )
        return queryset, False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        using = router.db_for_read(self.model)
        term = request.GET.get(SEARCH_VAR, "").strip()
        if not term or request.method != "GET" or connections[using].vendor != "postgresql":
            return super().changelist_view(request, extra_context)
        try:
            # A transaction, or a savepoint in the request's (ATOMIC_REQUESTS): SET LOCAL lasts
            # until the transaction ends, so the former value is set back after rendering (a
            # rollback to the savepoint sets it back by itself).
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), "
                    "set_config('statement_timeout', %s, true)",
                    [f"{self.search_timeout_ms}ms"],
                )
                former = cursor.fetchone()[0]
                response = super().changelist_view(request, extra_context)
                if isinstance(response, TemplateResponse):
                    response.render()  # the results are read here, under the timeout
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [former])
                return response
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != QUERY_CANCELED:
                raise
        self.message_user(
            request,
            gettext(
                "The search “%(term)s” was stopped after %(ms)d ms: no index answers it "
                "quickly enough. The list below is unsearched; search an exact id instead."
            )
            % {"term": term, "ms": self.search_timeout_ms},
            messages.ERROR,
        )
        unsearched = request.GET.copy()
        del unsearched[SEARCH_VAR]
        unsearched._mutable = False
        request.GET = unsearched  # type: ignore[assignment]  # the stubs' read-only QueryDict
        return super().changelist_view(request, extra_context)
