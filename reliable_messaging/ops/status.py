"""How the messaging is doing, judged in one place: :func:`collect_status` for
``messaging_status``, :func:`system_health` and :func:`process_health` for the health endpoints."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from ..broker.findings import summary
from ..broker.inspection import BrokerCheck, check_broker
from ..broker.queues import DEFAULT_TIMEOUT, BrokerStatus, broker_status
from ..storage.partitions import UPKEEP_WARN_DAYS
from .collectors import DatabaseStatus, database_status

if TYPE_CHECKING:
    from ..core.liveness import HealthCheck


# Version of the ``--json`` document; raised only when a key changes meaning or goes away.
STATUS_FORMAT_VERSION = 1

# Seconds the oldest pending outbox row may wait: past it the outbox has stopped moving (the
# limit of messaging_status, of messaging/healthz/ and of the shipped alert rule) ...
OUTBOX_LAG_LIMIT = 300.0
# ... and past this a relay is behind enough to need a person (--strict, MessagingHealthCheck).
OUTBOX_LAG_STRICT_LIMIT = 60.0


def _threshold(kind: type, metavar: str, what: str, default: float | None = None) -> Any:
    """A threshold field; its metadata makes ``messaging_status``'s ``--<name>`` option."""
    return field(default=default, metadata={"type": kind, "metavar": metavar, "help": what})


@dataclass(frozen=True)
class Thresholds:
    """Limits beyond which the status is a problem; None leaves a figure unjudged. The defaults
    suit a probe that restarts or pages; :meth:`strict` judges what needs a person too."""

    max_outbox_lag: float | None = _threshold(
        float, "SECONDS", "age of the oldest pending outbox row", OUTBOX_LAG_LIMIT
    )
    max_outbox_failed: int | None = _threshold(int, "N", "outbox rows marked failed")
    max_dead_letters: int | None = _threshold(int, "N", "dead letters awaiting review, status dead")
    max_ready: int | None = _threshold(int, "N", "ready messages in any consumer queue")
    max_redelivery_rate: float | None = _threshold(
        float,
        "FRACTION",
        "share of a queue's recent deliveries that are redeliveries, 0..1; needs the "
        "management API",
    )
    min_consumers: int = _threshold(
        int, "N", "consumers each consumer queue must have attached, 0: not checked", 0
    )
    max_leftover_messages: int | None = _threshold(
        int,
        "N",
        "messages in a queue left by an earlier shape of a consumer (ordered turned on or off, "
        "fewer partitions), which nobody handles until consume retires it",
    )
    min_partition_days_ahead: float | None = _threshold(
        float, "DAYS", "days of inbox and outbox day partitions made ahead, PostgreSQL"
    )
    max_overdue_partitions: int | None = _threshold(
        int, "N", "expired day partitions the upkeep has not dropped, PostgreSQL"
    )

    @classmethod
    def strict(cls) -> Thresholds:
        """Everything that needs a person (``messaging_status --strict``)."""
        return cls(
            max_outbox_lag=OUTBOX_LAG_STRICT_LIMIT,
            max_outbox_failed=0,
            max_dead_letters=0,
            max_ready=1000,
            max_redelivery_rate=0.2,
            max_leftover_messages=0,
            min_partition_days_ahead=UPKEEP_WARN_DAYS,
            max_overdue_partitions=0,
        )


def _over(value: float | None, limit: float | None) -> bool:
    return value is not None and limit is not None and value > limit


@dataclass(frozen=True)
class Problem:
    """A crossed threshold (a :class:`Thresholds` field) and what was found, for a person."""

    threshold: str
    message: str


@dataclass(frozen=True)
class MessagingStatus:
    checked_at: dt.datetime
    broker: BrokerStatus
    database: DatabaseStatus
    thresholds: Thresholds
    problems: tuple[Problem, ...] = field(default=())
    # The broker check's findings (messaging_status --broker); None when not asked for.
    broker_check: BrokerCheck | None = None

    @property
    def unreachable(self) -> bool:
        return not (self.broker.reachable and self.database.reachable)

    @property
    def exit_code(self) -> int:
        """0 all well, 1 a threshold crossed or a broker check error, 2 a service unreachable."""
        if self.unreachable:
            return 2
        check_failed = self.broker_check is not None and bool(self.broker_check.errors)
        return 1 if self.problems or check_failed else 0

    def as_dict(self) -> dict[str, Any]:
        """The ``messaging_status --json`` document (docs/reference/commands.md)."""
        db, check = self.database, self.broker_check
        document: dict[str, Any] = {
            "version": STATUS_FORMAT_VERSION,
            "checked_at": self.checked_at.isoformat(),
            "exit_code": self.exit_code,
            "broker": {
                "url": self.broker.url,
                "reachable": self.broker.reachable,
                "management_api": self.broker.management_api,
                "error": self.broker.error or None,
                "note": self.broker.note or None,
                "queues": [
                    {**asdict(q), "redelivery_ratio": q.redelivery_ratio}
                    for q in self.broker.queues
                ],
            },
            "database": {
                "alias": db.alias,
                "reachable": db.reachable,
                "error": db.error or None,
                "outbox": {
                    "pending": db.outbox_pending,
                    "scheduled": db.outbox_scheduled,
                    "failed": db.outbox_failed,
                    "unrouted": db.outbox_unrouted,
                    "lag_seconds": db.outbox_lag,
                },
                "dead_letters": {
                    "total": db.dead_letters_total,
                    "by_consumer_and_reason": [asdict(d) for d in db.dead_letters],
                },
                "inbox": {"rows": db.inbox_rows},
                "partitions": {
                    "days_ahead": {
                        table: days_shown(days, 2) for table, days in db.partition_days_ahead
                    },
                    "overdue": list(db.overdue_partitions),
                },
            },
            "thresholds": asdict(self.thresholds),
            "problems": [asdict(p) for p in self.problems],
        }
        if check is not None:
            document["broker_check"] = {
                "url": check.url,
                "reachable": check.reachable,
                "error": check.error or None,
                "summary": summary(check.findings),
                "findings": [asdict(f) for f in check.findings],
            }
        return document


def outbox_lag_problem(lag: float | None, limit: float | None) -> Problem | None:
    """The problem when the oldest pending outbox row (``lag`` seconds) is older than ``limit``."""
    if lag is None or not _over(lag, limit):
        return None
    return Problem(
        "max_outbox_lag",
        f"the oldest pending outbox row is {lag:,.0f} s old (limit {limit or 0:g} s): is a "
        "relay running, and can it publish?",
    )


def days_shown(days: float, places: int) -> float:
    """Days made ahead as shown, rounded down: 5.9999 days is not the 6 a threshold asks for."""
    return math.floor(days * 10**places) / 10**places


def find_problems(
    broker: BrokerStatus, database: DatabaseStatus, thresholds: Thresholds
) -> list[Problem]:
    """Every threshold the figures cross; what could not be read is not judged here."""
    found: list[Problem] = []

    def problem(threshold: str, message: str) -> None:
        found.append(Problem(threshold, message))

    if database.reachable:
        lagging = outbox_lag_problem(database.outbox_lag, thresholds.max_outbox_lag)
        if lagging is not None:
            found.append(lagging)
        if _over(database.outbox_failed, thresholds.max_outbox_failed):
            problem(
                "max_outbox_failed",
                f"{database.outbox_failed:,} outbox row(s) failed and will not be sent "
                f"until retried in the admin (limit {thresholds.max_outbox_failed or 0:,})",
            )
        limit = thresholds.min_partition_days_ahead
        for table, days in database.partition_days_ahead:
            if limit is not None and days < limit:
                problem(
                    "min_partition_days_ahead",
                    f"only {days_shown(days, 1)} day(s) of {table} partitions are made ahead (at "
                    f"least {limit:g} expected): the partition upkeep of the "
                    f"{'consume' if table == 'inbox' else 'relay'} processes is failing; "
                    "their log says why (docs/operations.md#partition-upkeep)",
                )
        overdue = len(database.overdue_partitions)
        if _over(overdue, thresholds.max_overdue_partitions):
            problem(
                "max_overdue_partitions",
                f"{overdue} expired partition(s) not dropped "
                f"({', '.join(database.overdue_partitions)}): the partition upkeep is "
                "failing; the log of the consume and relay processes says why",
            )
        if _over(database.dead_letters_total, thresholds.max_dead_letters):
            problem(
                "max_dead_letters",
                f"{database.dead_letters_total:,} dead letter(s) await review (limit "
                f"{thresholds.max_dead_letters or 0:,})",
            )
    for queue in broker.queues if broker.reachable else ():
        if queue.kind == "leftover" and _over(queue.ready or 0, thresholds.max_leftover_messages):
            problem(
                "max_leftover_messages",
                f"queue {queue.name} was left by an earlier shape of consumer "
                f"{queue.consumer} and holds {queue.ready:,} message(s) nobody handles "
                f"(limit {thresholds.max_leftover_messages or 0:,}): the next `manage.py "
                f"consume` start moves them and deletes it",
            )
        if queue.kind != "consumer" or not queue.exists:
            continue
        if _over(queue.ready, thresholds.max_ready):
            problem(
                "max_ready",
                f"queue {queue.name} has {queue.ready:,} ready message(s) (limit "
                f"{thresholds.max_ready or 0:,})",
            )
        if queue.consumers is not None and queue.consumers < thresholds.min_consumers:
            problem(
                "min_consumers",
                f"queue {queue.name} has {queue.consumers} consumer(s) attached (at least "
                f"{thresholds.min_consumers} expected): is consume running?",
            )
        ratio = queue.redelivery_ratio
        if _over(ratio, thresholds.max_redelivery_rate):
            problem(
                "max_redelivery_rate",
                f"queue {queue.name}: {ratio:.0%} of recent deliveries are redeliveries "
                f"(limit {thresholds.max_redelivery_rate or 0:.0%})",
            )
    return found


def collect_status(
    thresholds: Thresholds,
    *,
    management_url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    inspect_broker: bool = False,
) -> MessagingStatus:
    """Read the broker and the database and judge the figures against ``thresholds``; with
    ``inspect_broker``, check the broker's settings and policies too."""
    broker = broker_status(management_url=management_url, timeout=timeout)
    database = database_status()
    check = check_broker(management_url=management_url, timeout=timeout) if inspect_broker else None
    return MessagingStatus(
        checked_at=timezone.now(),
        broker=broker,
        database=database,
        thresholds=thresholds,
        problems=tuple(find_problems(broker, database, thresholds)),
        broker_check=check,
    )


@dataclass(frozen=True)
class CheckResult:
    """One check of a health endpoint: whether it passed, and what was found, in words."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class HealthReport:
    """What a ``/healthz`` answers: 200 when nothing is wrong, else 503 with the reasons;
    ``notes`` are what an operator should know while the answer is still 200."""

    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    checks: tuple[tuple[str, CheckResult], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def http_status(self) -> int:
        return 200 if self.ok else 503

    def as_dict(self) -> dict[str, Any]:
        """The JSON body: ``status``, and ``checks``, ``reasons`` and ``notes`` when any."""
        body: dict[str, Any] = {"status": "ok" if self.ok else "unhealthy"}
        if self.checks:
            body["checks"] = {
                name: {"ok": result.ok, "detail": result.detail} for name, result in self.checks
            }
        if self.reasons:
            body["reasons"] = list(self.reasons)
        if self.notes:
            body["notes"] = list(self.notes)
        return body


def outbox_lag_check(lag: float, limit: float) -> CheckResult:
    """The outbox-lag check of ``messaging/healthz/`` (``lag`` is 0 when nothing is pending)."""
    if _over(lag, limit):
        return CheckResult(
            False,
            f"the oldest pending outbox row waits for {lag:.0f}s (limit {limit:.0f}s): "
            f"is a relay running and connected?",
        )
    return CheckResult(True, f"oldest pending outbox row waits {lag:.1f}s")


def system_health(checks: Mapping[str, CheckResult]) -> HealthReport:
    """The verdict on the whole system: unhealthy when any check failed, with its details."""
    return HealthReport(
        reasons=tuple(result.detail for result in checks.values() if not result.ok),
        checks=tuple(checks.items()),
    )


def process_health(health: HealthCheck) -> HealthReport:
    """The verdict on one consume or relay process, from what it recorded (its
    :class:`reliable_messaging.core.liveness.HealthState`, or a group of them)."""
    ok, reasons = health.check()
    notes = getattr(health, "notes", None)
    return HealthReport(
        reasons=() if ok else tuple(reasons) or ("unhealthy",),
        notes=tuple(notes()) if notes is not None else (),
    )
