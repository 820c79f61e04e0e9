"""``manage.py messaging_status``: the status judged against thresholds, as text or JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router
from django.utils import timezone

from reliable_messaging.broker.findings import summary
from reliable_messaging.broker.inspection import BrokerCheck
from reliable_messaging.broker.queues import DEFAULT_TIMEOUT, QueueStatus
from reliable_messaging.conf import messaging_settings
from reliable_messaging.models import OutboxMessage
from reliable_messaging.ops.status import MessagingStatus, Thresholds, collect_status, days_shown
from reliable_messaging.publishing.listener import listen_hears_notify

PROBE, STRICT = Thresholds(), Thresholds.strict()


def _limits(name: str) -> str:
    """What a threshold's help says of its defaults, without and with --strict."""

    def shown(value: float | None) -> str:
        return "not judged" if value is None else f"{value:g}"

    return f"default: {shown(getattr(PROBE, name))}; with --strict: {shown(getattr(STRICT, name))}"


def _consumer_column(queue: QueueStatus) -> str:
    if queue.kind == "leftover":
        return f"{queue.consumer} (leftover)"
    return queue.consumer or "(retry delay)"


def _shown(value: float | None, spec: str = ",") -> str:
    """A figure of the queue table, "-" when not known."""
    return "-" if value is None else format(value, spec)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-align the first two columns, right-align the rest."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        indent
        + "  ".join(
            cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]


class Command(BaseCommand):
    help = (
        "Show queue depths, unacked deliveries, consumers and redelivery rates, the outbox's "
        "pending/failed rows and lag, dead letters and the inbox size. Exits 1 when a "
        "threshold is crossed, 2 when the broker or the database cannot be reached."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--json",
            action="store_true",
            help="print a JSON document (see docs/reference/commands.md)",
        )
        for limit in dataclasses.fields(Thresholds):
            parser.add_argument(
                "--" + limit.name.replace("_", "-"),
                type=limit.metadata["type"],
                default=None,
                metavar=limit.metadata["metavar"],
                help=f"{limit.metadata['help']} ({_limits(limit.name)})",
            )
        parser.add_argument(
            "--strict",
            action="store_true",
            help="judge what needs a person too (dead letters, failed outbox rows, backlogs, "
            "redeliveries, leftover queues), not only what a restart probe needs; a --max-* "
            "given beside it still wins",
        )
        parser.add_argument(
            "--broker",
            action="store_true",
            help="also check the broker: max_message_size against MAX_BODY_BYTES, the vhost's "
            "default queue type, deprecated features, and the queues' types, arguments and "
            "policies that would drop or redeliver messages (an error finding exits 1)",
        )
        parser.add_argument(
            "--management-url",
            metavar="URL",
            help="the RabbitMQ management API, e.g. http://rabbitmq:15672 (default: "
            "MANAGEMENT_URL, else the broker's host on port 15672, or https on 15671 for "
            "amqps://); '' to use AMQP only",
        )
        parser.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            metavar="SECONDS",
            help="per broker request (default %(default)g)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["timeout"] <= 0:
            raise CommandError("--timeout must be positive")
        # The mode's limits, then whatever was given on the command line.
        given = {
            field.name: options[field.name]
            for field in dataclasses.fields(Thresholds)
            if options[field.name] is not None
        }
        thresholds = dataclasses.replace(STRICT if options["strict"] else PROBE, **given)
        status = collect_status(
            thresholds,
            management_url=options["management_url"],
            timeout=options["timeout"],
            inspect_broker=options["broker"],
        )
        listen = self.listen_note()
        if options["json"]:
            document = status.as_dict()
            document["listen"] = listen
            self.stdout.write(json.dumps(document, indent=2))
        else:
            for line in self.render(status):
                self.stdout.write(line)
            if listen["note"]:
                self.stdout.write(self.style.WARNING(f"NOTE: {listen['note']}"))
        if status.exit_code == 2:
            down = [
                name
                for name, part in (("broker", status.broker), ("database", status.database))
                if not part.reachable
            ]
            raise CommandError(f"the {' and the '.join(down)} cannot be reached", returncode=2)
        if status.exit_code == 1:
            reasons = []
            if status.problems:
                names = ", ".join(
                    dict.fromkeys("--" + p.threshold.replace("_", "-") for p in status.problems)
                )
                reasons.append(f"threshold(s) crossed: {names}")
            if status.broker_check is not None and status.broker_check.errors:
                reasons.append(f"the broker check found {len(status.broker_check.errors)} error(s)")
            raise CommandError("; ".join(reasons), returncode=1)

    def listen_note(self) -> dict[str, Any]:
        """Whether the relays' LISTEN hears publishers' NOTIFYs; a note when it does not (a
        transaction-pooling PgBouncer in between): not a problem, the relays then poll."""
        using = router.db_for_write(OutboxMessage)
        heard = listen_hears_notify(using, messaging_settings.relay_listen_dsn)
        note = None
        if heard is False:
            note = (
                f"a LISTEN on database {using!r} hears no NOTIFY (a transaction-pooling "
                f"PgBouncer in between?): the relays poll every RELAY_POLL_INTERVAL instead of "
                f"waking at once; set RELIABLE_MESSAGING['RELAY_LISTEN_DSN'] to a direct "
                f"connection (docs/deploy.md#pgbouncer)"
            )
        return {"hears_notify": heard, "note": note}

    def render(self, status: MessagingStatus) -> list[str]:
        moment = status.checked_at
        if timezone.is_aware(moment):
            moment = timezone.localtime(moment)
        checked = moment.strftime("%Y-%m-%d %H:%M:%S %Z").rstrip()
        sections = [self.render_broker(status), self.render_database(status)]
        if status.broker_check is not None:
            sections.append(self.render_broker_check(status.broker_check))
        lines = [f"Messaging status at {checked}", ""]
        for section in sections:
            lines += [*section, ""]
        if status.problems:
            lines += [self.style.ERROR(f"PROBLEM: {p.message}") for p in status.problems]
        elif not status.unreachable and status.exit_code == 0:
            lines.append(self.style.SUCCESS("OK: no threshold crossed"))
        return lines

    def render_broker(self, status: MessagingStatus) -> list[str]:
        broker = status.broker
        if not broker.reachable:
            return [f"Broker {broker.url}", self.style.ERROR(f"  UNREACHABLE: {broker.error}")]
        lines = [f"Broker {broker.url}"]
        if not broker.management_api:
            lines.append(f"  unacked/rates need the management plugin: {broker.note}")
        present = [q for q in broker.queues if q.exists]
        if present:
            header = ["queue", "consumer", "ready", "unacked", "consumers", "redelivered"]
            rows = [
                [
                    q.name,
                    _consumer_column(q),
                    _shown(q.ready),
                    _shown(q.unacked),
                    _shown(q.consumers),
                    _shown(q.redelivery_ratio, ".0%"),
                ]
                for q in present
            ]
            lines += _table([header, *rows])
        missing = [q.name for q in broker.queues if not q.exists]
        if missing:
            lines.append(
                f"  not declared yet (manage.py consume declares them): {', '.join(missing)}"
            )
        if not broker.queues:
            lines.append("  no consumers are registered, so there are no queues to show")
        return lines

    def render_broker_check(self, check: BrokerCheck) -> list[str]:
        if not check.reachable:
            return [f"Broker check: {self.style.ERROR('UNREACHABLE')}: {check.error}"]
        lines = [f"Broker check of {check.url}: {summary(check.findings)}"]
        styles = {"error": self.style.ERROR, "warning": self.style.WARNING}
        for finding in check.findings:
            style: Callable[[str], str] = styles.get(finding.severity, str)
            lines.append(style(f"  {finding.severity.upper()}: {finding.message}"))
            if finding.fix:
                lines.append(f"    fix: {finding.fix}")
        return lines

    def render_database(self, status: MessagingStatus) -> list[str]:
        db = status.database
        if not db.reachable:
            return [f"Database {db.alias!r}", self.style.ERROR(f"  UNREACHABLE: {db.error}")]
        oldest = "" if db.outbox_lag is None else f" (oldest {_age(db.outbox_lag)} old)"
        lines = [
            f"Outbox: {db.outbox_pending:,} pending{oldest}, {db.outbox_failed:,} failed, "
            f"{db.outbox_unrouted:,} unrouted (events no queue was bound for), "
            f"{db.outbox_scheduled:,} scheduled",
            f"Dead letters awaiting review: {db.dead_letters_total:,}",
        ]
        if db.dead_letters:
            lines += _table([[d.consumer, d.reason, f"{d.count:,}"] for d in db.dead_letters])
        lines.append(
            f"Inbox: {db.inbox_rows:,} processed message(s) remembered"
            + (" (estimated)" if db.inbox_estimated else "")
        )
        if db.partition_days_ahead:
            made = ", ".join(
                f"{table} {days_shown(days, 1)}" for table, days in db.partition_days_ahead
            )
            overdue = len(db.overdue_partitions)
            lines.append(f"Day partitions made ahead (days): {made}; {overdue} expired not dropped")
        return lines
