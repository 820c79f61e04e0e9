"""The dead letters' admin: the list, the detail page and the actions; the console's own pages
(failure groups, confirmation, the replay and discard buttons) live in ``admin/console.py``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from ..choices import DeadLetterReason, DeadLetterStatus
from ..conf import messaging_settings
from ..contracts import consumer_payload_errors
from ..dead_letters import selection
from ..dead_letters.edit import never_editable
from ..dead_letters.permissions import can_edit
from ..dead_letters.replay import UNREPLAYABLE_REASONS, missing_task_rows, stale_replays
from ..dead_letters.replay import refusal as replay_refusal
from ..managers import DeadLetterQuerySet
from ..models import DeadLetter, DeadLetterGroup, ProcessedMessage, Replay, TaskRun
from ..task_runs.naming import is_task_consumer
from . import bodies, scaling
from .console import DeadLetterConsole
from .edit import EditReplayPage


def trace_link(trace_id: str, span_id: str = "") -> str:
    """A trace id, linked with ``TRACE_URL_TEMPLATE`` when it is set and the ids are hex (a
    stored id is data a producer could have chosen)."""
    if not re.fullmatch("[0-9a-f]{32}", trace_id) or not re.fullmatch("([0-9a-f]{16})?", span_id):
        return format_html("{}", trace_id or "-")
    template = messaging_settings.trace_url_template
    if not template:
        return format_html("<code>{}</code>", trace_id)
    url = template.format(trace_id=trace_id, span_id=span_id)
    return format_html('<a href="{}" rel="noopener"><code>{}</code></a>', url, trace_id)


def _table(css_class: str, heads: Iterable[Any], rows: Iterable[Iterable[Any]]) -> str:
    """An HTML table of ``rows`` under the headings ``heads``."""
    return format_html(
        '<table class="{}"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>',
        css_class,
        format_html_join("", "<th>{}</th>", ((head,) for head in heads)),
        format_html_join(
            "",
            "<tr>{}</tr>",
            ((format_html_join("", "<td>{}</td>", ((c,) for c in r)),) for r in rows),
        ),
    )


def _filter_query(request: HttpRequest) -> str:
    """The changelist's query string without its page number and error flag."""
    params = request.GET.copy()
    for key in ("p", "e"):
        params.pop(key, None)
    return params.urlencode()


# The replay ledger's rows a dead letter's page lists, newest first.
REPLAYS_SHOWN = 50
# The search of words reads trigram indexes, which answer words of this many characters or more.
SHORTEST_WORD = 3
# The detail page's sections (its message shows the payload as JSON, or else the raw body).
_SUMMARY = (
    *("message_id", "consumer", "queue", "exchange", "routing_key", "content_type", "status"),
    *("replay_count", "processed"),
)
_FAILURE = (
    *("reason", "exception_type", "exception_message_block", "attempts", "first_failed_at"),
    *("last_failed_at", "failure_group", "trace"),
)
_HISTORY = ("history_table", "created_at", "updated_at")
_HISTORY_HEADS = (_("when"), _("event"), _("by"), _("details"))
_REPLAY_HEADS = (_("when"), _("by"), _("kind"), _("outcome"), _("copy's message ID"), _("reason"))


@admin.register(DeadLetter)
class DeadLetterAdmin(
    DeadLetterConsole, EditReplayPage, scaling.ReadOnlyAdmin, scaling.BoundedListAdmin
):
    """Review, replay, discard and delete dead letters; see their failure groups."""

    # Pairs share a cell (consumer over its queue, exception type over its message) so that
    # the list fits a laptop's screen next to the filters.
    list_display = (
        "when",
        "consumer_and_queue",
        "routing_key",
        "message_id_display",
        "reason",
        "exception_and_message",
        "attempts",
        "status_display",
    )
    list_display_links = ("when", "message_id_display")
    # None of them reads every dead letter (admin/scaling.py): no DISTINCT, no date_hierarchy.
    list_filter = (
        "status",
        scaling.ConsumerFilter,
        scaling.QueueFilter,
        "reason",
        scaling.ExceptionTypeFilter,
        ("last_failed_at", admin.DateFieldListFilter),
        scaling.FailureGroupFilter,
    )
    # Only so that Django shows the search box: get_search_results does the search.
    search_fields = ("message_id",)
    search_help_text = _(
        "An exact message_id, or words of the exception message or of the payload's JSON."
    )
    ordering = ("-last_failed_at", "-id")
    list_per_page = 50
    actions = ("replay_selected", "force_replay_selected", "discard_selected")
    # No readonly_fields: a view-only admin (ReadOnlyAdmin) shows every field of its fieldsets
    # read-only, the display methods included.
    # ------------------------------------------------------------------ list

    @admin.display(description=_("when"), ordering="last_failed_at")
    def when(self, obj: DeadLetter) -> str:
        return bodies.moment(obj.last_failed_at, "Y-m-d H:i")

    @admin.display(description=_("message ID"), ordering="message_id")
    def message_id_display(self, obj: DeadLetter) -> str:
        if not obj.message_id:
            return gettext("(no id)")
        if len(obj.message_id) <= 14:
            return obj.message_id
        # A UUID would wrap over five lines; the full id is in the tooltip and on the page.
        return format_html('<span title="{}">{}…</span>', obj.message_id, obj.message_id[:8])

    @admin.display(description=_("consumer and queue"), ordering="consumer")
    def consumer_and_queue(self, obj: DeadLetter) -> str:
        return format_html('{}<br><small class="rm-sub">{}</small>', obj.consumer, obj.queue)

    @admin.display(description=_("exception and message"), ordering="exception_type")
    def exception_and_message(self, obj: DeadLetter) -> str:
        text = obj.exception_message.splitlines()[0] if obj.exception_message else ""
        text = text if len(text) <= 70 else text[:69] + "…"
        if not obj.exception_type:
            return format_html('<small class="rm-message">{}</small>', text)
        return format_html(
            '<span title="{}">{}</span><br><small class="rm-message">{}</small>',
            obj.exception_type,
            obj.exception_type.rsplit(".", 1)[-1],
            text,
        )

    @admin.display(description=_("status"), ordering="status")
    def status_display(self, obj: DeadLetter) -> str:
        if obj.status == DeadLetterStatus.REPLAYED:
            badge_text, note = gettext("replayed"), gettext("awaiting outcome")
        else:
            badge_text = obj.get_status_display()
            note = (
                ngettext("replayed once", "replayed %(count)d times", obj.replay_count)
                % {"count": obj.replay_count}
                if obj.replay_count
                else ""
            )
        badge = format_html(
            '<span class="rm-status rm-status-{}" title="{}">{}</span>',
            obj.status,
            obj.get_status_display(),
            badge_text,
        )
        if not note:
            return badge
        return format_html('{}<br><small class="rm-sub">{}</small>', badge, note)

    def get_queryset(self, request: HttpRequest) -> QuerySet[DeadLetter]:
        # The list shows none of them; the detail page reads the body's head alone.
        return super().get_queryset(request).defer("body", "payload", "traceback", "history")

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        words = selection.search_words(term)
        if term.startswith("=") or not any(len(word) < SHORTEST_WORD for word in words):
            return selection.search(queryset, search_term), False
        if len(words) == 1:  # a short message_id is found by its index
            exact = queryset.filter(message_id=term)
            if exact.exists():
                return exact, False
        # No index answers a word this short in the texts: it would read every dead letter.
        self.message_user(
            request,
            gettext(
                "Search words of at least %(count)d characters, or an exact message_id "
                "(“=ID”): a shorter word would read every dead letter."
            )
            % {"count": SHORTEST_WORD},
            messages.ERROR,
        )
        return queryset.none(), False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        query = _filter_query(request)
        context = {
            "has_replay_permission": self.has_replay_permission(request),
            "failure_groups_url": self.console_url("groups"),
            "replay_matching_url": self.console_url("replay_matching", query=query),
            "discard_matching_url": self.console_url("discard_matching", query=query),
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    # ------------------------------------------------------------------ detail

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        body = "pretty_payload" if obj is None or self._body(obj)[2] is not None else "raw_body"
        edited = ("replay_of_link",) if obj and obj.replay_of_id else ()
        task = ("task_run_link",) if obj and is_task_consumer(obj.consumer) else ()
        invalid = obj is not None and obj.reason == DeadLetterReason.INVALID_PAYLOAD
        return (
            (None, {"fields": (*_SUMMARY, *task)}),
            (
                _("Failure"),
                {"fields": (*_FAILURE, *(("payload_errors_table",) if invalid else ()))},
            ),
            (_("Traceback"), {"fields": ("traceback_block",)}),
            (_("Message"), {"fields": (body, "pretty_headers")}),
            (_("Replays"), {"fields": (*edited, "replays_table")}),
            (_("History"), {"fields": _HISTORY}),
        )

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context: dict[str, Any] = {"has_replay_permission": self.has_replay_permission(request)}
        obj = self.get_object(request, object_id)
        if obj is not None:
            # A replay whose outcome never came (STALE_REPLAY_AFTER) can be replayed or
            # discarded again, so a lost replay never parks an ordered key for good.
            stale = DeadLetter.objects.filter(stale_replays(), pk=obj.pk).exists()
            # The replay's own rule (what any body would meet): no button it would refuse.
            held = replay_refusal(
                obj,
                already_processed=False,
                force=True,
                now=timezone.now(),
                body_replaced=True,
                task_row_gone=bool(missing_task_rows([obj], obj._state.db)),
            )
            context.update(
                can_replay=held is None and obj.reason not in UNREPLAYABLE_REASONS,
                can_discard=obj.status == DeadLetterStatus.DEAD or stale,
                # Why a dead one cannot be replayed at all (a Celery task's), said on its page.
                not_replayable=held.text if held and obj.status == DeadLetterStatus.DEAD else "",
                processed_row=self._processed_row(obj),
                replay_url=self.console_url("replay", obj.pk),
                discard_url=self.console_url("discard", obj.pk),
                can_edit_replay=can_edit(request.user, obj.consumer)
                and held is None
                and never_editable(obj) is None,
                edit_replay_url=self.console_url("edit_replay", obj.pk),
            )
        return super().change_view(
            request, object_id, form_url, {**context, **(extra_context or {})}
        )

    @staticmethod
    def _body(obj: DeadLetter) -> tuple[bytes, int, str | None]:
        """The body's first bytes, its size, and its JSON indented (None: raw), read once."""
        cached: tuple[bytes, int, str | None] | None = getattr(obj, "_rm_body", None)
        if cached is None:
            rows = DeadLetter.objects.using(obj._state.db)
            head, size = bodies.head_and_size(rows, obj.pk)
            payload = None
            if size <= bodies.SHOWN_BYTES:
                try:
                    payload = obj.payload
                except RecursionError:  # a JSON value nested too deep for Python's parser
                    payload = None
            cached = (head, size, bodies.pretty_body(head, size, payload))
            obj._rm_body = cached  # type: ignore[attr-defined]
        return cached

    @staticmethod
    def _processed_row(obj: DeadLetter) -> ProcessedMessage | None:
        if not obj.message_id:
            return None
        return ProcessedMessage.objects.of(obj.consumer, obj.message_id).first()

    @admin.display(description=_("processed by the consumer"))
    def processed(self, obj: DeadLetter) -> str:
        row = self._processed_row(obj)
        if row is None:
            return gettext("no")
        inbox = reverse(f"{self.admin_site.name}:reliable_messaging_processedmessage_changelist")
        return format_html(
            '{} <a href="{}?{}">{}</a> ({})',
            gettext("yes, at"),
            inbox,
            urlencode({"q": f"{obj.message_id} {obj.consumer}"}),
            bodies.moment(row.processed_at),
            gettext("a replay runs the handler again only if forced"),
        )

    @admin.display(description=_("trace"))
    def trace(self, obj: DeadLetter) -> str:
        """The trace of the last failure (a replay's is in the history)."""
        if not obj.trace_id:
            return "-"
        return format_html(
            '{} <small class="rm-sub">{} {}</small>',
            trace_link(obj.trace_id, obj.span_id),
            gettext("span"),
            obj.span_id or "-",
        )

    @admin.display(description=_("exception message"))
    def exception_message_block(self, obj: DeadLetter) -> str:
        return bodies.shown_text(obj.exception_message) if obj.exception_message else "-"

    @admin.display(description=_("payload errors"))
    def payload_errors_table(self, obj: DeadLetter) -> str:
        """The stored payload checked now against its consumer's declared type: each field's
        path and what is wrong (never the value), or that it matches now (after a fix)."""
        errors = consumer_payload_errors(obj.consumer, obj.payload)
        if errors is None:
            return gettext("- (the consumer declares no payload type in this deployment)")
        if not errors:
            return gettext("none: the payload matches the consumer's declared type now")
        rows = ((error["path"] or gettext("(payload)"), error["message"]) for error in errors)
        return _table("rm-payload-errors", (_("field"), _("error")), rows)

    @admin.display(description=_("traceback"))
    def traceback_block(self, obj: DeadLetter) -> str:
        return bodies.shown_text(obj.traceback) if obj.traceback else "-"

    @admin.display(description=_("payload"))
    def pretty_payload(self, obj: DeadLetter) -> str:
        return bodies.shown_text(self._body(obj)[2] or "", self.console_url("body", obj.pk))

    @admin.display(description=_("raw body"))
    def raw_body(self, obj: DeadLetter) -> str:
        head, size, _pretty = self._body(obj)
        return bodies.raw_body(head, size, self.console_url("body", obj.pk))

    @admin.display(description=_("headers"))
    def pretty_headers(self, obj: DeadLetter) -> str:
        return bodies.shown_json(obj.headers)

    def body_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The whole body, byte for byte, as a file: for those who may see the dead letter."""
        obj = self.dead_letter_or_404(request, object_id)
        if not self.has_view_permission(request, obj):
            raise PermissionDenied
        return bodies.download(obj, bytes(obj.body))

    @admin.display(description=_("failure group"))
    def failure_group(self, obj: DeadLetter) -> str:
        if not obj.fingerprint:
            return "-"
        count = DeadLetterGroup.objects.of_fingerprint(obj.fingerprint)["total"]
        return format_html(
            '<a href="{}">{}</a> <code>{}</code>',
            self.console_url("changelist", query=urlencode({"fingerprint": obj.fingerprint})),
            ngettext(
                "%(count)d dead letter fails this way",
                "%(count)d dead letters fail this way",
                count,
            )
            % {"count": count},
            obj.fingerprint,
        )

    @admin.display(description=_("edited from"))
    def replay_of_link(self, obj: DeadLetter) -> str:
        if not obj.replay_of_id:
            return "-"
        return format_html(
            '<a href="{}" id="rm-replay-of">{}</a>',
            self.console_url("change", obj.replay_of_id),
            gettext("edited from dead letter #%(id)s") % {"id": obj.replay_of_id},
        )

    @admin.display(description=_("task"))
    def task_run_link(self, obj: DeadLetter) -> str:
        """The ``django.tasks`` task whose message this is (a task queue's consumer)."""
        run = TaskRun.objects.using(obj._state.db).filter(pk=obj.message_id).first()
        if run is None:
            return "-"
        return format_html(
            '<a href="{}" id="rm-dead-letter-task">{}</a> ({})',
            reverse(f"{self.admin_site.name}:reliable_messaging_taskrun_change", args=[run.pk]),
            run.task_path,
            run.get_status_display(),
        )

    @admin.display(description=_("replays and their outcomes"))
    def replays_table(self, obj: DeadLetter) -> str:
        """The replay ledger's rows of this dead letter: when, by whom, what became of each
        copy (the dead letter it became when it failed again), and an edit's reason."""
        rows = list(Replay.objects.filter(dead_letter=obj.pk).order_by("-id")[:REPLAYS_SHOWN])

        def failed_as(row: Replay) -> str:
            if not row.failed_as_id:
                return ""
            return format_html(
                ' <a href="{}">{}</a>',
                self.console_url("change", row.failed_as_id),
                gettext("as dead letter #%(id)s") % {"id": row.failed_as_id},
            )

        cells = (
            (
                bodies.moment(row.replayed_at),
                row.replayed_by,
                row.get_kind_display(),
                format_html(
                    '<span class="rm-outcome rm-outcome-{}">{}</span>{}',
                    row.outcome,
                    row.get_outcome_display(),
                    failed_as(row),
                ),
                format_html("<code>{}</code>", row.message_id),
                row.reason,
            )
            for row in rows
        )
        return _table("rm-history rm-replays", _REPLAY_HEADS, cells) if rows else "-"

    @admin.display(description=_("attempts and replays"))
    def history_table(self, obj: DeadLetter) -> str:
        events = obj.history if isinstance(obj.history, list) else [obj.history]
        if not events:
            return "-"

        def detail(key: str, value: Any) -> str:
            if key == "trace_id":
                return format_html("{}: {}", gettext("trace"), trace_link(str(value)))
            if key == "diff":  # an edited replay's
                return format_html(
                    '<details><summary>{}</summary><pre class="rm-pre">{}</pre></details>',
                    gettext("diff"),
                    value,
                )
            return format_html("{}: {}", key, value)

        def row(event: Any) -> tuple[str, str, str, str]:
            if not isinstance(event, dict):
                return ("", "", "", str(event))
            details = format_html_join(
                ", ",
                "{}",
                (
                    (detail(key, value),)
                    for key, value in event.items()
                    if key not in ("event", "at", "by") and value not in ("", None, False)
                ),
            )
            when = bodies.moment(event.get("at", ""))
            return (when, str(event.get("event", "")), str(event.get("by", "")), details)

        return _table("rm-history", _HISTORY_HEADS, (row(event) for event in events))

    # ------------------------------------------------------------------ actions

    @admin.action(description=_("Replay the selected dead letters"), permissions=["replay"])
    def replay_selected(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> HttpResponse | None:
        return self._act(request, queryset, "replay_matching", force=False)

    @admin.action(
        description=_("Replay the selected dead letters, even if already processed…"),
        permissions=["replay"],
    )
    def force_replay_selected(
        self, request: HttpRequest, queryset: DeadLetterQuerySet
    ) -> HttpResponse | None:
        if request.POST.get("post") == "yes" or request.POST.get("select_across") == "1":
            return self._act(request, queryset, "replay_matching", force=True)
        return self.render_page(
            request,
            "confirm_operation",
            gettext("Replay the selected dead letters, even if already processed?"),
            operation="replay",
            forced_selection=list(queryset.order_by("pk").only("message_id", "consumer", "reason")),
            selection_processed=queryset.already_processed().count(),
            action_checkbox_name=helpers.ACTION_CHECKBOX_NAME,
            changelist_url=self.console_url("changelist", query=_filter_query(request)),
        )

    @admin.action(
        description=_("Discard the selected dead letters (kept for the record)"),
        permissions=["replay"],
    )
    def discard_selected(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter]
    ) -> HttpResponse | None:
        return self._act(request, queryset, "discard_matching")

    def _act(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], bulk: str, force: Any = None
    ) -> HttpResponse | None:
        """Replay (``force`` given) or discard the selection; "select all N" in the list is bulk
        work, sent to its confirmation page."""
        if request.POST.get("select_across") == "1":
            return HttpResponseRedirect(self.console_url(bulk, query=_filter_query(request)))
        ids = list(queryset.order_by("pk").values_list("pk", flat=True))
        how = gettext("selected in the list")
        if force is None:
            self.discard_and_report(request, ids, how=how)
        else:
            self.replay_and_report(request, ids, force=force, how=how)
        return None

    # ------------------------------------------------------------------ URLs

    def get_urls(self) -> list[URLPattern]:
        bulk, one = self.bulk_operation_view, self.object_operation_view
        pages: list[tuple[str, Any, str]] = [
            ("groups/", self.failure_groups_view, "groups"),
            ("<path:object_id>/body/", self.body_view, "body"),
            ("replay-matching/", partial(bulk, operation="replay"), "replay_matching"),
            ("discard-matching/", partial(bulk, operation="discard"), "discard_matching"),
            ("<path:object_id>/replay/", partial(one, operation="replay"), "replay"),
            ("<path:object_id>/edit-replay/", self.edit_replay_view, "edit_replay"),
            ("<path:object_id>/discard/", partial(one, operation="discard"), "discard"),
        ]
        return self.console_paths(pages) + super().get_urls()
