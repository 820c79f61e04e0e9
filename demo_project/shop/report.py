"""What a demo run left in the database, whether the guarantees held, and the printed summary.

Every figure of the shop is read back from the database (orders, payments, emails, inbox,
outbox, dead letters). The only inputs are what cannot be found there afterwards: the message ids
publish() returned inside the rolled-back transactions (rolled back, so nowhere), the poison
message's id, and what the processes did (their exit codes, what their logs count).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from django.db import connection
from django.db.models import Count

from reliable_messaging.choices import DeadLetterReason, OutboxStatus
from reliable_messaging.core.registry import registry
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.task_runs.naming import TASK_CONSUMER_PREFIX

from .consumers import BILLING, OFFERS
from .contracts import ORDER_PLACED, PAYMENT_CAPTURED, PAYMENT_REMINDER
from .models import Card, Order, Payment, PaymentReminder, TimelineEvent


@dataclass(frozen=True)
class Injected:
    """What the scenario did that the database cannot show afterwards."""

    rolled_back_message_ids: tuple[str, ...]
    poison_message_id: str
    # Offers published with a deadline that passes before consume runs, and one sent after.
    stale_offers: tuple[str, ...] = ()
    fresh_offers: tuple[str, ...] = ()


class OrderEffects(NamedTuple):
    card: str
    payments: int
    shipments: int
    receipts: int
    emails: int  # receipt emails sent by the Celery task

    @property
    def payable(self) -> bool:
        return self.card != Card.DECLINED


class ReminderRow(NamedTuple):
    order_id: int
    late: float  # seconds from the scheduled message's due time to its handling


class DeadLetterRow(NamedTuple):
    consumer: str
    message_id: str
    reason: str
    error: str


@dataclass(frozen=True)
class RunState:
    """The shop, the inbox, the outbox, the dead letters and the queues, read in one go."""

    orders: tuple[OrderEffects, ...]
    retry_attempts: tuple[int, ...]  # Payment.attempt of every payment that needed a retry
    dead_letters: tuple[DeadLetterRow, ...]
    outbox_pending: int
    outbox_failed: int
    leaked: int  # outbox, inbox and dead-letter rows of the rolled-back orders' messages
    duplicated_ids: tuple[str, ...]  # message ids published twice (two outbox rows)
    inbox_rows_of_duplicates: Mapping[str, int]
    order_placed_consumers: tuple[str, ...]
    poison_message_id: str
    queue_depths: Mapping[str, int] = field(default_factory=dict)
    # Each order's timeline events, in the order the ordered consumer committed them.
    timelines: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    order_ids: tuple[int, ...] = ()
    fresh_offers: int = 0  # how many were sent with time to spare
    # Payment reminders: those handled, the scheduled messages the relay sent, those waiting.
    reminders: tuple[ReminderRow, ...] = ()
    reminders_sent: int = 0
    reminders_waiting: int = 0
    # The offers the offers consumer handled (its inbox rows), of the stale and fresh ones.
    stale_offers_shown: int = 0
    fresh_offers_shown: int = 0

    @property
    def unpaid_ids(self) -> list[int]:
        return [
            order_id
            for order_id, order in zip(self.order_ids, self.orders, strict=True)
            if not order.payments
        ]

    @property
    def reminders_complete(self) -> bool:
        """Every unpaid order reminded, and no reminder still waiting (the others cancelled)."""
        reminded = {r.order_id for r in self.reminders}
        return not self.reminders_waiting and all(i in reminded for i in self.unpaid_ids)

    @property
    def by_card(self) -> Counter[str]:
        return Counter(order.card for order in self.orders)

    @property
    def payable(self) -> list[OrderEffects]:
        return [order for order in self.orders if order.payable]

    @property
    def doubled(self) -> dict[str, int]:
        """Orders with more than one payment, shipment or receipt: must all be 0."""
        return {
            "payments": sum(1 for o in self.orders if o.payments > 1),
            "shipments": sum(1 for o in self.orders if o.shipments > 1),
            "receipts": sum(1 for o in self.orders if o.receipts > 1),
        }

    def is_declined_card(self, letter: DeadLetterRow) -> bool:
        return (
            letter.consumer == BILLING
            and letter.reason == DeadLetterReason.PERMANENT
            and "card declined" in letter.error
        )

    def is_poison(self, letter: DeadLetterRow) -> bool:
        return (
            letter.message_id == self.poison_message_id
            and letter.reason == DeadLetterReason.INVALID_JSON
        )

    def expected_timeline(self, order: OrderEffects) -> tuple[str, ...]:
        return (ORDER_PLACED, PAYMENT_CAPTURED) if order.payable else (ORDER_PLACED,)

    @property
    def timelines_in_order(self) -> int:
        """Orders whose timeline is exactly their events in publish order."""
        return sum(
            1
            for order_id, order in zip(self.order_ids, self.orders, strict=True)
            if self.timelines.get(order_id, ()) == self.expected_timeline(order)
        )

    @property
    def timelines_complete(self) -> bool:
        return all(
            len(self.timelines.get(order_id, ())) >= len(self.expected_timeline(order))
            for order_id, order in zip(self.order_ids, self.orders, strict=True)
        )

    @property
    def expected_dead_letters(self) -> int:
        """One per declined card (billing), one per consumer the poison message reached."""
        return self.by_card[Card.DECLINED] + len(self.order_placed_consumers)

    @property
    def complete(self) -> bool:
        """Every expected effect and dead letter is there and nothing waits to be sent or
        consumed. Doubles do not hold it back: they are reported as problems."""
        return (
            all(o.payments and o.receipts for o in self.payable)
            and all(o.shipments for o in self.orders)
            and sum(1 for d in self.dead_letters if self.is_declined_card(d))
            >= self.by_card[Card.DECLINED]
            and sum(1 for d in self.dead_letters if self.is_poison(d))
            >= len(self.order_placed_consumers)
            and self.timelines_complete
            and self.reminders_complete
            and self.fresh_offers_shown == self.fresh_offers
            and self.outbox_pending == 0
            and not any(self.queue_depths.values())
        )

    def progress(self) -> str:
        payments = sum(o.payments for o in self.orders)
        shipments = sum(o.shipments for o in self.orders)
        receipts = sum(o.receipts for o in self.orders)
        return (
            f"payments {payments}/{len(self.payable)}, shipments {shipments}/{len(self.orders)}, "
            f"receipts {receipts}/{len(self.payable)}, dead letters {len(self.dead_letters)}/"
            f"{self.expected_dead_letters}, reminders {len(self.reminders)} "
            f"({self.reminders_waiting} scheduled), outbox pending {self.outbox_pending}, "
            f"queued {sum(self.queue_depths.values())}"
        )


def read_state(injected: Injected, queue_depths: Mapping[str, int] | None = None) -> RunState:
    """Read the run's state from the database (and the queue depths the caller measured)."""
    orders = Order.objects.annotate(
        # distinct: the three joins multiply the rows; counting distinct ids keeps each exact.
        paid=Count("payments", distinct=True),
        shipped=Count("shipments", distinct=True),
        receipted=Count("receipts", distinct=True),
        emailed=Count("receipt_emails", distinct=True),
    ).order_by("pk")
    duplicated = tuple(
        OutboxMessage.objects.filter(routing_key=ORDER_PLACED)
        .values("message_id")
        .annotate(rows=Count("id"))
        .filter(rows__gt=1)
        .values_list("message_id", flat=True)
    )
    rolled_back = list(injected.rolled_back_message_ids)
    shown = ProcessedMessage.objects.filter(consumer=OFFERS)
    return RunState(
        orders=tuple(
            OrderEffects(*row)
            for row in orders.values_list("card", "paid", "shipped", "receipted", "emailed")
        ),
        retry_attempts=tuple(
            Payment.objects.filter(attempt__gt=1).values_list("attempt", flat=True)
        ),
        dead_letters=tuple(
            DeadLetterRow(*row)
            # The shop's messages': the task part reports its own (a replayed task's).
            for row in DeadLetter.objects.exclude(consumer__startswith=TASK_CONSUMER_PREFIX)
            .order_by("pk")
            .values_list("consumer", "message_id", "reason", "exception_message")
        ),
        outbox_pending=OutboxMessage.objects.pending().count(),
        outbox_failed=OutboxMessage.objects.filter(status=OutboxStatus.FAILED).count(),
        leaked=(
            OutboxMessage.objects.filter(message_id__in=rolled_back).count()
            + ProcessedMessage.objects.filter(message_id__in=rolled_back).count()
            + DeadLetter.objects.filter(message_id__in=rolled_back).count()
        ),
        duplicated_ids=duplicated,
        inbox_rows_of_duplicates=dict(
            ProcessedMessage.objects.filter(message_id__in=duplicated)
            .values("message_id")
            .annotate(rows=Count("id"))
            .values_list("message_id", "rows")
        ),
        # An exact binding match is enough: the shop binds no wildcard patterns.
        order_placed_consumers=tuple(s.name for s in registry.all() if ORDER_PLACED in s.bindings),
        poison_message_id=injected.poison_message_id,
        queue_depths=dict(queue_depths or {}),
        timelines=_timelines(),
        order_ids=tuple(orders.values_list("pk", flat=True)),
        reminders=tuple(
            ReminderRow(order_id, (created - due).total_seconds())
            for order_id, due, created in PaymentReminder.objects.order_by("pk").values_list(
                "order_id", "due_at", "created_at"
            )
        ),
        reminders_sent=OutboxMessage.objects.filter(
            routing_key=PAYMENT_REMINDER, status=OutboxStatus.SENT
        ).count(),
        reminders_waiting=OutboxMessage.objects.filter(
            routing_key=PAYMENT_REMINDER, status=OutboxStatus.SCHEDULED
        ).count(),
        fresh_offers=len(injected.fresh_offers),
        stale_offers_shown=shown.filter(message_id__in=injected.stale_offers).count(),
        fresh_offers_shown=shown.filter(message_id__in=injected.fresh_offers).count(),
    )


def _timelines() -> dict[int, tuple[str, ...]]:
    events: dict[int, list[str]] = {}
    for order_id, event in TimelineEvent.objects.order_by("pk").values_list("order_id", "event"):
        events.setdefault(order_id, []).append(event)
    return {order_id: tuple(seq) for order_id, seq in events.items()}


@dataclass(frozen=True)
class CeleryFacts:
    """What the Celery part did: what the scenario asked, and what the worker's log counts."""

    orders_placed: int  # orders placed while beat's relay_outbox was the only relay
    relay_runs: int  # relay_outbox runs the worker logged as succeeded
    relay_sent: int  # messages those runs sent
    email_calls: int  # email_receipt.delay() calls
    orders_emailed: int  # the distinct orders they asked an email for
    emails_skipped: int  # calls the worker logged as duplicates, their body skipped


@dataclass(frozen=True)
class RunFacts:
    """How the run went outside the database: duration, worker exits, the consume logs."""

    seconds: float
    exit_codes: Mapping[str, int]
    duplicates_skipped: int  # "duplicate message_id=..." lines in the consume logs
    expired: int = 0  # "outcome=expired" lines in the consume logs
    unfinished: str = ""  # why the run stopped before the expected final state, if it did
    celery: CeleryFacts | None = None  # None when the run stopped before the Celery part


def problems(state: RunState, injected: Injected, facts: RunFacts) -> list[str]:
    """Every broken guarantee or unexpected outcome, in words; empty when the run is clean."""
    found: list[str] = []
    if facts.unfinished:
        found.append(facts.unfinished)
    for what, count in state.doubled.items():
        if count:
            found.append(f"{count} order(s) have more than one of their {what}")
    uncharged = sum(1 for o in state.payable if not o.payments)
    if uncharged:
        found.append(f"{uncharged} payable order(s) were never charged")
    if any(o.payments for o in state.orders if not o.payable):
        found.append("an order with a declined card was charged")
    if any(not o.receipts for o in state.payable):
        found.append("a charged order has no receipt")
    if any(not o.shipments for o in state.orders):
        found.append("an order was never shipped")
    if state.leaked:
        found.append(
            f"{state.leaked} message row(s) exist for the {len(injected.rolled_back_message_ids)} "
            f"rolled-back orders (outbox, inbox or dead letters)"
        )
    for message_id in state.duplicated_ids:
        rows = state.inbox_rows_of_duplicates.get(message_id, 0)
        if rows != len(state.order_placed_consumers):
            found.append(
                f"duplicated message_id={message_id} was taken {rows} time(s) by its "
                f"{len(state.order_placed_consumers)} consumers"
            )
    for order_id, order in zip(state.order_ids, state.orders, strict=True):
        timeline = state.timelines.get(order_id, ())
        if timeline != state.expected_timeline(order):
            found.append(
                f"order {order_id}'s timeline is {list(timeline)}, expected "
                f"{list(state.expected_timeline(order))}"
            )
    reminded = Counter(r.order_id for r in state.reminders)
    doubled_reminders = sum(1 for n in reminded.values() if n > 1)
    if doubled_reminders:
        found.append(f"{doubled_reminders} order(s) got more than one payment reminder")
    unreminded = [i for i in state.unpaid_ids if i not in reminded]
    if unreminded:
        found.append(f"unpaid order(s) {unreminded} got no payment reminder")
    early = [r for r in state.reminders if r.late < 0]
    if early:
        found.append(f"{len(early)} payment reminder(s) handled before they were due")
    if state.stale_offers_shown:
        found.append(f"{state.stale_offers_shown} offer(s) were shown past their deadline")
    if facts.expired != len(injected.stale_offers):
        found.append(
            f"consume logged {facts.expired} expired message(s) for the "
            f"{len(injected.stale_offers)} offers sent too late"
        )
    if state.fresh_offers_shown != state.fresh_offers:
        found.append(
            f"{state.fresh_offers_shown} of the {state.fresh_offers} offers sent in time were shown"
        )
    if state.reminders_waiting:
        found.append(f"{state.reminders_waiting} payment reminder(s) still scheduled")
    declined = [d for d in state.dead_letters if state.is_declined_card(d)]
    if len(declined) != state.by_card[Card.DECLINED]:
        found.append(
            f"{len(declined)} declined-card dead letters for {state.by_card[Card.DECLINED]} "
            f"declined orders"
        )
    poison = [d for d in state.dead_letters if state.is_poison(d)]
    if len(poison) != len(state.order_placed_consumers):
        found.append(
            f"the poison message is a dead letter in {len(poison)} of the "
            f"{len(state.order_placed_consumers)} consumers it reached"
        )
    found += [
        f"unexpected dead letter: {d.consumer} message_id={d.message_id} {d.reason}: {d.error}"
        for d in state.dead_letters
        if not (state.is_declined_card(d) or state.is_poison(d))
    ]
    if state.outbox_pending or state.outbox_failed:
        found.append(
            f"the outbox still has {state.outbox_pending} pending and "
            f"{state.outbox_failed} failed row(s)"
        )
    if facts.celery is not None:
        found += celery_problems(state, facts.celery)
    left = {queue: n for queue, n in state.queue_depths.items() if n}
    if left:
        found.append(f"messages left in the queues after the workers stopped: {left}")
    for name, code in facts.exit_codes.items():
        if code:
            found.append(f"manage.py {name} exited with code {code}")
    return found


def celery_problems(state: RunState, celery: CeleryFacts) -> list[str]:
    found: list[str] = []
    if not celery.relay_runs:
        found.append("Celery beat never ran relay_outbox")
    doubled = sum(1 for o in state.orders if o.emails > 1)
    if doubled:
        found.append(f"{doubled} order(s) got more than one receipt email")
    emailed = sum(1 for o in state.orders if o.emails)
    if emailed != celery.orders_emailed:
        found.append(f"{emailed} of the {celery.orders_emailed} orders asked got their email")
    took_effect = sum(o.emails for o in state.orders)
    if took_effect + celery.emails_skipped != celery.email_calls:
        found.append(
            f"{celery.email_calls} email task calls, but {took_effect} took effect and "
            f"{celery.emails_skipped} were skipped as duplicates"
        )
    return found


def _attempts_text(attempts: tuple[int, ...]) -> str:
    distinct = sorted(set(attempts))
    if not distinct:
        return "none were needed"
    if len(distinct) == 1:
        return f"all succeeded on attempt {distinct[0]}"
    return "succeeded on attempts " + ", ".join(str(a) for a in distinct)


def _dead_letters_text(state: RunState) -> str:
    """E.g. "3 permanent error: card declined; 2 invalid JSON: 1 message x 2 consumers"."""
    labels: dict[str, Any] = dict(DeadLetterReason.choices)
    parts = []
    for reason, count in Counter(d.reason for d in state.dead_letters).most_common():
        letters = [d for d in state.dead_letters if d.reason == reason]
        text = f"{count} {labels.get(reason, reason)}"
        if reason in (DeadLetterReason.PERMANENT, DeadLetterReason.RETRIES_EXHAUSTED):
            text += ": " + ", ".join(sorted({d.error for d in letters}))
        messages = len({d.message_id for d in letters})
        if messages < count:
            consumers = len({d.consumer for d in letters})
            text += f": {messages} message x {consumers} consumers"
        parts.append(text)
    return "; ".join(parts) or "none"


def _reminders_text(state: RunState) -> str:
    """E.g. "for the 3 unpaid orders, 0.1-0.3 s after due; 39 cancelled by their payment"."""
    cancelled = len(state.orders) - state.reminders_sent - state.reminders_waiting
    text = f"for the {len(state.unpaid_ids)} unpaid orders"
    if state.reminders:
        late = [r.late for r in state.reminders]
        text += f", {min(late):.1f}-{max(late):.1f} s after due"
    return f"{text}; {cancelled} cancelled by their payment"


def _row(label: str, value: object, detail: str = "") -> str:
    return f"  {label:<33}{value!s:>6}   {detail}".rstrip()


def summary_lines(state: RunState, injected: Injected, facts: RunFacts) -> list[str]:
    """The summary a person can check at a glance."""
    yes = {True: "yes", False: "NO"}
    doubled = state.doubled
    by_card = state.by_card
    charged_once = all(o.payments == 1 for o in state.payable)
    taken_once = all(
        state.inbox_rows_of_duplicates.get(m, 0) == len(state.order_placed_consumers)
        for m in state.duplicated_ids
    )
    codes = ", ".join(f"{name} {code}" for name, code in facts.exit_codes.items())
    lines = [
        f"reliable_messaging demo — summary ({connection.display_name}, {facts.seconds:.1f} s)",
        _row(
            "orders placed (committed)",
            len(state.orders),
            f"{by_card[Card.OK]} card ok, {by_card[Card.FLAKY]} flaky, "
            f"{by_card[Card.DECLINED]} declined"
            + (f"; {facts.celery.orders_placed} while Celery beat relayed" if facts.celery else ""),
        ),
        _row(
            "orders rolled back",
            len(injected.rolled_back_message_ids),
            f"messages sent for them: {state.leaked}",
        ),
        _row(
            "duplicate deliveries injected",
            len(state.duplicated_ids),
            f"each taken once per consumer: {yes[taken_once]} "
            f"({facts.duplicates_skipped} copies skipped by the inbox)",
        ),
        _row(
            "payments made",
            sum(o.payments for o in state.orders),
            f"(one per payable order: {yes[charged_once]}; doubled: {doubled['payments']})",
        ),
        _row(
            "shipments",
            sum(o.shipments for o in state.orders),
            f"receipts {sum(o.receipts for o in state.orders)} "
            f"(doubled: {doubled['shipments'] + doubled['receipts']})",
        ),
        _row(
            "order timelines (ordered consumer)",
            state.timelines_in_order,
            f"of {len(state.orders)} in publish order, placed before paid, once each: "
            f"{yes[state.timelines_in_order == len(state.orders)]}",
        ),
        _row(
            "payment reminders (scheduled)",
            len(state.reminders),
            _reminders_text(state),
        ),
        _row(
            "offers with a deadline",
            len(injected.stale_offers) + state.fresh_offers,
            f"{facts.expired} expired before consume ran, not shown; "
            f"{state.fresh_offers_shown} sent in time and shown",
        ),
        _row(
            "retries (transient failures)",
            len(state.retry_attempts),
            _attempts_text(state.retry_attempts),
        ),
        _row("dead letters", len(state.dead_letters), f"({_dead_letters_text(state)})"),
    ]
    if facts.celery is not None:
        celery = facts.celery
        one_each = all(o.emails <= 1 for o in state.orders)
        lines += [
            _row(
                "relay_outbox runs by Celery beat",
                celery.relay_runs,
                f"(sent {celery.relay_sent} messages: those of the {celery.orders_placed} "
                f"orders placed meanwhile)",
            ),
            _row(
                "idempotent task calls",
                celery.email_calls,
                f"took effect: {sum(o.emails for o in state.orders)} (duplicates skipped: "
                f"{celery.emails_skipped}; one receipt email per order: {yes[one_each]})",
            ),
        ]
    lines.append(f"  {'worker exit codes':<42}{codes}")
    found = problems(state, injected, facts)
    lines += [f"PROBLEM: {text}" for text in found] or [
        "OK: nothing charged, shipped or receipted twice; nothing sent for rolled-back "
        "orders; only the expected dead letters"
    ]
    lines += [
        "Review and replay the dead letters in the admin:",
        "  python manage.py runserver   then open "
        "http://127.0.0.1:8000/admin/reliable_messaging/deadletter/",
        "  and the django.tasks results at http://127.0.0.1:8000/admin/reliable_messaging/taskrun/",
        "  login: demo / demo",
    ]
    return lines
