"""The "Edit and replay" page of a dead letter, for users who may edit its consumer's dead
letters (``dead_letters.permissions.can_edit``); ``dead_letters/edit.py`` does the work."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import router, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.utils.translation import gettext

from ..dead_letters.edit import (
    Edit,
    EditRefused,
    check_edit,
    editable_headers,
    never_editable,
    original_payload_text,
    original_processed,
    pretty,
    replay_edited,
)
from ..dead_letters.permissions import can_edit
from ..models import DeadLetter
from ..publishing.wake_after_commit import wake_relay_after_commit
from .operations import OperationPages, log_rows, operator


def _kind(line: str) -> str:
    """The class the page colours a line of the diff by."""
    if line.startswith(("+++", "---")):
        return "file"
    return {"@": "hunk", "+": "added", "-": "removed"}.get(line[:1], "same")


class EditReplayPage(OperationPages):
    """The page, a base of the dead letters' ModelAdmin."""

    def edit_replay_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the form, filled with the original. POST ``preview``: the diff and the problems.
        POST ``replay``: the edited copy is replayed, or the page comes back with why not."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        obj = self.dead_letter_or_404(request, object_id)
        if not can_edit(request.user, obj.consumer):
            raise PermissionDenied
        previewed = request.method == "POST"
        if previewed:
            form: dict[str, Any] = {
                name: str(request.POST.get(name, "")) for name in ("payload", "headers", "reason")
            }
            form["force"] = bool(request.POST.get("force"))
            if "replay" in request.POST and (done := self._replay(request, obj, form)):
                return done
            edit = check_edit(obj, **_edit_of(form))
        else:
            form = {"payload": original_payload_text(obj), "headers": pretty(editable_headers(obj))}
            form.update(reason="", force=False)
            never = never_editable(obj)
            edit = Edit(already_processed=original_processed(obj))
            edit.problems += [never] if never else []
        return self.render_page(
            request,
            "edit_replay",
            gettext("Edit and replay dead letter #%(id)s") % {"id": obj.pk},
            original=obj,
            form=form,
            problems=edit.problems,
            diff_lines=[(_kind(line), line) for line in edit.diff.splitlines()],
            previewed=previewed,
            already_processed=edit.already_processed,
            changelist_url=self.console_url("changelist"),
            change_url=self.console_url("change", obj.pk),
        )

    def _replay(
        self, request: HttpRequest, obj: DeadLetter, form: dict[str, Any]
    ) -> HttpResponse | None:
        """Replay the edited copy: back to the original's page, or None when it is refused."""
        using = router.db_for_write(DeadLetter)
        try:
            with transaction.atomic(using=using):
                done = replay_edited(obj, **_edit_of(form), replayed_by=operator(request))
                message = gettext("Edited and replayed as message %(id)s: %(reason)s") % {
                    "id": done.message_id,
                    "reason": form["reason"].strip(),
                }
                log_rows(request, DeadLetter.objects.filter(pk=obj.pk), message)
                wake_relay_after_commit(using)  # the relay claims the copy's row once committed
        except EditRefused:
            return None
        self.message_user(
            request,
            gettext(
                "The edited copy was replayed as message %(id)s: the relay sends it to the queue "
                "of %(consumer)s only. This dead letter is unchanged and awaits the copy's outcome."
            )
            % {"id": done.message_id, "consumer": obj.consumer},
            messages.SUCCESS,
        )
        return redirect(self.console_url("change", obj.pk))


def _edit_of(form: dict[str, Any]) -> dict[str, Any]:
    return {
        "payload_text": form["payload"],
        "headers": form["headers"],
        "reason": form["reason"],
        "force": form["force"],
    }
