"""The demo's scenario: place orders, inject trouble, run the workers, check what happened.

1. Start clean: migrate, delete the previous run's rows, purge the demo's queues.
2. Place orders, each in its own transaction with its ``order.placed`` message; some of those
   transactions roll back after ``publish()``.
3. Inject trouble: a few messages published twice under one message_id, and a poison message
   that is not JSON.
4. Run ``manage.py relay`` and ``manage.py consume`` until the expected final state holds,
   then stop them with SIGTERM.
5. The Celery part: a Celery worker with embedded beat replaces ``manage.py relay`` (beat runs
   ``reliable_messaging.relay_outbox`` every few seconds) while a few more orders are placed,
   and customers ask for their receipt by email, some twice; the idempotent task sends one
   email per order. Then the worker and ``consume`` are stopped with SIGTERM.
6. The ``django.tasks`` part (:mod:`.task_scenario`): tasks enqueued from requests'
   transactions (some rolled back) and run by ``manage.py consume``; one succeeds on its retry,
   one fails for good and is replayed with ``manage.py replay_dead_letters``.
7. Read everything back from the database and print the summary, with each task's result.

With ``opentelemetry-sdk`` installed, every process exports its spans to a file under
``demo_project/logs`` and the run ends with the trace of one order that failed once, as a
tree; each order is placed inside a ``POST /orders`` span, as a view would place it.
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path

from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction

from demo_project import tracing as demo_tracing
from demo_project.celery import app as celery_app
from reliable_messaging import publish, tracing
from reliable_messaging.core.registry import registry
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage, TaskRun

from .broker import DemoBroker
from .consumers import REMINDER_DELAY, reminder_id
from .contracts import OFFER_SENT, PAYMENT_REMINDER
from .models import (
    Card,
    Order,
    Payment,
    PaymentReminder,
    Receipt,
    ReceiptEmail,
    Shipment,
    TimelineEvent,
)
from .report import (
    ORDER_PLACED,
    CeleryFacts,
    Injected,
    RunFacts,
    RunState,
    problems,
    read_state,
    summary_lines,
)
from .task_scenario import TaskFacts, result_lines, run_task_part, task_problems
from .tasks import EMAIL_RECEIPT, email_receipt
from .workers import Worker, stop_all

LOG_DIR = Path(__file__).resolve().parents[1] / "logs"
# Every process's spans, one JSON line each; a fresh file per run.
TRACE_FILE = LOG_DIR / "trace.jsonl"
POLL_INTERVAL = 0.5
# How long the final state must hold before the workers are stopped. A duplicate that a
# consumer is handling right now shows in no queue depth (it is unacked, not ready); the pause
# lets it finish, and a queue that is not empty once the workers are gone is reported anyway.
SETTLE_SECONDS = 1.0
# consume finishes its handlers in flight on SIGTERM, for up to SHUTDOWN_TIMEOUT (30 s).
STOP_TIMEOUT = 40.0
ROLLED_BACK = "rolled back"
# The Celery worker's log: beat's relay_outbox runs (with what they sent) and the email calls
# the idempotent task skipped. A skip is logged once per call, with the call's task id.
RELAY_RUN = re.compile(
    r"Task reliable_messaging\.relay_outbox\[[^\]]+\] succeeded in \S+: \{'sent': (\d+)"
)
EMAIL_SKIPPED = re.compile(
    rf"duplicate message_id=\S+ task={re.escape(EMAIL_RECEIPT)} task_id=(\S+):"
)

Say = Callable[[str], None]


class DemoError(Exception):
    """The demo cannot run as things are; the message says what to do."""


@dataclass(frozen=True)
class DemoPlan:
    """How many orders of each kind the demo places, and how many it sends twice."""

    ok: int = 30
    flaky: int = 5
    declined: int = 3
    rolled_back: int = 4
    duplicated: int = 6
    seed: int = 7  # the same orders, in the same order, on every run
    # The Celery part: orders placed while only beat's relay_outbox relays, and how many
    # customers ask for their receipt email a second time.
    celery_orders: int = 4
    emails_asked_twice: int = 5


@dataclass(frozen=True)
class PlacedOrder:
    order: Order
    message_id: str
    trace_id: str | None = None  # of the POST /orders span that placed it, when traced


class CustomerChangedTheirMind(Exception):
    """Raised inside an order's transaction, after publish(), to roll the order back."""


def reset_database() -> None:
    """Migrate, then delete the previous run's rows so every run starts from the same state."""
    call_command("migrate", verbosity=0)
    with transaction.atomic():
        for model in (
            PaymentReminder,
            TimelineEvent,
            ReceiptEmail,
            Receipt,
            Shipment,
            Payment,
            Order,
        ):
            model.objects.all().delete()
        for rm_model in (ProcessedMessage, OutboxMessage, DeadLetter, TaskRun):
            rm_model.objects.all().delete()


def place_orders(plan: DemoPlan, first: int = 1) -> tuple[list[PlacedOrder], list[str]]:
    """Place the plan's orders, customers numbered from ``first``; returns the committed ones
    and the message ids of the others."""
    rng = random.Random(plan.seed)
    kinds: list[str] = [
        *[Card.OK] * plan.ok,
        *[Card.FLAKY] * plan.flaky,
        *[Card.DECLINED] * plan.declined,
        *[ROLLED_BACK] * plan.rolled_back,
    ]
    rng.shuffle(kinds)
    placed: list[PlacedOrder] = []
    rolled_back: list[str] = []
    for number, kind in enumerate(kinds, start=first):
        amount = Decimal(rng.randrange(500, 20000)).scaleb(-2)
        with demo_tracing.web_request("POST", "/orders") as request:
            try:
                with transaction.atomic():
                    order = Order.objects.create(
                        customer=f"customer-{number:02d}",
                        amount=amount,
                        card=Card.OK if kind == ROLLED_BACK else kind,
                    )
                    message_id = publish(
                        ORDER_PLACED,
                        {"order_id": order.pk, "amount": order.amount},
                        ordering_key=str(order.pk),
                    )
                    # "Remind the customer if unpaid in a while": sent by the relay when due,
                    # unless the payment cancels it first.
                    publish(
                        PAYMENT_REMINDER,
                        {"order_id": order.pk},
                        message_id=reminder_id(order),
                        delay=REMINDER_DELAY,
                    )
                    if kind == ROLLED_BACK:
                        rolled_back.append(message_id)
                        raise CustomerChangedTheirMind
            except CustomerChangedTheirMind:
                if request is not None:
                    request.set_attribute("http.response.status_code", 409)
                continue
            if request is not None:
                request.set_attributes(
                    {"http.response.status_code": 201, "shop.order.id": order.pk}
                )
            placed.append(PlacedOrder(order, message_id, tracing.current_trace_id()))
    return placed, rolled_back


def inject_duplicates(placed: Sequence[PlacedOrder], count: int) -> list[PlacedOrder]:
    """Publish some ``order.placed`` messages a second time under the same message_id.

    This is what a producer does when it cannot tell whether its first send went through (a
    timeout, a crash before it recorded success). The broker delivers both copies to every
    consumer; only the inbox stands between them and a second charge. One flaky order is among
    them, so a duplicate also meets a retry.
    """
    flaky = [p for p in placed if p.order.card == Card.FLAKY][:1]
    chosen = [*flaky, *(p for p in placed if p.order.card == Card.OK)][:count]
    for p in chosen:
        with transaction.atomic():
            publish(
                ORDER_PLACED,
                {"order_id": p.order.pk, "amount": p.order.amount},
                message_id=p.message_id,
                ordering_key=str(p.order.pk),
            )
    return chosen


def send_offers(count: int, expires: float) -> list[str]:
    """Publish ``count`` time-limited offers, each valid ``expires`` seconds."""
    return [
        publish(OFFER_SENT, {"offer": f"10% off, {number}"}, expires=expires)
        for number in range(count)
    ]


def consume_worker(name: str, *, relay: bool = True) -> Worker:
    # SQLite has a single writer: more handler threads would only queue for its lock.
    concurrency = 1 if connection.vendor == "sqlite" else 4
    args = ["consume", "--concurrency", str(concurrency), *([] if relay else ["--no-relay"])]
    return Worker.manage(name, args, LOG_DIR)


def start_workers() -> list[Worker]:
    return [Worker.manage("relay", ["relay"], LOG_DIR), consume_worker("consume")]


def wait_until_complete(
    broker: DemoBroker,
    injected: Injected,
    workers: Sequence[Worker],
    timeout: float,
    say: Say,
    done: Callable[[RunState], bool] = lambda state: state.complete,
) -> str:
    """Poll until ``done`` (by default: the expected final state) has held for
    SETTLE_SECONDS; returns "" then, or why it did not get there."""
    deadline = time.monotonic() + timeout
    settled_since: float | None = None
    last_said, last_progress = 0.0, ""
    while True:
        state = read_state(injected, broker.depths())
        now = time.monotonic()
        if not done(state):
            settled_since = None
        elif settled_since is None:
            settled_since = now
        elif now - settled_since >= SETTLE_SECONDS:
            return ""
        for worker in workers:
            if not worker.running:
                return f"manage.py {worker.name} exited before the end"
        if now >= deadline:
            return f"the expected final state was not reached within {timeout:g} s"
        progress = state.progress()
        if now - last_said >= 2.0 and progress != last_progress:
            say(f"  ... {progress}")
            last_said, last_progress = now, progress
        time.sleep(POLL_INTERVAL)


def ensure_admin_user() -> None:
    """The superuser demo / demo, to look at the dead letters in the admin."""
    user, _ = User.objects.get_or_create(username="demo")
    user.is_active = user.is_staff = user.is_superuser = True
    user.set_password("demo")
    user.save()


def count_in_logs(text: str, *logs: Path) -> int:
    """How many times consume's logs say ``text`` (a log that does not exist: that consume
    never started)."""
    count = 0
    for log in logs:
        try:
            count += log.read_text(errors="replace").count(text)
        except OSError:
            continue
    return count


def wait_for_log(worker: Worker, text: str, timeout: float) -> str:
    """Wait until ``text`` appears in the worker's log; "" then, or why it did not."""
    deadline = time.monotonic() + timeout
    while text not in worker.log():
        if not worker.running:
            return f"{worker.name} exited before it was ready"
        if time.monotonic() >= deadline:
            return f"{worker.name} was not ready within {timeout:g} s"
        time.sleep(0.1)
    return ""


def run_celery_part(
    broker: DemoBroker,
    injected: Injected,
    placed: Sequence[PlacedOrder],
    plan: DemoPlan,
    timeout: float,
    say: Say,
) -> tuple[CeleryFacts, dict[str, int], str]:
    """Beat's relay_outbox as the only relay for a few more orders, and the receipt emails.

    Returns what the worker's log counts, the exit codes, and why the part did not finish (""
    when it did)."""
    # Prefork, Celery's default pool; two processes so a relay run and emails overlap.
    celery = Worker.celery("celery", LOG_DIR, concurrency=2)
    # Beat's relay_outbox is the only relay here: the consumer runs none beside its handlers.
    workers = [celery, consume_worker("consume-2", relay=False)]
    asked: list[int] = []  # orders whose receipt email was asked for
    calls: list[int] = []  # one per email_receipt.delay()
    try:
        # The tasks are sent only once the worker consumes, so that none waits behind a
        # worker that is still starting (the emails are the point of this part).
        unfinished = wait_for_log(celery, " ready.", timeout=60)
        if not unfinished:
            extra, _ = place_orders(
                DemoPlan(ok=plan.celery_orders, flaky=0, declined=0, rolled_back=0, seed=plan.seed),
                first=len(placed) + 100,
            )
            asked = [p.order.pk for p in placed if p.order.card != Card.DECLINED]
            calls = asked + asked[: plan.emails_asked_twice]  # some customers ask twice
            for order_id in calls:
                with demo_tracing.web_request("POST", "/orders/{id}/receipt-email"):
                    email_receipt.delay(order_id)
            say(
                f"Celery worker with beat running relay_outbox (log {celery.log_path}): placed "
                f"{len(extra)} more orders, asked {len(asked)} receipt emails, "
                f"{plan.emails_asked_twice} of them twice"
            )

            def emails_done(state: RunState) -> bool:
                skipped = len(set(EMAIL_SKIPPED.findall(celery.log())))
                return (
                    state.complete
                    and sum(o.emails for o in state.orders) == len(asked)
                    and skipped == len(calls) - len(asked)
                )

            unfinished = wait_until_complete(
                broker, injected, workers, timeout, say, done=emails_done
            )
    finally:
        exit_codes = stop_all(workers, STOP_TIMEOUT)
    log = celery.log()
    facts = CeleryFacts(
        orders_placed=plan.celery_orders,
        relay_runs=len(RELAY_RUN.findall(log)),
        relay_sent=sum(int(sent) for sent in RELAY_RUN.findall(log)),
        email_calls=len(calls),
        orders_emailed=len(asked),
        emails_skipped=len(set(EMAIL_SKIPPED.findall(log))),
    )
    return facts, exit_codes, unfinished


def start_tracing(say: Say) -> Path | None:
    """Export this process's spans, and those of the workers it starts, to a fresh
    TRACE_FILE (or to ``$RM_TRACE_FILE`` when it is set); None when the SDK is missing."""
    if os.environ.get(demo_tracing.TRACE_FILE_ENV):
        # The settings have configured this process already; the workers inherit the variable.
        return Path(os.environ[demo_tracing.TRACE_FILE_ENV])
    TRACE_FILE.unlink(missing_ok=True)
    if not demo_tracing.sdk_installed():
        say("Tracing skipped: opentelemetry-sdk is not installed (pip install opentelemetry-sdk)")
        return None
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    os.environ[demo_tracing.TRACE_FILE_ENV] = str(TRACE_FILE)  # the workers' settings read it
    demo_tracing.configure_from_env()
    return TRACE_FILE


def traced_order(placed: Sequence[PlacedOrder], duplicated: Sequence[PlacedOrder]) -> PlacedOrder:
    """The order whose trace is worth showing: a flaky card (failed once, charged on retry)
    that was published only once."""
    sent_twice = {p.message_id for p in duplicated}
    return next(
        (p for p in placed if p.order.card == Card.FLAKY and p.message_id not in sent_twice),
        next((p for p in placed if p.order.card == Card.FLAKY), placed[0]),
    )


def trace_lines(trace_file: Path, order: PlacedOrder) -> list[str]:
    """The order's trace as a tree, read from what every process exported."""
    if order.trace_id is None:
        return [f"(order {order.order.pk} was placed outside a trace)"]
    return [
        f"The trace of order {order.order.pk} (card {order.order.card}), from {trace_file}:",
        *demo_tracing.render_tree(demo_tracing.read_spans(trace_file), order.trace_id).splitlines(),
    ]


def run_demo(say: Say, *, timeout: float = 120.0, plan: DemoPlan | None = None) -> bool:
    """Run the whole scenario and print its summary; True when every guarantee held."""
    plan = plan or DemoPlan()
    started = time.monotonic()
    say("Preparing: migrate, clear the previous run, purge the demo's queues")
    trace_file = start_tracing(say)
    reset_database()
    broker = DemoBroker(registry.all(), celery_queue=celery_app.conf.task_default_queue)
    try:
        broker.declare()
        attached = broker.attached_consumers()
        if attached:
            raise DemoError(
                f"Other processes consume the demo's queues ({attached}); their deliveries "
                f"would be missing from the counts. Stop them first "
                f"(look for them with: pgrep -af 'manage.py consume|celery --app demo_project')."
            )
        broker.purge()

        placed, rolled_back = place_orders(plan)
        duplicated = inject_duplicates(placed, plan.duplicated)
        poison_id = f"poison-{uuid.uuid4()}"
        broker.publish_raw(ORDER_PLACED, b"{not json", message_id=poison_id)
        # Offers valid half a second, published before any worker runs: too late by the time
        # consume starts, so they expire unhandled; the one sent with the workers running is
        # shown.
        stale = send_offers(2, expires=0.5)
        injected = Injected(tuple(rolled_back), poison_id, stale_offers=tuple(stale))
        say(
            f"Placed {len(placed)} orders and rolled back {len(rolled_back)}; published "
            f"{len(duplicated)} of them twice, one message that is not JSON and "
            f"{len(stale)} offers valid for half a second"
        )

        workers = start_workers()
        injected = replace(injected, fresh_offers=tuple(send_offers(1, expires=60)))
        say(f"Running manage.py relay and consume (logs in {LOG_DIR}) until all is settled")
        try:
            unfinished = wait_until_complete(broker, injected, workers, timeout, say)
        finally:
            exit_codes = stop_all(workers, STOP_TIMEOUT)
        celery_facts = None
        if not unfinished:
            celery_facts, celery_codes, unfinished = run_celery_part(
                broker, injected, placed, plan, timeout, say
            )
            exit_codes.update(celery_codes)
        task_facts: TaskFacts | None = None
        if not unfinished:
            task_facts = run_task_part(
                [p.order.pk for p in placed if p.order.card != Card.DECLINED], LOG_DIR, timeout, say
            )
            exit_codes.update(task_facts.exit_codes)
            unfinished = task_facts.unfinished
        # Read after the workers are gone: anything they left unacked is back in its queue.
        state = read_state(injected, broker.depths())
    finally:
        broker.close()
    ensure_admin_user()

    consume_logs = (LOG_DIR / "consume.log", LOG_DIR / "consume-2.log")
    facts = RunFacts(
        seconds=time.monotonic() - started,
        exit_codes=exit_codes,
        # Each delivery the inbox recognised as processed, and each past its deadline.
        duplicates_skipped=count_in_logs("duplicate message_id=", *consume_logs),
        expired=count_in_logs("outcome=expired", *consume_logs),
        unfinished=unfinished,
        celery=celery_facts,
    )
    say("")
    found_in_tasks = task_problems(task_facts) if task_facts is not None else []
    if task_facts is not None:
        for line in result_lines(task_facts):
            say(line)
        for text in found_in_tasks:
            say(f"PROBLEM: {text}")
        say("")
    for line in summary_lines(state, injected, facts):
        say(line)
    if trace_file is not None and placed:
        say("")
        for line in trace_lines(trace_file, traced_order(placed, duplicated)):
            say(line)
    if not problems(state, injected, facts) and not found_in_tasks:
        return True
    for name in exit_codes:
        log = LOG_DIR / f"{name}.log"
        say(f"--- last lines of {log}")
        for line in log.read_text(errors="replace").splitlines()[-15:]:
            say(f"    {line}")
    return False
