"""The Celery task ``reliable_messaging.relay_outbox``, run eagerly (no worker needed)."""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.broker import declaring
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.conf import messaging_settings
from reliable_messaging.models import OutboxMessage
from reliable_messaging.tasks import relay_outbox

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)


def test_task_sends_pending_rows_and_returns_the_counts(ob: OutboxEnv) -> None:
    ob.set(REQUIRE_ROUTE=["nowhere.#"])  # a command: unroutable, it is retried (not unrouted)
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        ids = {publish("ok.x", {"n": n}) for n in range(20)}
        lost = publish("nowhere.x", {"n": "lost"})

    result = relay_outbox.apply().get(timeout=120)
    assert result == {"sent": 20, "nacked": 0, "unroutable": 1, "pending": 1, "failed": 0}
    assert relay_outbox.name == "reliable_messaging.relay_outbox"
    assert OutboxMessage.objects.get(message_id=lost).last_error.startswith("unroutable")
    delivered = ob.broker.drain(queue, expected=20)
    assert Counter(m.message_id for m in delivered) == dict.fromkeys(ids, 1)

    # Nothing due (the failed row waits out its backoff): a second run sends nothing and
    # reports what is left.
    OutboxMessage.objects.filter(message_id=lost).update(
        next_attempt_at=timezone.now() + dt.timedelta(hours=1)
    )
    assert relay_outbox.apply(kwargs={"max_seconds": 30}).get(timeout=120) == {
        "sent": 0,
        "nacked": 0,
        "unroutable": 0,
        "pending": 1,
        "failed": 0,
    }


def test_two_task_runs_at_once_send_each_row_once(ob: OutboxEnv) -> None:
    queue = ob.queue()
    with transaction.atomic():
        ids = {publish("bulk.x", {"n": n}) for n in range(1000)}
    barrier = threading.Barrier(2)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(30)
            results.append(relay_outbox.apply(kwargs={"batch_size": 20}).get(timeout=120))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert sum(r["sent"] for r in results) == 1000
    assert OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 1000
    delivered = ob.broker.drain(queue, expected=1000)
    assert Counter(m.message_id for m in delivered) == dict.fromkeys(ids, 1)


def test_runs_in_one_worker_process_declare_the_consumers_topology_once(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run publishes on a connection of its own; the consumers' queues are declared, on
    one more connection, once per worker process rather than every run (every 5 s with the
    example schedule), and again after a run that could not reach the broker."""
    declaring_connections: list[tuple[Any, ...]] = []
    connect = declaring.connect

    def counted(*args: Any, **kwargs: Any) -> Any:
        declaring_connections.append(args)
        return connect(*args, **kwargs)

    monkeypatch.setattr(declaring, "connect", counted)
    queue = ob.queue(bindings=["once.#"])

    def run_sending_one() -> str:
        with transaction.atomic():
            message_id = publish("once.x", {})
        assert relay_outbox.apply(kwargs={"max_seconds": 30}).get(timeout=120)["sent"] == 1
        return message_id

    sent = [run_sending_one() for _ in range(5)]
    assert len(declaring_connections) == 1

    # A run that cannot reach the broker (restarted, or failed over to another node): the
    # next run declares again, once.
    reachable = messaging_settings.broker_url
    ob.set(BROKER_URL="amqp://guest:guest@127.0.0.1:1/%2F")
    assert relay_outbox.apply(kwargs={"max_seconds": 1}).get(timeout=120)["sent"] == 0
    ob.set(BROKER_URL=reachable)
    sent += [run_sending_one() for _ in range(3)]
    assert len(declaring_connections) == 2

    delivered = ob.broker.drain(queue, expected=len(sent))
    assert Counter(m.message_id for m in delivered) == dict.fromkeys(sent, 1)
