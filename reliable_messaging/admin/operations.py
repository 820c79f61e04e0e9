"""The admin's bulk replays and discards: recorded by a request (:func:`record_operation`),
carried out by the relay; a progress page (and its JSON) with a Cancel button, and the list of
operations. Each dead letter's history entry names the operator and the operation."""

from __future__ import annotations

from functools import partial
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from ..choices import UNFINISHED_OPERATION_STATES, OperationKind, ReplayOutcome
from ..dead_letters import ledger
from ..dead_letters.operations import COUNT_CAP
from ..dead_letters.replay import STALE_REPLAY_AFTER
from ..models import DeadLetter, DeadLetterOperation
from .scaling import ReadOnlyAdmin


def capped_count(rows: QuerySet[Any], cap: int = COUNT_CAP) -> int:
    """How many rows, counting at most ``cap + 1``: past it, "more than" is all one needs."""
    return rows.order_by().values("pk")[: cap + 1].count()


def operator(request: HttpRequest) -> str:
    """Who did it, as the replay headers, the history and the operation record it."""
    return f"{request.user.get_username()} (admin)"


def log_rows(request: HttpRequest, rows: QuerySet[Any], message: str, flag: int = CHANGE) -> None:
    """One admin log entry per row, so its history page shows it."""
    user: Any = request.user  # admin views only run for logged-in staff
    LogEntry.objects.log_actions(
        user_id=user.pk, queryset=rows, action_flag=flag, change_message=message
    )


# Dead letters that failed again listed by an operation's page (the rest are counted).
FAILED_AGAIN_SHOWN = 50


def figures(operation: DeadLetterOperation) -> dict[str, Any]:
    """What the progress page and its JSON show: the counters and, for a replay, the outcomes."""
    rate = None
    if operation.started_at and operation.heartbeat_at and operation.done:
        seconds = (operation.heartbeat_at - operation.started_at).total_seconds()
        rate = round(operation.done / seconds) if seconds > 0 else None
    finished = operation.state not in UNFINISHED_OPERATION_STATES
    if operation.matched > COUNT_CAP:
        # Counted up to the cap only: how far the cursor got is the estimate.
        total: int | None = None
        share = operation.cursor / operation.max_pk if operation.max_pk else 0
    else:
        total = max(operation.matched, operation.done)
        share = operation.done / total if total else 0
    percent = 100 if operation.state == "done" else min(99, int(100 * share))
    outcomes: dict[str, int] | None = None
    settling = False
    if operation.kind == OperationKind.REPLAY:
        outcomes = dict(ledger.outcome_counts(operation))
        # Its copies are on their way: the page refreshes until they are presumed lost.
        settling = bool(outcomes[ReplayOutcome.IN_FLIGHT]) and (
            operation.finished_at is None
            or operation.finished_at > timezone.now() - STALE_REPLAY_AFTER
        )
    counters = ("kind", "state", "done", "replayed", "discarded", "refused", "skipped", "error")
    return {
        "id": operation.pk,
        **{name: getattr(operation, name) for name in counters},
        "finished": finished,
        "total": total,
        "total_text": str(total)
        if total is not None
        else gettext("more than %(cap)d") % {"cap": COUNT_CAP},
        "percent": percent,
        "rate": rate,
        "outcomes": outcomes,
        "settling": settling,
        "refresh": not finished or settling,
    }


def _operation(pk: int) -> DeadLetterOperation:
    # With its replays' outcome tally, in the same read (the page refreshes every 2 s).
    return get_object_or_404(DeadLetterOperation.objects.select_related("replay_outcomes"), pk=pk)


class OperationPages(admin.ModelAdmin):
    """The dead letters' ModelAdmin's console: its permission to replay, its pages' URLs and
    frame, and the bulk operations' pages. Each view checks its own permission."""

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """``reliable_messaging.replay_deadletter`` and the view permission (every path to a
        replay counts and shows dead letters): replay, discard and their pages."""
        user: Any = request.user
        return self.has_view_permission(request) and bool(
            user.has_perm(f"{self.opts.app_label}.replay_{self.opts.model_name}")
        )

    def console_url(self, name: str, *args: Any, query: str = "") -> str:
        """The URL of one of this admin's pages ("changelist", "change", "groups"...)."""
        url = reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{name}", args=args
        )
        return f"{url}?{query}" if query else url

    def console_paths(self, pages: list[tuple[str, Any, str]]) -> list[URLPattern]:
        """The URLs of ``(route, view, name)`` pages, named like the admin's own."""
        view = self.admin_site.admin_view  # login, staff and CSRF protection
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [path(route, view(page), name=f"{prefix}_{name}") for route, page, name in pages]

    def get_urls(self) -> list[URLPattern]:
        as_json = partial(self.progress_view, as_json=True)
        operations = [
            ("operations/<int:pk>/", self.progress_view, "operation"),
            ("operations/<int:pk>/status/", as_json, "operation_status"),
            ("operations/<int:pk>/cancel/", self.cancel_view, "operation_cancel"),
        ]
        return self.console_paths(operations) + super().get_urls()

    def dead_letter_or_404(self, request: HttpRequest, object_id: str) -> DeadLetter:
        obj: DeadLetter | None = self.get_object(request, object_id)
        if obj is None:
            raise Http404(gettext("No dead letter with id %(id)s.") % {"id": object_id})
        return obj

    def render_page(
        self, request: HttpRequest, name: str, title: str, /, **context: Any
    ) -> TemplateResponse:
        """One of the console's pages, ``deadletter/<name>.html``, in the admin's frame."""
        request.current_app = self.admin_site.name
        frame = {**self.admin_site.each_context(request), "opts": self.opts}
        template = f"admin/reliable_messaging/deadletter/{name}.html"
        return TemplateResponse(request, template, {**frame, "title": title, **context})

    def record_operation(
        self,
        request: HttpRequest,
        *,
        kind: str,
        selection: dict[str, Any],
        force: bool,
        matched: int,
        max_pk: int,
    ) -> HttpResponse:
        """Record the operation over the dead letters up to ``max_pk``, ``matched`` of them
        announced, and redirect to its progress page (that of the same one already under way)."""
        running = DeadLetterOperation.objects.same_as(kind, selection, force)
        if running is not None:
            self.message_user(
                request,
                gettext(
                    "The same operation (#%(pk)d, started by %(who)s) is already under way: "
                    "here is its progress."
                )
                % {"pk": running.pk, "who": running.requested_by},
                messages.WARNING,
            )
            return redirect(self.console_url("operation", running.pk))
        operation = DeadLetterOperation.objects.record(
            kind=kind,
            selection=selection,
            requested_by=operator(request),
            force=force,
            matched=matched,
            max_pk=max_pk,
        )
        rows = DeadLetterOperation.objects.filter(pk=operation.pk)
        log_rows(request, rows, gettext("Recorded."), ADDITION)
        self.message_user(
            request,
            gettext(
                "Operation #%(pk)d is recorded: the relay carries it out in batches. You may leave "
                "this page; it goes on without it."
            )
            % {"pk": operation.pk},
            messages.SUCCESS,
        )
        return redirect(self.console_url("operation", operation.pk))

    def _failed_again_figures(
        self, operation: DeadLetterOperation, values: dict[str, Any]
    ) -> dict[str, Any]:
        """The first dead letters an operation's replays became when they failed again."""
        replays = operation.kind == OperationKind.REPLAY
        shown = []
        for row in ledger.failed_again(operation.pk, FAILED_AGAIN_SHOWN) if replays else ():
            letter = row.failed_as
            pk = letter.pk if letter is not None else row.dead_letter_id
            error = (letter.exception_message or "").splitlines() if letter is not None else []
            shown.append(
                {
                    "dead_letter": pk,
                    "message_id": row.message_id,
                    "consumer": row.consumer,
                    "exception_type": letter.exception_type if letter is not None else "",
                    "error": error[0] if error else "",
                    "at": row.outcome_at.isoformat() if row.outcome_at else None,
                    "url": self.console_url("change", pk),
                }
            )
        total = (values["outcomes"] or {}).get(ReplayOutcome.FAILED_AGAIN, 0)
        ids = ",".join(str(item["dead_letter"]) for item in shown)
        return {
            "failed_again": shown,
            "failed_again_more": max(0, total - len(shown)),
            "failed_again_list_url": self.console_url("changelist", query=f"id__in={ids}")
            if shown
            else "",
        }

    def progress_view(self, request: HttpRequest, pk: int, as_json: bool = False) -> HttpResponse:
        """An operation's progress page, or (``as_json``) its figures, which the page polls."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        operation = _operation(pk)
        values = figures(operation)
        failed_again = self._failed_again_figures(operation, values)
        if as_json:
            return JsonResponse({**values, **failed_again})
        kind = operation.get_kind_display().capitalize()
        return self.render_page(
            request,
            "operation_progress",
            gettext("%(kind)s #%(pk)d: %(state)s")
            % {"kind": kind, "pk": operation.pk, "state": operation.get_state_display()},
            operation=operation,
            figures=values,
            **failed_again,
            can_cancel=not values["finished"] and self.has_replay_permission(request),
            cancel_url=self.console_url("operation_cancel", operation.pk),
            changelist_url=self.console_url("changelist"),
            operations_url=reverse(
                f"{self.admin_site.name}:reliable_messaging_deadletteroperation_changelist"
            ),
        )

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        """Cancel (POST): the batch under way finishes, no other starts; the rest stays as is."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        operation = _operation(pk)
        if DeadLetterOperation.objects.cancel(
            operation.pk, by=operator(request), at=timezone.now()
        ):
            rows = DeadLetterOperation.objects.filter(pk=operation.pk)
            log_rows(request, rows, gettext("Cancelled."))
            self.message_user(
                request,
                gettext(
                    "Operation #%(pk)d is cancelled: what it did stays done, the rest is left as "
                    "it is."
                )
                % {"pk": operation.pk},
                messages.SUCCESS,
            )
        else:
            self.message_user(
                request, gettext("The operation had already finished."), messages.WARNING
            )
        return redirect(self.console_url("operation", operation.pk))


@admin.register(DeadLetterOperation)
class DeadLetterOperationAdmin(ReadOnlyAdmin):
    """The bulk operations, newest first, each linked to its progress page for users who may
    view dead letters (a plain number for the others)."""

    list_display = (
        "progress_link",
        "kind",
        "state",
        "description",
        "done",
        "replayed",
        "discarded",
        "refused",
        "skipped",
        "requested_by",
        "created_at",
        "finished_at",
    )
    list_filter = ("state", "kind")
    list_per_page = 50
    show_full_result_count = False

    def get_list_display(self, request: HttpRequest) -> Any:
        dead_letters = self.admin_site.get_model_admin(DeadLetter)
        if dead_letters.has_view_permission(request):
            return self.list_display
        return ("number", *self.list_display[1:])

    def get_list_display_links(self, request: HttpRequest, list_display: Any) -> Any:
        # The progress link is the row's link (Django's own would wrap it in another <a>).
        return None if "progress_link" in list_display else ("number",)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("operation"), ordering="pk")
    def progress_link(self, obj: DeadLetterOperation) -> str:
        url = reverse(
            f"{self.admin_site.name}:reliable_messaging_deadletter_operation", args=[obj.pk]
        )
        return format_html('<a href="{}">#{}</a>', url, obj.pk)

    @admin.display(description=_("operation"), ordering="pk")
    def number(self, obj: DeadLetterOperation) -> str:
        return f"#{obj.pk}"

    @admin.display(description=_("selection"))
    def description(self, obj: DeadLetterOperation) -> str:
        return str((obj.selection or {}).get("description", ""))
