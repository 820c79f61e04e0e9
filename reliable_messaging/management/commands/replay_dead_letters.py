"""``manage.py replay_dead_letters``: replay dead letters chosen by filters."""

from __future__ import annotations

import datetime as dt
import functools
import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router
from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime, parse_duration

from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, OperationKind
from reliable_messaging.core.registry import registry
from reliable_messaging.dead_letters.replay import judge_batch, replay_batch
from reliable_messaging.management.progress import Progress
from reliable_messaging.models import DeadLetter, DeadLetterOperation
from reliable_messaging.publishing.wake_after_commit import sender, wake_relay_after_commit


def _moment(value: str) -> dt.datetime:
    """An ISO datetime, or an age such as ``2h``, ``30m``, ``3d`` (meaning that long ago)."""
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    if value[-1:] in units and value[:-1].replace(".", "", 1).isdigit():
        return timezone.now() - dt.timedelta(**{units[value[-1]]: float(value[:-1])})
    duration = parse_duration(value)
    if duration is not None:
        return timezone.now() - duration
    moment = parse_datetime(value)
    if moment is None:
        raise CommandError(
            f"cannot read {value!r} as a date-time (2026-11-22T10:00) or an age (30m, 2h, 3d)"
        )
    return moment if timezone.is_aware(moment) else timezone.make_aware(moment)


# The options that select by a field's value, and by the time of the last failure.
LIST_FILTERS = dict(
    consumer="consumer", queue="queue", reason="reason", fingerprint="fingerprint", ids="pk"
)
TIME_FILTERS = {"since": "last_failed_at__gte", "until": "last_failed_at__lt"}


def _filters(options: dict[str, Any]) -> dict[str, Any]:
    """The lookups of the filters given (all but ``--exception``)."""
    found: dict[str, Any] = {"status__in": options["status"] or [DeadLetterStatus.DEAD]}
    found.update({f"{field}__in": options[o] for o, field in LIST_FILTERS.items() if options[o]})
    found.update({lookup: options[o] for o, lookup in TIME_FILTERS.items() if options[o]})
    return found


class Command(BaseCommand):
    help = (
        "Replay dead letters to the consumer that failed them (through the outbox). "
        "Choose them with filters, or --all."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        repeatable = functools.partial(parser.add_argument, action="append", default=[])
        repeatable(
            "--consumer",
            help="a consumer's name (its dotted function path unless name= is given) or queue",
        )
        repeatable("--queue")
        repeatable("--reason", choices=list(DeadLetterReason.values))
        repeatable(
            "--exception",
            metavar="TYPE",
            help="exception type, dotted (builtins.KeyError) or bare (KeyError)",
        )
        repeatable("--fingerprint")
        parser.add_argument(
            "--since",
            type=_moment,
            metavar="WHEN",
            help="last failed at or after WHEN (ISO date-time or age: 2h, 3d)",
        )
        parser.add_argument("--until", type=_moment, metavar="WHEN", help="last failed before WHEN")
        repeatable("--id", type=int, dest="ids")
        repeatable(
            "--status",
            choices=[DeadLetterStatus.DEAD, DeadLetterStatus.DISCARDED],
            help="default: dead",
        )
        parser.add_argument("--limit", type=int, metavar="N")
        parser.add_argument(
            "--all",
            action="store_true",
            help="replay every dead letter (required when no filter is given)",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="also replay messages the consumer already processed (runs the handler again)",
        )
        parser.add_argument("--batch-size", type=int, default=500)
        parser.add_argument(
            "--dry-run", action="store_true", help="show what would be replayed, change nothing"
        )
        parser.add_argument(
            "--via-relay",
            action="store_true",
            help="record the replay as an operation that the relay carries out (shown, with "
            "its progress and a cancel button, in the admin) instead of doing it here",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        filters = [*LIST_FILTERS, *TIME_FILTERS, "exception"]
        if not any(options[f] for f in filters) and not options["all"]:
            raise CommandError(
                "No filter given: pass --consumer, --queue, --reason, "
                "--exception, --fingerprint, --since, --until or --id, or --all "
                "to replay every dead letter."
            )
        if options["limit"] is not None and options["limit"] < 1:
            raise CommandError("--limit must be at least 1")
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        options["consumer"] = self.consumer_names(options["consumer"])
        queryset = self.select(options)
        ids = list(queryset.order_by("pk").values_list("pk", flat=True)[: options["limit"]])
        if options["dry_run"]:
            self.dry_run(ids, options["force"], options["batch_size"])
            return
        who = f"{getpass.getuser()} (replay_dead_letters)"
        if options["via_relay"]:
            self.record_operation(ids, who, options["force"], self.lookups(options))
            return
        replayed, refused = 0, 0
        progress = Progress(self.stdout, "replaying", len(ids))
        for start in range(0, len(ids), options["batch_size"]):
            result = replay_batch(
                ids[start : start + options["batch_size"]], replayed_by=who, force=options["force"]
            )
            if result.replayed:  # committed: the relay may claim their outbox rows now
                wake_relay_after_commit(router.db_for_write(DeadLetter))
            replayed += len(result.replayed)
            refused += len(result.refused)
            if result.refused:
                progress.interrupt()
            for pk, why in result.refused.items():
                self.stderr.write(f"not replayed #{pk}: {why}")
            progress.update(replayed + refused)
        progress.finish()
        if replayed:
            # The wake-up goes from a daemon thread: sent before this process exits, the relay
            # sends the copies at once instead of at its next poll.
            sender.flush(timeout=2.0)
        self.stdout.write(
            self.style.SUCCESS(
                f"replayed {replayed} dead letter(s), refused {refused}; the relay sends them to "
                f"their consumers' queues"
            )
        )

    def dry_run(self, ids: list[int], force: bool, batch_size: int) -> None:
        """What a replay of ``ids`` would do now (``replay.judge``, by batch), writing nothing."""
        would, refused = 0, 0
        for start in range(0, len(ids), batch_size):
            judgement = judge_batch(ids[start : start + batch_size], force=force)
            for letter, forced in judgement.chosen:
                would += 1
                self.stdout.write(
                    f"would replay #{letter.pk} message_id={letter.message_id} "
                    f"to {letter.consumer} ({letter.queue}): {letter.reason}"
                    + (" (forced)" if forced else "")
                )
            for pk, why in judgement.refused.items():
                refused += 1
                self.stdout.write(f"would refuse #{pk}: {why.text}")
        self.stdout.write(f"dry run: {len(ids)} dead letter(s) match; nothing replayed")
        self.stdout.write(f"{would} would be replayed, {refused} refused")

    def lookups(self, options: dict[str, Any]) -> dict[str, str] | None:
        """The filters as an operation's lookups; None when they cannot be (``--exception``
        matches a dotted or a bare name, ``--limit`` a number of rows, a value with a comma
        would read as two in an ``__in`` list): then the ids are."""
        if options["exception"] or options["limit"] is not None:
            return None
        found = _filters(options)
        lists = [value for value in found.values() if not isinstance(value, dt.datetime)]
        if any("," in str(item) for value in lists for item in value):
            return None
        return {
            lookup: value.isoformat()
            if isinstance(value, dt.datetime)
            else ",".join(map(str, value))
            for lookup, value in found.items()
        }

    def record_operation(
        self, ids: list[int], who: str, force: bool, lookups: dict[str, str] | None
    ) -> None:
        """The chosen dead letters as one operation for the relay, by their filters or ids."""
        if not ids:
            self.stdout.write("no dead letter matches; nothing recorded")
            return
        operation = DeadLetterOperation.objects.record(
            kind=OperationKind.REPLAY,
            selection={
                "lookups": lookups or {"pk__in": ",".join(map(str, ids))},
                "status_chosen": True,
                "description": f"{len(ids)} dead letter(s) chosen by replay_dead_letters",
            },
            requested_by=who,
            force=force,
            matched=len(ids),
            max_pk=ids[-1],
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"recorded replay operation #{operation.pk} of {len(ids)} dead letter(s); the "
                f"relay carries it out (see its progress in the admin)"
            )
        )

    def consumer_names(self, given: list[str]) -> list[str]:
        """The consumers ``--consumer`` names: a consumer's name (its dotted function path
        unless ``name=``), or its queue (what ``@consumer`` takes first), said so."""
        names = []
        for name in given:
            by_queue = [spec.name for spec in registry.all() if spec.queue == name]
            if by_queue and not any(spec.name == name for spec in registry.all()):
                self.stderr.write(
                    f"--consumer {name}: that is the queue of consumer {', '.join(by_queue)}; "
                    f"selecting its dead letters (--queue {name} selects by queue)"
                )
                names += by_queue
            else:
                names.append(name)
        return names

    def select(self, options: dict[str, Any]) -> Any:
        match = Q()  # any of the --exception names; without any, every type
        for name in options["exception"]:
            match |= Q(exception_type=name) | Q(exception_type__endswith=f".{name}")
        return DeadLetter.objects.filter(match, **_filters(options))
