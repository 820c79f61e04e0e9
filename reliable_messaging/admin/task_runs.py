"""The ``django.tasks`` tasks of the app's task backend in the admin, read-only: a task's
state changes only by its runs; a READY task's lost message can be sent again
(``docs/tasks.md``)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from ..choices import OutboxStatus, TaskRunStatus
from ..models import DeadLetter, OutboxMessage, TaskRun
from ..task_runs.naming import task_consumer_name
from . import bodies
from .scaling import BoundedListAdmin, FieldFilter, ReadOnlyAdmin


def dead_letter_of(run: TaskRun) -> DeadLetter | None:
    """The dead letter of a task's message, recorded by the consumer of its queue."""
    rows = DeadLetter.objects.using(run._state.db)
    return rows.of(task_consumer_name(run.backend, run.queue_name), run.id).first()


class TaskQueueFilter(FieldFilter):
    """The queues ``TASKS`` declares: a DISTINCT over every task would read them all."""

    title = _("queue")
    parameter_name = "queue_name"

    def known(self) -> list[str]:
        return [
            queue
            for params in (getattr(settings, "TASKS", None) or {}).values()
            if isinstance(params, dict)
            for queue in params.get("QUEUES") or ()
            if isinstance(queue, str)
        ]


@admin.register(TaskRun)
class TaskRunAdmin(ReadOnlyAdmin, BoundedListAdmin):
    """Tasks enqueued through the task backend, latest first, and each one's result."""

    list_display = (
        "enqueued_at",
        "id",
        "task_path",
        "queue_name",
        "status",
        "attempts",
        "started_at",
        "finished_at",
    )
    list_filter = ("status", TaskQueueFilter)
    search_fields = ("id",)  # only so that Django shows the search box
    exact_search_fields = ("id", "task_path")
    search_help_text = _("An exact task id (its result's id), or a task's dotted path.")
    ordering = ("-enqueued_at",)
    _SUMMARY = (
        *("id", "task_path", "backend", "queue_name", "priority", "status", "attempts"),
        *("dead_letter_link", "message_link"),
    )
    _RUNS = (
        *("worker_ids_block", "enqueued_at", "run_after", "started_at", "last_attempted_at"),
        "finished_at",
    )
    fieldsets = (
        (None, {"fields": _SUMMARY}),
        (_("Arguments"), {"fields": ("args_block", "kwargs_block")}),
        (_("Result"), {"fields": ("return_value_block", "errors_block")}),
        (_("Runs"), {"fields": _RUNS}),
    )
    # No readonly_fields: a view-only admin (ReadOnlyAdmin) shows every field of its fieldsets
    # read-only, the display methods included.
    actions = ("send_again",)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_send_again_permission(self, request: HttpRequest) -> bool:
        """Whoever holds the model's change permission: sending a message changes no row."""
        codename = get_permission_codename("change", self.opts)
        return request.user.has_perm(f"{self.opts.app_label}.{codename}")

    @admin.action(
        description=_("Send the selected ready tasks' messages again"),
        permissions=["send_again"],
    )
    def send_again(self, request: HttpRequest, queryset: QuerySet[TaskRun]) -> None:
        """A READY task whose message left the outbox and was lost (a purged queue) is never
        run: a copy under its id, which runs it at most once (``docs/tasks.md``)."""
        from ..contrib.task_backend import send_ready_again  # the task framework, if installed

        done = send_ready_again(queryset)
        self.message_user(
            request,
            ngettext(
                "%d task's message sent again: its consumer runs the task at most once.",
                "%d tasks' messages sent again: their consumer runs each task at most once.",
                done.sent,
            )
            % done.sent,
            messages.SUCCESS,
        )
        if done.not_ready:
            self.message_user(
                request,
                ngettext(
                    "%d selected task is not ready (running or finished): left alone.",
                    "%d selected tasks are not ready (running or finished): left alone.",
                    done.not_ready,
                )
                % done.not_ready,
                messages.WARNING,
            )
        if done.in_outbox:
            self.message_user(
                request,
                ngettext(
                    "%d selected task's message has not left the outbox (see its message "
                    "line): left alone.",
                    "%d selected tasks' messages have not left the outbox (see their message "
                    "lines): left alone.",
                    done.in_outbox,
                )
                % done.in_outbox,
                messages.WARNING,
            )
        if done.no_backend:
            self.message_user(
                request,
                ngettext(
                    "%d selected task's backend is no longer one of ours in TASKS: left alone.",
                    "%d selected tasks' backends are no longer ours in TASKS: left alone.",
                    done.no_backend,
                )
                % done.no_backend,
                messages.WARNING,
            )

    @admin.display(description=_("arguments"))
    def args_block(self, obj: TaskRun) -> str:
        return bodies.shown_json(obj.args)

    @admin.display(description=_("keyword arguments"))
    def kwargs_block(self, obj: TaskRun) -> str:
        return bodies.shown_json(obj.kwargs)

    @admin.display(description=_("return value"))
    def return_value_block(self, obj: TaskRun) -> str:
        if obj.status != TaskRunStatus.SUCCESSFUL:
            return "-"
        return bodies.shown_json(obj.return_value)

    @admin.display(description=_("errors"))
    def errors_block(self, obj: TaskRun) -> str:
        """One entry per failed attempt, oldest first: its exception's class and traceback."""
        if not obj.errors:
            return "-"
        return format_html_join(
            "",
            '<div class="rm-task-error"><p>{} <code>{}</code></p>{}</div>',
            (
                (
                    gettext("Error %(number)d:") % {"number": number},
                    error.get("exception_class_path", "?"),
                    bodies.shown_text(error.get("traceback", "")),
                )
                for number, error in enumerate(obj.errors, 1)
                if isinstance(error, dict)
            ),
        )

    @admin.display(description=_("workers"))
    def worker_ids_block(self, obj: TaskRun) -> str:
        """The worker (``host:pid``) of each attempt, in order."""
        if not obj.worker_ids:
            return "-"
        return format_html_join(", ", "<code>{}</code>", ((w,) for w in obj.worker_ids))

    @admin.display(description=_("message"))
    def message_link(self, obj: TaskRun) -> str:
        """Where a READY task's message is: waiting in the outbox, not sent (its queue gone,
        say), or sent and waiting in its queue for a worker."""
        if obj.status != TaskRunStatus.READY:
            return "-"
        row = (
            OutboxMessage.objects.using(obj._state.db)
            .filter(message_id=obj.pk)
            .only("status", "attempts", "last_error", "next_attempt_at", "sent_at")
            .order_by("-pk")
            .first()
        )
        if row is None:
            return gettext("none in the outbox (cancelled, or purged)")
        if row.status == OutboxStatus.SCHEDULED:
            said = gettext("scheduled, due at %(due)s") % {
                "due": bodies.moment(row.next_attempt_at)
            }
        elif row.status in (OutboxStatus.SENT, OutboxStatus.UNROUTED):
            said = gettext("sent at %(sent)s: in its queue until a worker takes it") % {
                "sent": bodies.moment(row.sent_at)
            }
        elif row.status == OutboxStatus.FAILED:
            said = gettext("not sent (%(error)s): the outbox's retry action sends it again") % {
                "error": row.last_error
            }
        elif row.attempts:
            said = gettext("not sent yet, attempt %(attempts)d failed (%(error)s)") % {
                "attempts": row.attempts,
                "error": row.last_error,
            }
        else:
            said = gettext("waiting for the relay to send it")
        url = reverse(
            f"{self.admin_site.name}:reliable_messaging_outboxmessage_change", args=[row.pk]
        )
        return format_html('<a href="{}" id="rm-task-message">{}</a>', url, said)

    @admin.display(description=_("dead letter"))
    def dead_letter_link(self, obj: TaskRun) -> str:
        """A failed task's dead letter, where it is reviewed and replayed."""
        if obj.status != TaskRunStatus.FAILED:
            return "-"
        letter = dead_letter_of(obj)
        if letter is None:
            return gettext("none (deleted?)")
        url = reverse(
            f"{self.admin_site.name}:reliable_messaging_deadletter_change", args=[letter.pk]
        )
        return format_html(
            '<a href="{}" id="rm-task-dead-letter">{}</a> ({})',
            url,
            gettext("dead letter #%(id)s") % {"id": letter.pk},
            letter.get_status_display(),
        )
