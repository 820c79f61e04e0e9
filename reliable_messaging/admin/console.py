"""The dead-letter console's own pages (failure groups, the confirmation of a bulk operation,
one dead letter's replay and discard buttons), and the replays and discards they share with the
actions. Each view checks its permission itself (``admin_view`` only ensures a staff user)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from django.contrib import messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db import router, transaction
from django.db.models import Max
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, QueryDict
from django.shortcuts import redirect
from django.utils import timezone
from django.utils.http import urlencode
from django.utils.translation import gettext, ngettext

from ..choices import DeadLetterStatus, GroupState
from ..dead_letters.operations import DRY_RUN_LIMIT, dry_run
from ..dead_letters.replay import REFUSAL_LABELS, ReplayResult, discard, replay_batch
from ..dead_letters.selection import (
    BY_MESSAGE_ID,
    BY_WORDS,
    NOT_FILTERS,
    SelectionError,
    matching,
    selection_from_query,
    targets,
    unreplayable,
    wanted,
)
from ..models import DeadLetter, DeadLetterGroup, FailureGroupState
from ..publishing.wake_after_commit import wake_relay_after_commit
from .operations import COUNT_CAP, OperationPages, capped_count, log_rows, operator

Operation = Literal["replay", "discard"]
# Refusals spelled out in the warning message; the rest are counted.
REFUSALS_SHOWN = 5
_OPERATORS = {"exact": "=", "gte": "≥", "gt": ">", "lte": "≤", "lt": "<", "isnull": "is null:"}


def log_changes(request: HttpRequest, ids: Sequence[int], message: str) -> None:
    """One admin log entry per dead letter, so its history page shows it."""
    rows = DeadLetter.objects.filter(pk__in=ids).only("pk", "message_id", "consumer", "reason")
    log_rows(request, rows, message)


def _how_many(verb: str, how: str, total: int) -> str:
    return ngettext(
        "%(verb)s (%(how)s).",
        "%(verb)s (%(how)s; %(count)d dead letters in this operation).",
        total,
    ) % {"verb": verb, "how": how, "count": total}


def describe_filter(request: HttpRequest, search_mode: str = "") -> list[str]:
    """The changelist's filter in words, e.g. ``["consumer = billing", "search “x”"]``; with
    ``search_mode``, how the search reads too."""
    parts = []
    for key, values in request.GET.lists():
        if key in NOT_FILTERS and key != "q":
            continue
        for value in values:
            if key == "q":
                parts.append(_describe_search(value, search_mode))
                continue
            field, _, lookup = key.partition("__")
            label = gettext("failure group") if field == "fingerprint" else field
            parts.append(f"{label} {_OPERATORS.get(lookup or 'exact', lookup)} {value}")
    return parts


def _describe_search(term: str, search_mode: str) -> str:
    if search_mode == BY_MESSAGE_ID:
        return gettext("message_id = %(id)s") % {"id": term.strip().removeprefix("=").strip()}
    if search_mode == BY_WORDS:
        return gettext("words “%(term)s” in the payload or the exception message") % {
            "term": term.strip()
        }
    return gettext("search “%(term)s”") % {"term": term}


class _Confirmed(NamedTuple):
    """What a confirmation page showed, sent back by its form: how the search read, the
    highest dead letter id it counted, and how many it announced."""

    search_mode: str
    max_pk: int
    announced: int

    @classmethod
    def of(cls, form: QueryDict) -> _Confirmed | None:
        """None for a POST without them (a script's): it is decided when it arrives."""
        if "max_pk" not in form or "announced" not in form:
            return None
        return cls(
            str(form.get("search_mode", "")),
            int(str(form.get("max_pk"))),
            int(str(form.get("announced"))),
        )


def _highest_id() -> int:
    """The highest dead letter id now: those stored later are not the page's."""
    return DeadLetter.objects.aggregate(top=Max("pk"))["top"] or 0


def _at_most(count: int) -> str:
    return gettext("more than %(cap)d") % {"cap": COUNT_CAP} if count > COUNT_CAP else str(count)


class DeadLetterConsole(OperationPages):
    """This module's pages and replays, a base of the dead letters' ModelAdmin."""

    # Dead letters of a selection replayed, or discarded, per transaction (each with its admin
    # log rows). "All matching" and failure groups are operations the relay carries out.
    batch_size = 500

    def replay_and_report(
        self, request: HttpRequest, ids: Sequence[int], *, force: bool, how: str
    ) -> ReplayResult:
        """Replay ``ids`` through the outbox, ``batch_size`` per transaction, log and report it."""
        result = ReplayResult()
        verb = gettext("Replayed, forced") if force else gettext("Replayed")
        message = _how_many(verb, how, len(ids))
        using = router.db_for_write(DeadLetter)
        for start in range(0, len(ids), size := self.batch_size):
            with transaction.atomic(using=using):
                batch = replay_batch(
                    ids[start : start + size], replayed_by=operator(request), force=force
                )
                log_changes(request, batch.replayed, message)
                if batch.replayed:  # the relay claims the replays' outbox rows once committed
                    wake_relay_after_commit(using)
            result.merge(batch)
        self._report_replay(request, result, force=force)
        return result

    def _report_replay(self, request: HttpRequest, result: ReplayResult, *, force: bool) -> None:
        replayed, refused = len(result.replayed), len(result.refused)
        if replayed:
            self.message_user(
                request,
                ngettext(
                    "%(count)d dead letter was replayed: the relay sends it to the queue of the "
                    "consumer that failed it, and only there.",
                    "%(count)d dead letters were replayed: the relay sends them to the queues of "
                    "the consumers that failed them, and only there.",
                    replayed,
                )
                % {"count": replayed},
                messages.SUCCESS,
            )
        if refused:
            shown = sorted(result.refused)[:REFUSALS_SHOWN]
            message_ids = dict(
                DeadLetter.objects.filter(pk__in=shown).values_list("pk", "message_id")
            )
            details = "; ".join(
                f"#{pk} ({message_ids.get(pk) or gettext('no id')}): {result.refused[pk]}"
                for pk in shown
            )
            if refused > len(shown):
                more = refused - len(shown)
                details += " " + ngettext("and %(count)d more", "and %(count)d more", more) % {
                    "count": more
                }
            self.message_user(
                request,
                ngettext(
                    "%(count)d dead letter was not replayed: %(details)s",
                    "%(count)d dead letters were not replayed: %(details)s",
                    refused,
                )
                % {"count": refused, "details": details},
                messages.WARNING,
            )
            refused_rows = DeadLetter.objects.filter(pk__in=list(result.refused))
            processed = refused_rows.already_processed().count()
            if processed and not force:
                self.message_user(
                    request,
                    ngettext(
                        "%(count)d of them was already processed by its consumer. To run the "
                        "handler again anyway, use “force”: the action “Replay the selected dead "
                        "letters, even if already processed”, or the checkbox on the confirmation "
                        "page.",
                        "%(count)d of them were already processed by their consumers. To run the "
                        "handlers again anyway, use “force”: the action “Replay the selected dead "
                        "letters, even if already processed”, or the checkbox on the confirmation "
                        "page.",
                        processed,
                    )
                    % {"count": processed},
                    messages.INFO,
                )
        if not replayed and not refused:
            self.message_user(request, gettext("No dead letter to replay."), messages.WARNING)

    def discard_and_report(self, request: HttpRequest, ids: Sequence[int], *, how: str) -> int:
        """Discard those of ``ids`` still dead, ``batch_size`` per transaction; log and report.
        Returns how many were discarded."""
        message = _how_many(gettext("Discarded"), how, len(ids))
        discarded = 0
        for start in range(0, len(ids), size := self.batch_size):
            with transaction.atomic(using=router.db_for_write(DeadLetter)):
                rows = DeadLetter.objects.filter(pk__in=ids[start : start + size])
                done = discard(rows, discarded_by=operator(request))
                log_changes(request, done, message)
            discarded += len(done)
        if discarded:
            self.message_user(
                request,
                ngettext(
                    "%(count)d dead letter was discarded: it stays here, marked discarded, and "
                    "can still be replayed.",
                    "%(count)d dead letters were discarded: they stay here, marked discarded, and "
                    "can still be replayed.",
                    discarded,
                )
                % {"count": discarded},
                messages.SUCCESS,
            )
        skipped = len(ids) - discarded
        if skipped:
            self.message_user(
                request,
                ngettext(
                    "%(count)d dead letter was not discarded: only those with status “dead” are "
                    "(the others are resolved, awaiting a replay's outcome, or already discarded).",
                    "%(count)d dead letters were not discarded: only those with status “dead” are "
                    "(the others are resolved, awaiting a replay's outcome, or already discarded).",
                    skipped,
                )
                % {"count": skipped},
                messages.WARNING,
            )
        return discarded

    def bulk_operation_view(self, request: HttpRequest, operation: Operation) -> HttpResponse:
        """Replay or discard what the changelist's filter and search match: GET shows the counts
        to confirm, POST records an operation over what its page showed (nothing when the count
        changed since), or with "Dry run" shows what it would do."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        query = request.GET.urlencode()
        changelist_url = self.console_url("changelist", query=query)
        try:
            # What the changelist would refuse (an unknown field, a malformed date) is refused here.
            self.get_changelist_instance(request)
            confirmed = _Confirmed.of(request.POST) if request.method == "POST" else None
            chosen = selection_from_query(
                request.GET, search_mode=confirmed.search_mode if confirmed else None
            )
            max_pk = confirmed.max_pk if confirmed else _highest_id()
            matching_rows = matching(chosen).filter(pk__lte=max_pk)
            targets_rows = targets(operation, chosen).filter(pk__lte=max_pk)
            target_count = capped_count(targets_rows)
        except SelectionError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return redirect(changelist_url)
        except (IncorrectLookupParameters, ValidationError, ValueError):
            return redirect(self.console_url("changelist", query="e=1"))
        filter_parts = describe_filter(request, chosen["search_mode"])
        chosen["description"] = ", ".join(filter_parts)

        dry = None
        force = operation == "replay" and bool(request.POST.get("force"))
        if request.method == "POST" and request.POST.get("dry_run"):
            dry = dry_run(operation, chosen, force=force, max_pk=max_pk)
        elif request.method == "POST":
            if confirmed is not None and target_count != confirmed.announced:
                self.message_user(
                    request,
                    gettext(
                        "The dead letters changed after this page counted them (%(then)s then, "
                        "%(now)s now): nothing was started. Here are the figures as they are now."
                    )
                    % {"then": _at_most(confirmed.announced), "now": _at_most(target_count)},
                    messages.WARNING,
                )
                return redirect(request.get_full_path())
            return self.record_operation(
                request,
                kind=operation,
                selection=chosen,
                force=force,
                matched=target_count,
                max_pk=max_pk,
            )

        wanted_rows = matching_rows.filter(wanted(operation, chosen))
        matching_count = capped_count(matching_rows)
        unreplayable_count = capped_count(wanted_rows.filter(reason__in=unreplayable(operation)))
        processed = capped_count(targets_rows.already_processed()) if operation == "replay" else 0
        if operation == "replay":
            title = ngettext(
                "Replay %(count)s dead letter?", "Replay %(count)s dead letters?", target_count
            )
        else:
            title = ngettext(
                "Discard %(count)s dead letter?", "Discard %(count)s dead letters?", target_count
            )
        refusals = sorted(dry.refused.items(), key=lambda item: -item[1]) if dry else []
        dry_run_refused = [
            {"label": REFUSAL_LABELS.get(code, code), "count": n, "examples": dry.examples[code]}
            for code, n in refusals
            if dry
        ]
        return self.render_page(
            request,
            "confirm_operation",
            title % {"count": _at_most(target_count)},
            operation=operation,
            filter_parts=filter_parts,
            matching_count=matching_count,
            target_count=target_count,
            left_alone_count=max(0, matching_count - capped_count(wanted_rows)),
            unreplayable_count=unreplayable_count,
            processed_count=processed,
            count_cap=COUNT_CAP,
            capped=matching_count > COUNT_CAP,
            status_chosen=chosen["status_chosen"],
            changelist_url=changelist_url,
            confirmed=_Confirmed(chosen["search_mode"], max_pk, target_count),
            dry_run=dry,
            dry_run_refused=dry_run_refused,
            dry_run_limit=DRY_RUN_LIMIT,
            dry_run_forced=bool(request.POST.get("force")),
        )

    def object_operation_view(
        self, request: HttpRequest, object_id: str, operation: Operation
    ) -> HttpResponse:
        """The replay and discard buttons of one dead letter's page (POST only)."""
        if not self.has_replay_permission(request):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        obj = self.dead_letter_or_404(request, object_id)
        how = gettext("from its page")
        if operation == "replay":
            self.replay_and_report(
                request, [obj.pk], force=bool(request.POST.get("force")), how=how
            )
        else:
            self.discard_and_report(request, [obj.pk], how=how)
        return redirect(self.console_url("change", obj.pk))

    def failure_groups_view(self, request: HttpRequest) -> HttpResponse:
        """The failure groups (fingerprint and reason, per consumer) and their states. ``?state=``
        filters (default: all but resolved; ``all``), ``?all=1`` adds groups without dead letters;
        a POST acknowledges, resolves or reopens one group (``triage_deadletter``)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        user: Any = request.user
        opts = self.opts
        can_triage = bool(user.has_perm(f"{opts.app_label}.triage_{opts.model_name}"))
        if request.method == "POST":
            if not can_triage:
                raise PermissionDenied
            action = request.POST.get("action", "")
            key = (
                request.POST.get("consumer", ""),
                request.POST.get("fingerprint", ""),
                request.POST.get("reason", ""),
            )
            note = request.POST.get("note", "").strip()[:2000]
            known = DeadLetterGroup.objects.with_states(with_open=False).filter(
                consumer=key[0], fingerprint=key[1], reason=key[2]
            )
            if action != "reopen" and not known.exists():
                return HttpResponse(gettext("No such failure group."), status=400)
            states = FailureGroupState.objects.using(router.db_for_write(FailureGroupState))
            moves = {
                "acknowledge": (states.acknowledge, gettext("Acknowledged")),
                "resolve": (states.resolve, gettext("Resolved")),
            }
            label = f"{key[0]} · {key[2]}"
            now = timezone.now()
            with transaction.atomic(using=states.db):
                if action in moves:
                    move, verb = moves[action]
                    move(key, by=operator(request), at=now, note=note, user_id=user.pk)
                    messages.success(
                        request, gettext("%(verb)s %(group)s.") % {"verb": verb, "group": label}
                    )
                elif action == "reopen":
                    if states.reopen(key, at=now, note=note, user_id=user.pk):
                        messages.success(
                            request,
                            gettext("Reopened %(group)s: it is new again.") % {"group": label},
                        )
                    else:
                        messages.info(
                            request, gettext("%(group)s is new already.") % {"group": label}
                        )
                else:
                    return HttpResponse(gettext("Unknown action."), status=400)
            # Back to the page as it was filtered: its own filters only, re-encoded.
            back = QueryDict(request.POST.get("next", "").lstrip("?"))
            kept = {name: back[name] for name in ("state", "all") if back.get(name)}
            return redirect(self.console_url("groups", query=urlencode(kept)))

        show_all = request.GET.get("all") == "1"
        wanted_state = request.GET.get("state", "")
        if wanted_state == "all":
            states_shown: list[str] | None = None
        elif wanted_state in GroupState.values:
            states_shown = [wanted_state]
        else:
            wanted_state = ""
            states_shown = [s for s in GroupState.values if s != GroupState.RESOLVED]
        groups = DeadLetterGroup.objects.with_states(states=states_shown, with_open=not show_all)
        page = Paginator(groups, 100).get_page(request.GET.get("p"))
        examples = DeadLetter.objects.only(
            "pk", "message_id", "reason", "exception_type", "exception_message"
        ).in_bulk([group["example_id"] for group in page if group["example_id"] is not None])
        can_replay = self.has_replay_permission(request)
        here = {"state": wanted_state, "all": "1" if show_all else ""}
        here_query = urlencode({k: v for k, v in here.items() if v})
        rows = []
        for group in page:
            # The newest dead letter counted in; gone if it was deleted since.
            example = examples.get(group["example_id"])
            selection = {"fingerprint": group["fingerprint"], "consumer": group["consumer"]}
            dead_selection = urlencode({**selection, "status__exact": DeadLetterStatus.DEAD})
            message = next(iter(example.exception_message.splitlines()), "") if example else ""
            exception_type = group["exception_type"] or ""
            rows.append(
                {
                    **group,
                    "reason_code": group["reason"],
                    "state_label": GroupState(group["state"]).label,
                    "example": example,
                    "exception_type": exception_type,
                    "exception_name": exception_type.rsplit(".", 1)[-1],
                    "reason": DeadLetterGroup(reason=group["reason"]).get_reason_display(),
                    "message": message if len(message) <= 100 else message[:99] + "…",
                    "example_url": self.console_url("change", example.pk) if example else "",
                    "list_url": self.console_url("changelist", query=urlencode(selection)),
                    "replay_url": self.console_url("replay_matching", query=dead_selection)
                    if can_replay and group["dead"]
                    else "",
                    "discard_url": self.console_url("discard_matching", query=dead_selection)
                    if can_replay and group["dead"]
                    else "",
                }
            )
        return self.render_page(
            request,
            "failure_groups",
            gettext("Failure groups"),
            rows=rows,
            page=page,
            show_all=show_all,
            state=wanted_state,
            state_choices=[("", gettext("needing attention or muted"))]
            + [(s.value, s.label) for s in GroupState]
            + [("all", gettext("every state"))],
            here_query=f"?{here_query}" if here_query else "?",
            changelist_url=self.console_url("changelist"),
            can_triage=can_triage,
        )
