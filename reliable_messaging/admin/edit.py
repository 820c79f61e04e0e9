"""The "Edit and replay" page of a dead letter: edit the payload and the user headers, preview
the diff and what would be refused, give a reason, and replay the edited copy
(:mod:`reliable_messaging.dead_letters.edit` does the work).

Open to users who may edit that consumer's dead letters (``dead_letters.permissions.can_edit``);
others get 403.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.exceptions import PermissionDenied
from django.db import router, transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.utils.translation import gettext

from ..dead_letters.edit import (
    EditRefused,
    check_edit,
    editable_headers,
    original_payload_text,
    original_processed,
    pretty,
    replay_edited,
)
from ..dead_letters.permissions import can_edit
from ..models import DeadLetter
from ..publishing.wake_after_commit import wake_relay_after_commit
from .console import DeadLetterConsole
from .operations import operator


def diff_lines(diff: str) -> list[tuple[str, str]]:
    """The diff's lines with the class the page colours them by."""
    lines = []
    for line in diff.splitlines():
        if line.startswith(("+++", "---")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "added"
        elif line.startswith("-"):
            kind = "removed"
        else:
            kind = "same"
        lines.append((kind, line))
    return lines


def edit_replay_view(
    model_admin: DeadLetterConsole, request: HttpRequest, object_id: str
) -> HttpResponse:
    """GET: the form, filled with the original. POST ``preview``: the diff and the problems.
    POST ``replay``: the edited copy is replayed, or the page comes back with why not."""
    if request.method not in ("GET", "POST"):
        return HttpResponseNotAllowed(["GET", "POST"])
    obj = model_admin.get_object(request, object_id)
    if obj is None:
        raise Http404(gettext("No dead letter with id %(id)s.") % {"id": object_id})
    if not can_edit(request.user, obj.consumer):
        raise PermissionDenied
    form: dict[str, Any] = {
        "payload": original_payload_text(obj),
        "headers": pretty(editable_headers(obj)),
        "reason": "",
        "force": False,
    }
    problems: list[str] = []
    diff = ""
    already_processed = False
    previewed = False
    if request.method == "POST":
        form = {
            "payload": str(request.POST.get("payload", "")),
            "headers": str(request.POST.get("headers", "")),
            "reason": str(request.POST.get("reason", "")),
            "force": bool(request.POST.get("force")),
        }
        if "replay" in request.POST:
            done = _replay(model_admin, request, obj, form)
            if done is not None:
                return done
        edit = check_edit(
            obj,
            payload_text=form["payload"],
            headers=form["headers"],
            reason=form["reason"],
            force=form["force"],
        )
        problems, diff, already_processed = edit.problems, edit.diff, edit.already_processed
        previewed = True
    else:
        already_processed = original_processed(obj)
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": gettext("Edit and replay dead letter #%(id)s") % {"id": obj.pk},
        "original": obj,
        "form": form,
        "problems": problems,
        "diff_lines": diff_lines(diff),
        "previewed": previewed,
        "already_processed": already_processed,
        "changelist_url": model_admin.console_url("changelist"),
        "change_url": model_admin.console_url("change", obj.pk),
    }
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(
        request, "admin/reliable_messaging/deadletter/edit_replay.html", context
    )


def _replay(
    model_admin: DeadLetterConsole, request: HttpRequest, obj: DeadLetter, form: dict[str, Any]
) -> HttpResponse | None:
    """Replay the edited copy: back to the original's page with a message naming the copy, or
    None (the page shows the problems) when it is refused."""
    using = router.db_for_write(DeadLetter)
    try:
        with transaction.atomic(using=using):
            done = replay_edited(
                obj,
                payload_text=form["payload"],
                headers=form["headers"],
                reason=form["reason"],
                replayed_by=operator(request),
                force=form["force"],
            )
            user: Any = request.user
            LogEntry.objects.log_actions(
                user_id=user.pk,
                queryset=DeadLetter.objects.filter(pk=obj.pk),
                action_flag=CHANGE,
                change_message=gettext("Edited and replayed as message %(id)s: %(reason)s")
                % {"id": done.message_id, "reason": form["reason"].strip()},
            )
            wake_relay_after_commit(using)  # the relay claims the copy's row once committed
    except EditRefused:
        return None
    model_admin.message_user(
        request,
        gettext(
            "The edited copy was replayed as message %(id)s: the relay sends it to the queue "
            "of %(consumer)s only. This dead letter is unchanged and awaits the copy's outcome."
        )
        % {"id": done.message_id, "consumer": obj.consumer},
        messages.SUCCESS,
    )
    return redirect(model_admin.console_url("change", obj.pk))
