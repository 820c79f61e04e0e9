"""What keeps the dead-letter list fast with a million rows: its filters, its count, its search.

After an outage the dead letters number in the millions, and Django's defaults read all of them
on every page: a list filter built from a field's values runs ``SELECT DISTINCT`` over the whole
table, ``date_hierarchy`` a ``DISTINCT date_trunc`` and a ``MIN``/``MAX``, the paginator a
``COUNT(*)``, and the search box an ``UPPER(...) LIKE '%...%'`` that no B-tree answers. Here:

- the filters offer values from the failure groups (``DeadLetterGroup``: tens of rows) and the
  registry, and the date filter offers fixed ranges;
- the paginator shows PostgreSQL's estimate of a large result, and counts a small one only up
  to ``COUNT_UP_TO`` + 1 rows ("more than 10,000");
- the search (``dead_letters.selection.search``, which a bulk operation applies batch after
  batch, read as its confirmation read it) looks a single word up as an exact message_id
  first (the B-tree on message_id), and matches words in the exception message and the
  payload's text with trigram GIN indexes on PostgreSQL
  (``migrations/0011_dead_letter_groups.py``), ``icontains`` elsewhere.
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
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from ..models import DeadLetterGroup
from ..registry import registry

# A filtered list counts its rows up to this many and says "more than" past it.
COUNT_UP_TO = 10_000


class GroupValueFilter(admin.SimpleListFilter):
    """The values of one field of the dead letters, from the failure groups (and the registry):
    never a ``SELECT DISTINCT`` over the dead letters."""

    field = ""

    def known(self) -> list[str]:
        """Values worth offering even without a dead letter (the registry's)."""
        return []

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = set(DeadLetterGroup.objects.values_of(self.field)) | set(self.known())
        value = self.value()
        if value:
            values.add(value)  # reached through a link: offered, so Django keeps the filter
        return [(value, value) for value in sorted(values)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(**{self.field: value})


class ConsumerFilter(GroupValueFilter):
    title = _("consumer")
    parameter_name = field = "consumer"

    def known(self) -> list[str]:
        return [spec.name for spec in registry]


class QueueFilter(GroupValueFilter):
    title = _("queue")
    parameter_name = field = "queue"

    def known(self) -> list[str]:
        return [spec.queue for spec in registry]


class ExceptionTypeFilter(GroupValueFilter):
    title = _("exception type")
    parameter_name = field = "exception_type"


class FailureGroupFilter(admin.SimpleListFilter):
    """Dead letters of one fingerprint; reached from the failure groups page.

    It only ever offers the group already chosen: listing every fingerprint would be noise.
    It must offer that one, though: Django drops the filter of a list filter without choices.
    """

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

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(fingerprint=value)


class BoundedCountPaginator(Paginator):
    """A count that never reads the whole table.

    On PostgreSQL a result the planner expects to pass ``COUNT_UP_TO`` rows shows its estimate
    (``estimated``): the plain list after an outage, a busy consumer. Any other result is
    counted up to ``COUNT_UP_TO`` + 1 rows (``SELECT count(*) FROM (... LIMIT 10001)``), and
    one that reaches it is shown as "more than 10,000" (``capped``): the planner's estimate of a
    search or of a rare value can be far off, a bounded count cannot.
    """

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
        sql, params = queryset.order_by().query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
        plan = json.loads(plan) if isinstance(plan, str) else plan
        return int(plan[0]["Plan"]["Plan Rows"])
