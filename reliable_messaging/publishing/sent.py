"""Where an outbox row is marked sent: a :class:`Batch` takes the broker's answers,
:meth:`Batch.outcome` says what became of each row, :func:`record_outcome` writes it."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import Case, DurationField, F, Value, When
from django.db.models.functions import Now
from django.utils import timezone

from ..broker.limits import MESSAGE_SIZE, size_limit_in
from ..broker.replies import NOT_FOUND
from ..choices import OutboxStatus
from ..core.backoff import exponential
from ..core.envelope import ORDERING_KEY_HEADER, OUTBOX_ID_HEADER, PUBLISHED_AT_HEADER
from ..models import OutboxMessage
from ..storage.partitions import OUTBOX, UNSENT_STATUSES, again_if_moved, ensure_covered
from .claims import ClaimedRow, ClaimTransaction, any_id_of, release_next_of_keys

logger = logging.getLogger("reliable_messaging.relay")


_MISSING_EXCHANGE = re.compile(r"no exchange '([^']*)'")
# The exchange a 403 names ("access to exchange 'x' in vhost '/' refused").
_NAMED_EXCHANGE = re.compile(r"exchange '([^']*)'")


@dataclass
class BatchOutcome:
    """What became of a claimed batch, for :func:`record_outcome`."""

    claimed: list[ClaimedRow]
    sent: list[int] = field(default_factory=list)  # ids confirmed by the broker
    unrouted: list[ClaimedRow] = field(default_factory=list)  # events confirmed, but unroutable
    failures: dict[int, str] = field(default_factory=dict)  # id -> why it was not sent
    # Failures no number of tries can change (a body over the broker's max_message_size).
    final: set[int] = field(default_factory=set)
    again: list[int] = field(default_factory=list)  # neither: due again at once

    @property
    def released_keys(self) -> set[str]:
        """The ordering keys whose next row may go now."""
        done = set(self.sent) | {row.pk for row in self.unrouted}
        return {
            row.ordering_key
            for row in self.claimed
            if row.pk in done and row.ordering_key is not None
        }


def resend_backoff(attempts: int) -> dt.timedelta:
    """Wait before the next try of a row that failed ``attempts`` times: 1 s doubling to 5 min."""
    return dt.timedelta(seconds=exponential(1.0, max(attempts - 1, 0), 300.0))


def message_headers(row: ClaimedRow) -> dict[str, Any]:
    """A row's headers: its own, ``published_at``, its row id (for returns), its ordering key;
    a retry copy keeps its original's and gets the row id alone."""
    if row.raw_properties is not None:
        return {OUTBOX_ID_HEADER: row.pk}
    headers: dict[str, Any] = dict(row.headers or {})
    headers[PUBLISHED_AT_HEADER] = row.published_us // 1000
    headers[OUTBOX_ID_HEADER] = row.pk
    if row.ordering_key is not None:
        headers[ORDERING_KEY_HEADER] = row.ordering_key
    return headers


@dataclass
class Batch:
    """Rows published and awaiting confirms, under their claim's transaction or lease."""

    rows: dict[int, ClaimedRow]  # published, by delivery tag
    claimed: list[ClaimedRow] = field(default_factory=list)  # every row the claim took
    worker: Any = None  # the DatabaseWorker whose connection holds its transaction
    # The claim's transaction until HOLD_LIMIT (touched on the worker's thread only).
    transaction: ClaimTransaction | None = None
    errors: dict[int, str] = field(default_factory=dict)  # row id -> why it was not sent
    final: set[int] = field(default_factory=set)  # row ids of errors no retry can change
    confirmed: set[int] = field(default_factory=set)  # row ids acked by the broker
    unrouted: set[int] = field(default_factory=set)  # row ids of events returned unroutable
    settled: set[int] = field(default_factory=set)  # delivery tags acked or nacked
    lowest_unsettled: int = 0
    pks: set[int] = field(default_factory=set)  # ids of the claimed rows
    timer: Any = None
    published_at: float = 0.0  # monotonic time the rows went out, for the confirm latency
    leased_at: float = 0.0  # monotonic time the lease was taken or renewed; 0: not leased
    spans: dict[int, Any] = field(default_factory=dict)  # row id -> its "send" span (tracing)
    # Called on the I/O loop once the outcome is recorded (True) or could not be (False).
    on_recorded: Callable[[bool], None] | None = None

    def unconfirmed(self) -> list[ClaimedRow]:
        """Published rows not confirmed nor charged yet, in the order they went out."""
        return [
            self.rows[tag]
            for tag in sorted(self.rows)
            if self.rows[tag].pk not in self.confirmed and self.rows[tag].pk not in self.errors
        ]

    def settle(self, tag: int, multiple: bool, acked: bool) -> tuple[int, int]:
        """Take a confirm for ``tag`` (or up to it); how many rows it confirmed and nacked."""
        if not self.rows or (not multiple and tag not in self.rows):
            return 0, 0
        if multiple:
            # Tags are consecutive across batches: from the batch's lowest unsettled one.
            tags = range(self.lowest_unsettled, min(tag, max(self.rows)) + 1)
            self.lowest_unsettled = max(self.lowest_unsettled, tags.stop)
        else:
            tags = range(tag, tag + 1)
        confirmed = nacked = 0
        for settled in tags:
            row = self.rows.get(settled)
            if row is None or settled in self.settled:
                continue
            self.settled.add(settled)
            if acked:
                self.confirmed.add(row.pk)
                confirmed += 1
            else:
                self.errors.setdefault(row.pk, "nacked by the broker")
                nacked += 1
        return confirmed, nacked

    @property
    def complete(self) -> bool:
        """Every published row has its confirm."""
        return len(self.settled) >= len(self.rows)

    def time_out(self, seconds: float) -> int:
        """Charge every published row still without a confirm; returns how many."""
        rows = self.unconfirmed()
        for row in rows:
            self.errors[row.pk] = f"no confirm from the broker within {seconds}s"
        return len(rows)

    def outcome(self) -> BatchOutcome:
        """Confirmed rows sent (or unrouted), rows with an error charged, the rest due again."""
        sent = [pk for pk in self.confirmed if pk not in self.errors and pk not in self.unrouted]
        unrouted = [
            row
            for row in self.rows.values()
            if row.pk in self.unrouted and row.pk in self.confirmed and row.pk not in self.errors
        ]
        answered = self.confirmed | set(self.errors)
        return BatchOutcome(
            claimed=self.claimed,
            sent=sent,
            unrouted=unrouted,
            failures=dict(self.errors),
            final=self.final & set(self.errors),
            again=[row.pk for row in self.claimed if row.pk not in answered],
        )


def refused_rows(batches: list[Batch], reply_text: str) -> list[tuple[Batch, ClaimedRow]]:
    """The unconfirmed rows a channel close names (exchange, body size), else the first."""
    unconfirmed = [(batch, row) for batch in batches for row in batch.unconfirmed()]
    named = _NAMED_EXCHANGE.search(reply_text)
    if named is not None:
        matching = [(b, row) for b, row in unconfirmed if row.exchange == named.group(1)]
        if matching:
            return matching
    size = MESSAGE_SIZE.search(reply_text)
    if size is not None:
        matching = [
            (b, row) for b, row in unconfirmed if len(row.body.encode("utf-8")) == int(size[1])
        ]
        if matching:
            return matching[:1]
    return unconfirmed[:1]


def charge_refusal(
    batches: list[Batch], reply_code: int, reply_text: str, description: str
) -> tuple[int, str | None]:
    """Charge the rows a channel close was about; how many, and the missing exchange if any."""
    named = _MISSING_EXCHANGE.search(reply_text) if reply_code == NOT_FOUND else None
    missing = named.group(1) if named else None
    culprits = refused_rows(batches, reply_text)
    error = f"the broker closed the channel: {reply_code} {reply_text}"
    limit = size_limit_in(reply_text)
    for batch, row in culprits:
        if reply_code == NOT_FOUND:
            batch.errors[row.pk] = (
                f"exchange {missing!r} does not exist"
                if row.exchange == missing
                else f"the broker closed the channel: {description}"[:2000]  # a 404 of another kind
            )
        elif limit is not None:
            # The broker refuses this body every time: failed at once, not after every attempt.
            size = len(row.body.encode("utf-8"))
            batch.errors[row.pk] = (
                f"the broker refuses a body of {size} bytes: its max_message_size is {limit} "
                f"({reply_code} {reply_text}). Raise max_message_size on the broker, or keep "
                f"RELIABLE_MESSAGING['MAX_BODY_BYTES'] at or below {limit} so that publish() "
                f"refuses such a payload; this row will not be sent"
            )
            batch.final.add(row.pk)
        else:
            batch.errors[row.pk] = error[:2000]
    return len(culprits), missing


def record_outcome(
    outcome: BatchOutcome, held: ClaimTransaction | None, *, using: str, max_attempts: int
) -> Exception | None:
    """Write ``outcome`` and release the next row of each key sent, in ``held`` (or a new
    transaction); the error when it could not. A write that meets a row another relay moved
    meanwhile runs again: in a savepoint of ``held``, which keeps the batch's rows locked
    (rolled back, they would be due for another relay to send again), or in a new
    transaction."""
    write = functools.partial(_write_outcome, outcome, held is None, using, max_attempts)

    def in_a_transaction_or_savepoint() -> None:
        with transaction.atomic(using=using):
            write()

    try:
        if held is None:
            again_if_moved(in_a_transaction_or_savepoint)
        else:
            held.run(lambda: again_if_moved(in_a_transaction_or_savepoint))
    except Exception as exc:  # noqa: BLE001 - whatever failed, the relay goes on
        if isinstance(exc, DatabaseError):
            connections[using].close()  # the next query opens a fresh connection
        return exc
    return None


# A retry copy's key is dropped once sent: it guards only against a second copy waiting beside
# it, and the sent side's unique index would refuse a later copy's record.
_KEPT_KEY = Case(When(raw_properties__isnull=False, then=Value(None)), default=F("idempotency_key"))


def _write_outcome(outcome: BatchOutcome, leased: bool, using: str, max_attempts: int) -> None:
    outbox = OutboxMessage.objects.using(using).filter(status__in=UNSENT_STATUSES)
    if outcome.sent or outcome.unrouted:
        # A day with no partition (every upkeep failing for days) is made here first.
        ensure_covered(using, timezone.now(), OUTBOX)
    if outcome.sent:
        outbox.filter(pk__in=any_id_of(using, outcome.sent)).update(
            status=OutboxStatus.SENT, sent_at=Now(), last_error="", idempotency_key=_KEPT_KEY
        )
    if outcome.unrouted:
        outbox.filter(pk__in=any_id_of(using, (row.pk for row in outcome.unrouted))).update(
            status=OutboxStatus.UNROUTED,
            sent_at=Now(),
            last_error="no queue was bound for its routing key when it was sent",
            idempotency_key=_KEPT_KEY,
        )
    for row in outcome.claimed:
        error = outcome.failures.get(row.pk)
        if error is not None:
            _charge(
                row, error, using=using, max_attempts=max_attempts, final=row.pk in outcome.final
            )
    if outcome.again and leased:
        # Leased rows are due only when the lease runs out, unless made due here.
        outbox.filter(pk__in=any_id_of(using, outcome.again), status=OutboxStatus.PENDING).update(
            next_attempt_at=Now()
        )
    release_next_of_keys(using, outcome.released_keys)


def _charge(
    row: ClaimedRow, error: str, *, using: str, max_attempts: int, final: bool = False
) -> None:
    """A failed send: an attempt, a backoff; ``failed`` past OUTBOX_MAX_ATTEMPTS or if ``final``."""
    attempts = row.attempts + 1
    failed = final or attempts >= max_attempts
    if failed:
        logger.error(
            "relay: message_id=%s %s, marked failed: %s",
            row.message_id,
            "refused for good" if final else f"failed {attempts} times",
            error,
        )
    else:
        logger.warning(
            "relay: message_id=%s not sent (attempt %d): %s", row.message_id, attempts, error
        )
    # Still unsent: a row another relay sent meanwhile (its lease ran out) stays sent.
    OutboxMessage.objects.using(using).filter(pk=row.pk, status__in=UNSENT_STATUSES).update(
        attempts=attempts,
        last_error=error[:2000],
        # From the database's clock, which the claim compares it with.
        next_attempt_at=Now() + Value(resend_backoff(attempts), output_field=DurationField()),
        status=OutboxStatus.FAILED if failed else OutboxStatus.PENDING,
    )
