"""``@idempotent_task``: a Celery task takes effect once per idempotency key.

Run through Celery's own API: eagerly (``apply()``, which goes through the same tracer as a
worker), and through a real ``celery worker`` subprocess with RabbitMQ as the broker. What is
asserted is what a user cares about: the effect rows and the inbox rows in the database.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import shared_task
from django.db import connection, connections
from prometheus_client import REGISTRY

from reliable_messaging import idempotent_task as exported
from reliable_messaging.contrib.celery import HASHED_KEY_PREFIX, idempotent_task, inbox_key
from reliable_messaging.exceptions import DatabaseUnavailable
from reliable_messaging.models import ProcessedMessage
from tests.support import wait_until
from tests.testapp import consumers
from tests.testapp.models import Effect

from .tasks import charge, email_receipt, long_key, reserve_stock, restock
from .worker import CeleryWorker

pytestmark = pytest.mark.django_db(transaction=True)

RECEIPTS = "tests.celery_tasks.email_receipt"
RESTOCK = "tests.celery_tasks.restock"


def effects(label: str, about: str | None = None) -> int:
    rows = Effect.objects.filter(consumer=label)
    return (rows if about is None else rows.filter(message_id=about)).count()


def inbox(scope: str) -> list[str]:
    return sorted(
        ProcessedMessage.objects.filter(consumer=scope).values_list("message_id", flat=True)
    )


def counted(scope: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "reliable_messaging_consumer_messages_total", {"consumer": scope, "outcome": outcome}
    )
    return value or 0.0


# --------------------------------------------------------------------------- eager (apply)


def test_two_calls_with_one_key_take_effect_once() -> None:
    processed_before = counted(RECEIPTS, "processed")
    duplicates_before = counted(RECEIPTS, "duplicate")
    first = email_receipt.apply(args=[41])
    second = email_receipt.apply(args=[41])
    other = email_receipt.apply(args=[42])

    assert first.successful() and second.successful() and other.successful()
    assert first.result == Effect.objects.get(message_id="41").pk  # the body's return value
    assert second.result is None  # a skipped duplicate
    assert effects("receipt", "41") == 1 and effects("receipt", "42") == 1
    assert inbox(RECEIPTS) == ["receipt:41", "receipt:42"]
    assert counted(RECEIPTS, "processed") == processed_before + 2
    assert counted(RECEIPTS, "duplicate") == duplicates_before + 1


def test_without_a_key_the_celery_task_id_is_the_key() -> None:
    task_id = str(uuid.uuid4())
    restock.apply(args=["sku-1"], task_id=task_id)
    assert restock.apply(args=["sku-1"], task_id=task_id).result is None  # the same message
    restock.apply(args=["sku-1"])  # a new task message: a new id, so it takes effect again
    assert effects("restock", "sku-1") == 2
    assert task_id in inbox(RESTOCK) and len(inbox(RESTOCK)) == 2


def test_a_failing_body_rolls_back_its_effect_and_the_key_so_a_retry_succeeds() -> None:
    failed = email_receipt.apply(args=[7], kwargs={"fail": True})
    assert failed.failed() and isinstance(failed.result, RuntimeError)
    assert effects("receipt", "7") == 0 and inbox(RECEIPTS) == []

    retried = email_receipt.apply(args=[7])
    assert retried.successful() and retried.result is not None
    assert effects("receipt", "7") == 1 and inbox(RECEIPTS) == ["receipt:7"]


def test_celery_autoretry_runs_the_body_again_and_it_takes_effect_once() -> None:
    # charge is bound (bind=True) and fails its first attempt after writing its effect;
    # autoretry_for retries it under the same task id. The key function gets no ``self``.
    result = charge.apply(args=[9])
    assert result.successful(), result.traceback
    assert list(Effect.objects.filter(consumer="charge").values_list("attempt", flat=True)) == [2]
    assert inbox("tests.charges") == ["charge:9"]  # the scope given to the decorator


def test_concurrent_duplicates_take_effect_once() -> None:
    barrier = threading.Barrier(2)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(10)
            # The body holds its transaction open for a moment: the twin's inbox insert waits
            # on the unique index meanwhile, then fails when the first one commits.
            results.append(email_receipt.apply(args=[5], kwargs={"sleep": 0.5}).get())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(results) == 2 and results.count(None) == 1  # one ran, one was skipped
    assert effects("receipt", "5") == 1 and inbox(RECEIPTS) == ["receipt:5"]


def test_keys_too_long_for_the_inbox_column_are_stored_hashed() -> None:
    text = "x" * 300
    assert long_key.apply(args=[text]).result is not None
    assert long_key.apply(args=[text]).result is None
    assert long_key.apply(args=[text + "y"]).result is not None  # a different key
    stored = inbox("tests.celery_tasks.long_key")
    assert len(stored) == 2 and all(k.startswith(HASHED_KEY_PREFIX) for k in stored)
    assert all(len(k) <= 255 for k in stored)


def test_inbox_key() -> None:
    assert inbox_key("receipt:1") == "receipt:1"
    assert inbox_key(42) == "42"
    assert inbox_key("k" * 255) == "k" * 255
    hashed = inbox_key("k" * 256)
    assert hashed.startswith(HASHED_KEY_PREFIX) and len(hashed) == 71
    assert inbox_key("a\x00b").startswith(HASHED_KEY_PREFIX)  # PostgreSQL text cannot hold NUL
    assert inbox_key("\ud800").startswith(HASHED_KEY_PREFIX)  # nor a lone surrogate
    with pytest.raises(ValueError, match="empty"):
        inbox_key("")
    with pytest.raises(ValueError, match="empty"):
        inbox_key(None)


def test_a_direct_call_needs_a_key_function() -> None:
    # Called like a function, a task has no task id; with a key function it still dedups.
    assert email_receipt(11) is not None and email_receipt(11) is None
    assert effects("receipt", "11") == 1
    with pytest.raises(RuntimeError, match="no Celery task id"):
        restock("sku-2")
    assert effects("restock") == 0


def upside_down() -> None:
    """A task body with the decorators in the wrong order."""


def test_misuse_is_refused_with_a_clear_error() -> None:
    task = shared_task(name="tests.celery_tasks.upside_down")(upside_down)
    with pytest.raises(TypeError, match="below"):
        idempotent_task(task)
    with pytest.raises(ValueError, match="scope"):
        idempotent_task(scope="")
    assert exported is idempotent_task  # from reliable_messaging import idempotent_task


# --------------------------------------------------------------------------- a real worker


@pytest.fixture
def worker(ns: str, tmp_path: Path) -> Iterator[CeleryWorker]:
    # The queue name carries the namespace: the ns fixture deletes it and its exchange.
    running = CeleryWorker(f"rmtest.{ns}.celery", tmp_path / "celery-worker.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.mark.slow
def test_through_a_real_worker_each_key_takes_effect_once(worker: CeleryWorker) -> None:
    from .celery_app import app

    redelivered_id = str(uuid.uuid4())
    sent = [
        app.send_task(RECEIPTS, args=[31], queue=worker.queue),
        app.send_task(RECEIPTS, args=[31], queue=worker.queue),  # a second call, new task id
        app.send_task(RESTOCK, args=["sku-9"], task_id=redelivered_id, queue=worker.queue),
        app.send_task(RESTOCK, args=["sku-9"], task_id=redelivered_id, queue=worker.queue),
    ]
    assert len(sent) == 4

    def skipped() -> set[str]:
        return set(re.findall(r"duplicate message_id=\S+ task=\S+ task_id=(\S+):", worker.log()))

    wait_until(
        lambda: len(skipped()) == 2 and inbox(RECEIPTS) and inbox(RESTOCK),
        timeout=60,
        message=lambda: f"both duplicates skipped by the worker; log:\n{worker.log()}",
    )
    assert effects("receipt", "31") == 1 and effects("restock", "sku-9") == 1
    assert inbox(RECEIPTS) == ["receipt:31"] and inbox(RESTOCK) == [redelivered_id]
    assert redelivered_id in skipped()
    assert "Traceback" not in worker.log()


def test_a_serialization_failure_runs_the_body_again_in_a_new_transaction() -> None:
    """The database asked for a retry: not the task's failure, no Celery retry spent."""
    consumers.CONFLICT_RUNS.clear()
    result = reserve_stock.apply(args=[31], kwargs={"conflicts": 2})
    assert result.successful(), result.traceback
    assert consumers.CONFLICT_RUNS[("reserve", "31")] == 3
    assert list(Effect.objects.filter(consumer="reserve").values_list("message_id", flat=True)) == [
        "31"
    ]


def test_a_read_only_database_is_not_the_task_failing() -> None:
    """A failover (SQLSTATE 25006) raises DatabaseUnavailable eagerly (a worker gives the
    message back instead), not the driver's InternalError as if the body had failed."""
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_read_only = on")
    try:
        result = reserve_stock.apply(args=[32])
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_read_only")
    assert isinstance(result.result, DatabaseUnavailable), result.traceback
    assert not Effect.objects.filter(consumer="reserve").exists()
