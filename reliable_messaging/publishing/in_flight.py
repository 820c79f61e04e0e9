"""The batches a relay awaits confirms for: confirms, returns, refusals, timeouts, leases. All
on the I/O loop but the ``*_job`` methods, which run on a database worker."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import metrics, tracing
from ..broker.limits import frame_size_refusal, header_frame_size
from ..broker.publisher import (
    ChannelClosed,
    PublisherTransport,
    Returned,
    Unencodable,
    publish_properties,
)
from ..core.liveness import HealthState
from ..core.routing import topic_matches
from .claims import Claim, OutboxClaims
from .database_worker import DatabaseWorker
from .listener import quietly
from .sent import (
    OUTBOX_ID_HEADER,
    Batch,
    BatchOutcome,
    charge_refusal,
    message_headers,
    record_outcome,
)

logger = logging.getLogger("reliable_messaging.relay")

# Seconds a claim's transaction may stay open awaiting confirms; then its rows are leased.
HOLD_LIMIT = 2.0
# What RabbitMQ's connection close says of a frame over the connection's frame_max.
FRAME_TOO_LARGE = "frame_too_large"


@dataclass(eq=False)
class InFlight:
    """The relay's batches in flight, oldest first."""

    publisher: PublisherTransport
    claims: OutboxClaims
    report: Any  # the relay's RelayReport
    health: HealthState
    on_batch: Callable[[Any], None] | None
    _batches: list[Batch] = field(default_factory=list, init=False)

    def __len__(self) -> int:
        return len(self._batches)

    def on_confirm(self, tag: int, multiple: bool, acked: bool) -> None:
        now = time.monotonic()
        for batch in list(self._batches):
            confirmed, nacked = batch.settle(tag, multiple, acked)
            if confirmed:
                metrics.relay_confirm_latency(now - batch.published_at, confirmed)
            if nacked:
                self.report.nacked += nacked
                metrics.relay_failed("nacked", nacked)
            if batch.rows and batch.complete:
                self._finish_batch(batch)

    def on_returned(self, returned: Returned) -> None:
        """An unroutable message: an event is marked unrouted; a command (``REQUIRE_ROUTE``) or a
        copy for one queue (a retry copy, a replay) is charged and sent again with backoff."""
        row_id = returned.headers.get(OUTBOX_ID_HEADER)
        if not isinstance(row_id, int):
            return
        batch = next((b for b in self._batches if row_id in b.pks), None)
        if batch is None:
            return
        self.report.returned += 1
        metrics.relay_failed("returned")
        require_route = self.claims.settings.require_route
        one_queue = returned.exchange == ""
        if not one_queue and not any(topic_matches(p, returned.routing_key) for p in require_route):
            batch.unrouted.add(row_id)  # its ack follows; the outcome keeps it from "sent"
            return
        batch.errors[row_id] = (
            f"unroutable: {returned.reply_code} {returned.reply_text} (exchange "
            f"{returned.exchange!r}, routing key {returned.routing_key!r}): "
            + (
                "its queue does not exist now (deleted, or its node down)"
                if one_queue
                else "no queue is bound for it, and REQUIRE_ROUTE says it must reach one"
            )
        )

    def on_refused(self, closed: ChannelClosed) -> bool:
        """True when the broker refused a publish in flight: its rows charged, batches recorded."""
        if not (self._batches and closed.by_broker):
            return False
        charged, missing = charge_refusal(
            self._batches, closed.reply_code, closed.reply_text, closed.description
        )
        metrics.relay_failed("refused", charged)
        self.publisher.forget_exchange(missing)
        for batch in list(self._batches):
            self._finish_batch(batch)
        return True

    def pause_timers(self) -> None:
        """The broker blocks us: confirms are late, not lost, so no batch times out meanwhile."""
        for batch in self._batches:
            self.publisher.cancel(batch.timer)
            batch.timer = None

    def resume_timers(self) -> None:
        for batch in self._batches:
            if batch.timer is None:
                self._start_confirm_timer(batch)

    def publish(
        self, worker: DatabaseWorker, claim: Claim, on_recorded: Callable[[bool], None]
    ) -> None:
        """I/O loop: publish a claimed batch; ``on_recorded(recorded)`` follows on the I/O loop."""
        rows = claim.rows
        metrics.relay_claimed(len(rows))
        batch = Batch(
            rows={},
            claimed=rows,
            pks={row.pk for row in rows},
            worker=worker,
            transaction=claim.transaction,
            published_at=time.monotonic(),
            on_recorded=on_recorded,
        )
        self._batches.append(batch)
        worker.batch = batch
        tracing_on = tracing.active()
        now = dt.datetime.now(dt.UTC)
        refused = 0  # rows not published
        for row in rows:
            if not self.publisher.exchange_exists(row.exchange):
                refused += 1
                batch.errors[row.pk] = f"exchange {row.exchange!r} does not exist"
                continue
            headers = message_headers(row)
            span = None
            # A span per row, in its publish()'s trace; a retry copy keeps its original's.
            if tracing_on and row.raw_properties is None:
                span = tracing.start_send(
                    headers,
                    exchange=row.exchange,
                    routing_key=row.routing_key,
                    message_id=row.message_id,
                    created_at=row.published_at,
                    now=now,
                )
                tracing.sent_with(span, headers)
            try:
                tag = self.publisher.publish(
                    row.exchange,
                    row.routing_key,
                    row.wire_body,
                    message_id=row.message_id,
                    timestamp=row.published_us // 1_000_000,
                    headers=headers,
                    stored_properties=row.stored_properties,
                )
            except Unencodable as exc:
                # pika encodes a row the same way every time: failed at once, not retried.
                refused += 1
                batch.errors[row.pk] = f"{exc}; this row will not be sent"[:2000]
                batch.final.add(row.pk)
                tracing.end_send(span, "failed", batch.errors[row.pk])
                continue
            batch.rows[tag] = row
            if span is not None:
                batch.spans[row.pk] = span
        self.publisher.flush()
        batch.lowest_unsettled = min(batch.rows, default=0)  # tags are consecutive
        if refused:
            metrics.relay_failed("refused", refused)
        if not batch.rows:
            self._finish_batch(batch)
            return
        self._start_confirm_timer(batch)

    def _start_confirm_timer(self, batch: Batch) -> None:
        batch.timer = self.publisher.call_later(
            self.claims.settings.relay_confirm_timeout, lambda: self._on_confirm_timeout(batch)
        )

    def _on_confirm_timeout(self, batch: Batch) -> None:
        if batch not in self._batches:
            return
        batch.timer = None
        timed_out = batch.time_out(self.claims.settings.relay_confirm_timeout)
        self.report.timed_out += timed_out
        metrics.relay_failed("timeout", timed_out)
        self._finish_batch(batch)
        # A channel that stopped confirming is not to be trusted: start afresh.
        self.publisher.close("confirm timeout")

    def renew_leases(self) -> None:
        """Lease the batches unconfirmed past HOLD_LIMIT, renewed at half the lease."""
        now = time.monotonic()
        half = self.claims.lease_for.total_seconds() / 2
        for batch in self._batches:
            if batch.leased_at == 0.0:
                due = now - batch.published_at >= HOLD_LIMIT  # still holds its transaction
            else:
                due = now - batch.leased_at >= half
            if due:
                batch.leased_at = now
                batch.worker.submit(functools.partial(self._lease_job, batch))

    def _lease_job(self, batch: Batch) -> None:
        """Database worker: lease the batch's rows, committing its claim's transaction."""
        held, batch.transaction = batch.transaction, None
        self.claims.lease(batch.claimed, held)

    def _finish_batch(self, batch: Batch, then_claim: bool = True) -> None:
        """Record the batch's outcome in one short transaction."""
        if batch not in self._batches:
            return
        self._batches.remove(batch)
        # The connection may be gone (abort).
        quietly(lambda: self.publisher.cancel(batch.timer), "removing the confirm timer")
        batch.timer = None
        batch.worker.submit(functools.partial(self._settle_job, batch, then_claim))

    def _settle_job(self, batch: Batch, then_claim: bool = True) -> None:
        """Database worker: record a finished batch, then let the I/O loop claim again."""
        recorded = self._settle(batch)
        if recorded:
            self.report.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.report)
        if then_claim:
            self.publisher.post(functools.partial(self._after_settle, batch, recorded))

    def _after_settle(self, batch: Batch, recorded: bool) -> None:
        if batch.worker.batch is batch:
            batch.worker.batch = None
        if batch.on_recorded is not None:
            batch.on_recorded(recorded)

    def _settle(self, batch: Batch) -> bool:
        """Database worker: record and count the batch's outcome; False when it could not be."""
        outcome = batch.outcome()
        held, batch.transaction = batch.transaction, None
        error = record_outcome(
            outcome,
            held,
            using=self.claims.using,
            max_attempts=self.claims.settings.outbox_max_attempts,
        )
        if error is not None:
            logger.warning(
                "relay: cannot record a batch's confirms (%s); its %d row(s) stay "
                "pending and will be sent again",
                error,
                len(batch.claimed),
            )
            self.health.set_database(False, str(error))
            for span in batch.spans.values():
                tracing.end_send(span, "again", f"its outcome could not be recorded: {error}")
            return False
        if batch.spans:
            _end_send_spans(batch, outcome)
        sent, unrouted = outcome.sent, outcome.unrouted
        self.report.sent += len(sent)
        self.report.unrouted += len(unrouted)
        if unrouted:
            # One line per batch: events nobody subscribes to yet are normal.
            logger.info(
                "relay: %d event(s) reached no queue (nothing subscribes to their routing key "
                "yet), marked unrouted and not retried: %s",
                len(unrouted),
                ", ".join(f"message_id={r.message_id} ({r.routing_key})" for r in unrouted[:10])
                + (", ..." if len(unrouted) > 10 else ""),
            )
        metrics.relay_published(len(sent))
        if logger.isEnabledFor(logging.DEBUG):
            for pk in sent:
                logger.debug("relay: sent outbox row %s", pk)
        return True

    def abort(self, why: str) -> None:
        """The connection or channel died: what was confirmed is marked sent, the rest due again."""
        if not self._batches:
            return
        self._charge_oversized(why)
        rows = sum(len(batch.claimed) for batch in self._batches)
        for batch in list(self._batches):
            self._finish_batch(batch, then_claim=False)
        logger.warning(
            "relay: %d row(s) in flight when %s; the unconfirmed ones are due again", rows, why
        )

    def _charge_oversized(self, why: str) -> None:
        """After a ``frame_too_large`` close, fail for good the rows whose header frame is over
        frame_max: they would close every connection."""
        if FRAME_TOO_LARGE not in why:
            return
        frame_max = self.publisher.frame_max
        charged = 0
        for batch in self._batches:
            for row in batch.unconfirmed():
                properties = publish_properties(
                    row.message_id,
                    row.published_us // 1_000_000,
                    message_headers(row),
                    row.stored_properties,
                )
                size = header_frame_size(properties, len(row.wire_body))
                refusal = frame_size_refusal(size, frame_max)
                if refusal is not None:
                    batch.errors[row.pk] = f"{refusal}; this row will not be sent ({why})"[:2000]
                    batch.final.add(row.pk)
                    charged += 1
        if charged:
            metrics.relay_failed("refused", charged)


def _end_send_spans(batch: Batch, outcome: BatchOutcome) -> None:
    """End the batch's ``send`` spans with what became of each row, once it is recorded."""
    sent = set(outcome.sent)
    unrouted = {row.pk for row in outcome.unrouted}
    for pk, span in batch.spans.items():
        if pk in sent:
            tracing.end_send(span, "sent")
        elif pk in unrouted:
            tracing.end_send(span, "unrouted")
        elif pk in outcome.failures:
            tracing.end_send(span, "failed", outcome.failures[pk])
        else:
            tracing.end_send(span, "again")
