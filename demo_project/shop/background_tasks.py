"""The shop's ``django.tasks`` tasks, run by ``manage.py consume`` through the app's task
backend (``TASKS`` in the settings, ``docs/tasks.md``). Each is enqueued in the transaction of
the request that asks for it, so it runs if and only if that transaction commits."""

from __future__ import annotations

from pathlib import Path

from reliable_messaging import PermanentError
from reliable_messaging.task_runs.framework import TaskContext, task

from .models import Order

# Stands in for the courier's booking service: while this file is missing the service refuses
# bookings, and a booking fails for good (a dead letter) until someone replays it.
COURIER_OPEN = Path(__file__).resolve().parents[1] / "logs" / "courier-open"


@task
def award_points(order_id: int) -> int:
    """The loyalty points an order earns: one per whole unit of its amount."""
    return int(Order.objects.get(pk=order_id).amount)


@task(takes_context=True)
def sync_stock(context: TaskContext, order_id: int) -> str:
    """Tell the stock service what an order took; the service times out on the first attempt
    (any exception but PermanentError is retried after RETRY_DELAYS)."""
    if context.attempt < 2:
        raise ConnectionError("the stock service timed out")
    return f"stock of order {order_id} synced at attempt {context.attempt}"


@task
def book_courier(order_id: int) -> str:
    """Book a courier for an order; refused for good while the booking service is closed."""
    if not COURIER_OPEN.exists():
        raise PermanentError("the courier's booking service refuses new bookings")
    return f"courier booked for order {order_id}"
