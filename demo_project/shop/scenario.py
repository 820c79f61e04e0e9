"""The demo's scenario: place orders, inject trouble, run the workers, check what happened.

1. Start clean: migrate, delete the previous run's rows, purge the demo's queues.
2. Place orders, each in its own transaction with its ``order.placed`` message; some of those
   transactions roll back after ``publish()``.
3. Inject trouble: a few messages published twice under one message_id, and a poison message
   that is not JSON.
4. Run ``manage.py relay`` and ``manage.py consume`` until the expected final state holds,
   then stop them with SIGTERM.
5. Read everything back from the database and print the summary.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection, transaction

from reliable_messaging import publish
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.registry import registry

from .broker import DemoBroker
from .models import Card, Order, Payment, Receipt, Shipment
from .report import ORDER_PLACED, Injected, RunFacts, problems, read_state, summary_lines
from .workers import Worker, stop_all

LOG_DIR = Path(__file__).resolve().parents[1] / "logs"
POLL_INTERVAL = 0.5
# How long the final state must hold before the workers are stopped. A duplicate that a
# consumer is handling right now shows in no queue depth (it is unacked, not ready); the pause
# lets it finish, and a queue that is not empty once the workers are gone is reported anyway.
SETTLE_SECONDS = 1.0
# consume finishes its handlers in flight on SIGTERM, for up to SHUTDOWN_TIMEOUT (30 s).
STOP_TIMEOUT = 40.0
ROLLED_BACK = "rolled back"

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


@dataclass(frozen=True)
class PlacedOrder:
    order: Order
    message_id: str


class CustomerChangedTheirMind(Exception):
    """Raised inside an order's transaction, after publish(), to roll the order back."""


def reset_database() -> None:
    """Migrate, then delete the previous run's rows so every run starts from the same state."""
    call_command("migrate", verbosity=0)
    with transaction.atomic():
        for model in (Receipt, Shipment, Payment, Order):
            model.objects.all().delete()
        for rm_model in (ProcessedMessage, OutboxMessage, DeadLetter):
            rm_model.objects.all().delete()


def place_orders(plan: DemoPlan) -> tuple[list[PlacedOrder], list[str]]:
    """Place the plan's orders; returns the committed ones and the message ids of the others."""
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
    for number, kind in enumerate(kinds, start=1):
        amount = Decimal(rng.randrange(500, 20000)).scaleb(-2)
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
                if kind == ROLLED_BACK:
                    rolled_back.append(message_id)
                    raise CustomerChangedTheirMind
        except CustomerChangedTheirMind:
            continue
        placed.append(PlacedOrder(order, message_id))
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


def start_workers() -> list[Worker]:
    # SQLite has a single writer: more handler threads would only queue for its lock.
    concurrency = 1 if connection.vendor == "sqlite" else 4
    return [
        Worker("relay", ["relay"], LOG_DIR),
        Worker("consume", ["consume", "--concurrency", str(concurrency)], LOG_DIR),
    ]


def wait_until_complete(
    broker: DemoBroker, injected: Injected, workers: Sequence[Worker], timeout: float, say: Say
) -> str:
    """Poll until the expected final state has held for SETTLE_SECONDS; returns "" then, or
    why it did not get there."""
    deadline = time.monotonic() + timeout
    settled_since: float | None = None
    last_said, last_progress = 0.0, ""
    while True:
        state = read_state(injected, broker.depths())
        now = time.monotonic()
        if not state.complete:
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


def count_skipped_duplicates(log: Path) -> int:
    """How many deliveries the inbox recognised as already processed, per consume's log."""
    try:
        return log.read_text(errors="replace").count("duplicate message_id=")
    except OSError:
        return 0


def run_demo(say: Say, *, timeout: float = 120.0, plan: DemoPlan | None = None) -> bool:
    """Run the whole scenario and print its summary; True when every guarantee held."""
    plan = plan or DemoPlan()
    started = time.monotonic()
    say("Preparing: migrate, clear the previous run, purge the demo's queues")
    reset_database()
    broker = DemoBroker(registry.all())
    try:
        broker.declare()
        attached = broker.attached_consumers()
        if attached:
            raise DemoError(
                f"Other processes consume the demo's queues ({attached}); their deliveries "
                f"would be missing from the counts. Stop them first "
                f"(look for them with: pgrep -af 'manage.py consume')."
            )
        broker.purge()

        placed, rolled_back = place_orders(plan)
        duplicated = inject_duplicates(placed, plan.duplicated)
        poison_id = f"poison-{uuid.uuid4()}"
        broker.publish_raw(ORDER_PLACED, b"{not json", message_id=poison_id)
        injected = Injected(tuple(rolled_back), poison_id)
        say(
            f"Placed {len(placed)} orders and rolled back {len(rolled_back)}; published "
            f"{len(duplicated)} of them twice and one message that is not JSON"
        )

        workers = start_workers()
        say(f"Running manage.py relay and consume (logs in {LOG_DIR}) until all is settled")
        try:
            unfinished = wait_until_complete(broker, injected, workers, timeout, say)
        finally:
            exit_codes = stop_all(workers, STOP_TIMEOUT)
        # Read after the workers are gone: anything they left unacked is back in its queue.
        state = read_state(injected, broker.depths())
    finally:
        broker.close()
    ensure_admin_user()

    facts = RunFacts(
        seconds=time.monotonic() - started,
        exit_codes=exit_codes,
        duplicates_skipped=count_skipped_duplicates(LOG_DIR / "consume.log"),
        unfinished=unfinished,
    )
    say("")
    for line in summary_lines(state, injected, facts):
        say(line)
    if not problems(state, injected, facts):
        return True
    for worker in workers:
        say(f"--- last lines of {worker.log_path}")
        for line in worker.tail():
            say(f"    {line}")
    return False
