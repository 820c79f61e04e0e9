"""``manage.py purge_messages``: apply DEDUP_RETENTION, OUTBOX_RETENTION, DEAD_LETTER_RETENTION
and TASK_RESULT_RETENTION."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_messaging.conf import messaging_settings
from reliable_messaging.management.progress import Progress
from reliable_messaging.storage.retention import purge_messages


class Command(BaseCommand):
    help = (
        "Delete inbox rows older than DEDUP_RETENTION, sent outbox rows older than "
        "OUTBOX_RETENTION, resolved or discarded dead letters older than "
        "DEAD_LETTER_RETENTION and the results of tasks finished longer than "
        "TASK_RESULT_RETENTION ago, in batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
        )
        parser.add_argument("--batch-size", type=int, default=5000, metavar="N")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1")
        shown: dict[str, Progress] = {}

        def on_batch(table: str, deleted: int, total: int) -> None:
            if table not in shown:
                for previous in shown.values():
                    previous.finish()
                shown[table] = Progress(self.stdout, f"{table}: deleted", total)
            shown[table].update(deleted)

        result = purge_messages(
            batch_size=options["batch_size"], dry_run=options["dry_run"], on_batch=on_batch
        )
        for progress in shown.values():
            progress.finish()
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(
            f"{verb} {result.inbox} inbox row(s) older than {messaging_settings.dedup_retention} "
            f"and {result.outbox} sent outbox row(s) older than "
            f"{messaging_settings.outbox_retention}"
            + (f" and {result.suspects} crash-guard row(s)" if result.suspects else "")
        )
        retention = messaging_settings.dead_letter_retention
        if retention is not None:
            self.stdout.write(
                f"{verb} {result.dead_letters} resolved or discarded dead letter(s) older than "
                f"{retention}"
            )
        retention = messaging_settings.task_result_retention
        if retention is not None:
            self.stdout.write(
                f"{verb} {result.task_results} finished task result(s) older than {retention}"
            )
