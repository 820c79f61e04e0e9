"""The inbox when things happen at the same time, against the real PostgreSQL: a connection lost
inside a handler, batches that share duplicates, a replay racing another copy of its message.

:func:`process_batch` is driven directly (what a worker hands it), from several threads where
the race needs several transactions; each thread has its own database connection.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.utils import timezone

from reliable_messaging.broker.topology import consumer_queues
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.advisory_locks import CLAIM_LOCK_CLASS
from reliable_messaging.core.envelope import (
    ORDERING_KEY_HEADER,
    Delivery,
    Message,
    encode_payload,
)
from reliable_messaging.core.outcomes import Acknowledge, Outcome, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.dead_letters.replay import STALE_REPLAY_AFTER, discard, replay
from reliable_messaging.exceptions import DatabaseUnavailable, PermanentError
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.storage import inbox as inbox_claim
from tests.markers import postgresql_only
from tests.support import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def spec_of(name: str, handler: Callable[[Message], None], **kwargs: Any) -> ConsumerSpec:
    return ConsumerSpec(name=name, queue=f"{name}.q", handler=handler, **kwargs)


def delivery_for(
    spec: ConsumerSpec,
    message_id: str,
    payload: Any = None,
    headers: dict[str, Any] | None = None,
) -> Delivery:
    return Delivery(
        body=encode_payload(payload if payload is not None else {}),
        queue=consumer_queues(spec)[0],
        exchange="rmtest",
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
        headers=headers or {},
    )


def record(message: Message) -> None:
    Effect.objects.create(consumer="races", message_id=message.message_id, attempt=message.attempt)


def effects_of(message_id: str) -> int:
    return Effect.objects.filter(consumer="races", message_id=message_id).count()


# --------------------------------------------------------------------------- lost connection


def test_a_connection_lost_inside_a_handler_on_the_optimistic_path_spends_no_attempt() -> None:
    """The database going away under a handler is the infrastructure's failure, not the
    handler's: nothing is decided (the deliveries stay with the broker) and no attempt is spent,
    as on the guarded path."""
    lose_connection = True

    def handler(message: Message) -> None:
        record(message)
        if lose_connection and message.message_id.endswith("-2"):
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    processor = DeliveryProcessor(spec_of("races.lost-connection", handler))
    assert processor.guarded_batches == 0  # the batch runs optimistic (no savepoints)
    prefix = uuid.uuid4().hex[:8]
    jobs = [Job(processor, delivery_for(processor.spec, f"{prefix}-{n}")) for n in (1, 2, 3)]

    with pytest.raises(DatabaseUnavailable):
        process_batch(jobs)

    assert not ProcessedMessage.objects.filter(consumer=processor.spec.name).exists()
    assert not DeadLetter.objects.filter(consumer=processor.spec.name).exists()
    assert not Effect.objects.filter(consumer="races").exists()
    # The handler is not to blame: its consumer's next batches are not slowed down for it.
    assert processor.guarded_batches == 0

    lose_connection = False  # the database is back: the same deliveries, attempt 1 still
    assert process_batch(jobs) == [Acknowledge("processed")] * 3
    attempts = Effect.objects.filter(consumer="races").values_list("attempt", flat=True)
    assert sorted(attempts) == [1, 1, 1]


def test_a_handlers_own_database_error_on_the_optimistic_path_is_still_its_failure() -> None:
    """With the connection alive, a handler's failed statement (here its statement timeout)
    aborts the transaction without losing it: a failure of the handler, retried."""

    def handler(message: Message) -> None:
        record(message)
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '10ms'")
            cursor.execute("SELECT pg_sleep(1)")

    processor = DeliveryProcessor(spec_of("races.own-timeout", handler))
    jobs = [Job(processor, delivery_for(processor.spec, f"st-{uuid.uuid4()}"))]
    [outcome] = process_batch(jobs)
    assert isinstance(outcome, ScheduleRetry) and outcome.next_attempt == 2
    assert "canceling statement due to statement timeout" in outcome.error
    assert not Effect.objects.filter(consumer="races").exists()


# --------------------------------------------------------------------------- deadlocks


def _lock_waiting(pids: list[int]) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = "
            "'Lock'",
            [pids],
        )
        (count,) = cursor.fetchone()
    return bool(count == len(pids))


class BatchThread(threading.Thread):
    """Runs ``process_batch(jobs)`` on its own connection; keeps the outcomes or the error."""

    def __init__(self, jobs: list[Job]) -> None:
        super().__init__(daemon=True)
        self.jobs = jobs
        self.connected = threading.Event()
        self.backend_pid = 0
        self.outcomes: list[Outcome | None] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                (self.backend_pid,) = cursor.fetchone()
            self.connected.set()
            self.outcomes = process_batch(self.jobs)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        finally:
            self.connected.set()
            connections.close_all()


@pytest.fixture
def batch_threads() -> Iterator[Callable[[list[Job]], BatchThread]]:
    started: list[BatchThread] = []

    def start(jobs: list[Job]) -> BatchThread:
        thread = BatchThread(jobs)
        thread.start()
        assert thread.connected.wait(10)
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.join(30)
        assert not thread.is_alive(), "a batch thread did not finish within 30s"


def test_batches_sharing_duplicates_in_opposite_orders_do_not_deadlock(
    batch_threads: Callable[[list[Job]], BatchThread],
) -> None:
    """Two consumers receive the same three messages in opposite orders (a redelivery after a
    lost connection, a message published twice) while a third is still on the middle one. Each
    batch's inbox claim waits on that middle row with its first row inserted; when the third
    commits they both go on. Claiming in batch order, each then needs the row the other
    inserted first: PostgreSQL detects the deadlock and kills one of them. Claiming in one
    order for everyone, one waits for the other instead."""
    prefix = uuid.uuid4().hex[:8]
    first, middle, last = f"{prefix}-a", f"{prefix}-m", f"{prefix}-z"
    handler_entered, release = threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        record(message)
        if message.message_id == middle:
            handler_entered.set()
            assert release.wait(30), "the test did not release the middle message"

    spec = spec_of("races.deadlock", handler)

    def jobs(*ids: str) -> list[Job]:
        processor = DeliveryProcessor(spec)
        return [Job(processor, delivery_for(spec, message_id)) for message_id in ids]

    holder = batch_threads(jobs(middle))
    assert handler_entered.wait(10)
    forward = batch_threads(jobs(first, middle, last))
    backward = batch_threads(jobs(last, middle, first))
    try:
        wait_until(
            lambda: _lock_waiting([forward.backend_pid, backward.backend_pid]),
            timeout=10,
            message="both batches waiting on inbox rows",
        )
    finally:
        release.set()
    for thread in (holder, forward, backward):
        thread.join(30)

    assert (holder.error, forward.error, backward.error) == (None, None, None)
    assert holder.outcomes == [Acknowledge("processed")]
    assert forward.outcomes is not None and backward.outcomes is not None
    by_message: dict[str, list[Outcome | None]] = {}
    for thread in (forward, backward):
        for job, outcome in zip(thread.jobs, thread.outcomes or [], strict=True):
            by_message.setdefault(job.delivery.message_id or "", []).append(outcome)
    assert by_message[middle] == [Acknowledge("duplicate")] * 2
    for message_id in (first, last):  # processed by one batch, a duplicate for the other
        assert sorted(by_message[message_id], key=repr) == [
            Acknowledge("duplicate"),
            Acknowledge("processed"),
        ]
    for message_id in (first, middle, last):
        assert effects_of(message_id) == 1


# --------------------------------------------------------------------------- replay races


@pytest.fixture
def ordered_consumer() -> tuple[ConsumerSpec, dict[str, bool]]:
    """An ordered consumer whose handler fails for good while ``broken["on"]``."""
    broken = {"on": True}

    def handler(message: Message) -> None:
        record(message)
        if broken["on"]:
            raise PermanentError("broken until the fix is deployed")

    return spec_of("races.ordered", handler, ordered=True), broken


def ordered_delivery(spec: ConsumerSpec, message_id: str, key: str) -> Delivery:
    return delivery_for(spec, message_id, {"key": key}, {ORDERING_KEY_HEADER: key})


def replayed_copy(letter: DeadLetter) -> Delivery:
    """The delivery the relay makes of the replay's outbox row."""
    row = OutboxMessage.objects.get(message_id=letter.message_id, routing_key=letter.queue)
    return Delivery(
        body=row.body.encode(),
        queue=row.routing_key,
        exchange="",
        routing_key=row.routing_key,
        message_id=row.message_id,
        content_type="application/json",
        headers=dict(row.headers),
    )


def test_a_replay_overtaken_by_another_copy_resolves_its_dead_letter_and_frees_the_key(
    ordered_consumer: tuple[ConsumerSpec, dict[str, bool]],
) -> None:
    spec, broken = ordered_consumer
    processor = DeliveryProcessor(spec)
    key, message_id = f"key-{uuid.uuid4()}", f"m-{uuid.uuid4()}"
    outcome = processor.process(ordered_delivery(spec, message_id, key))
    assert outcome == Acknowledge("dead_lettered", DeadLetterReason.PERMANENT)
    letter = DeadLetter.objects.get(consumer=spec.name, message_id=message_id)

    broken["on"] = False  # the fix is deployed; the operator replays the dead letter
    assert replay(DeadLetter.objects.filter(pk=letter.pk), replayed_by="test").replayed == [
        letter.pk
    ]
    # Before the replayed copy arrives, another copy of the message (published twice) does.
    outcome = processor.process(ordered_delivery(spec, message_id, key))
    assert outcome == Acknowledge("processed")
    outcome = processor.process(replayed_copy(letter))
    assert outcome == Acknowledge("duplicate")

    letter.refresh_from_db()
    assert letter.status == DeadLetterStatus.RESOLVED
    assert letter.history[-1]["event"] == "resolved"
    # The key is not parked behind it: its next message runs.
    later = f"m-{uuid.uuid4()}"
    assert processor.process(ordered_delivery(spec, later, key)) == Acknowledge("processed")
    assert effects_of(message_id) == 1 and effects_of(later) == 1


def test_a_replayed_dead_letter_whose_outcome_never_came_can_be_replayed_or_discarded(
    ordered_consumer: tuple[ConsumerSpec, dict[str, bool]],
) -> None:
    """A replayed copy lost on the way leaves its dead letter "replayed" (parking its key):
    once that has lasted STALE_REPLAY_AFTER it can be replayed again or discarded."""
    spec, _ = ordered_consumer
    processor = DeliveryProcessor(spec)
    key = f"key-{uuid.uuid4()}"
    ids = [f"m-{uuid.uuid4()}" for _ in range(2)]
    for message_id in ids:
        processor.process(ordered_delivery(spec, message_id, key))
    letters = DeadLetter.objects.filter(consumer=spec.name, message_id__in=ids)
    assert replay(letters, replayed_by="test").replayed == sorted(
        letters.values_list("pk", flat=True)
    )

    # Awaiting their outcome: neither replayed again nor discarded.
    again = replay(letters, replayed_by="test")
    assert again.replayed == [] and all("awaiting" in why for why in again.refused.values())
    assert discard(letters, discarded_by="test") == []

    # The outcome never came.
    letters.update(updated_at=timezone.now() - STALE_REPLAY_AFTER - dt.timedelta(minutes=1))
    stale_replay, stale_discard = list(letters.order_by("pk"))
    assert replay(DeadLetter.objects.filter(pk=stale_replay.pk), replayed_by="test").replayed == [
        stale_replay.pk
    ]
    assert discard(DeadLetter.objects.filter(pk=stale_discard.pk), discarded_by="test") == [
        stale_discard.pk
    ]

    stale_replay.refresh_from_db()
    stale_discard.refresh_from_db()
    assert (stale_replay.status, stale_replay.replay_count) == (DeadLetterStatus.REPLAYED, 2)
    assert stale_discard.status == DeadLetterStatus.DISCARDED
    # The new replay is on its way, next to the one presumed lost.
    assert OutboxMessage.objects.filter(message_id=stale_replay.message_id).count() == 2


# --------------------------------------------------------------------------- rows held elsewhere


@postgresql_only
def test_a_redelivered_batch_puts_held_rows_aside_without_waiting_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer cut off mid-batch holds its inbox rows until the server ends its transaction;
    the copies the broker gives to another consumer meanwhile are found busy with a lock
    attempt that never waits, and the rest of their batch is handled at once. (A probe that
    waits, however briefly, for each held row stalls the other consumer: its copies keep coming
    back while the holder lives.) A long probe makes any wait plain to see in pg_locks."""
    monkeypatch.setattr(inbox_claim, "ROW_LOCK_PROBE", 3.0)
    spec = spec_of("races.held", record)
    held_id, free_id = f"held-{uuid.uuid4()}", f"free-{uuid.uuid4()}"
    holder = psycopg.connect(_dsn(), autocommit=False)
    waits: list[int] = []
    done = threading.Event()
    watching = threading.Event()  # set once the watcher took its first sample
    try:
        with holder.cursor() as cursor:  # the cut-off consumer's claim, never committed
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)",
                [CLAIM_LOCK_CLASS, inbox_claim._key_hash(spec.name, held_id)],
            )

        def watch() -> None:
            with psycopg.connect(_dsn(), autocommit=True) as watcher:
                while not done.is_set():
                    row = watcher.execute(
                        # This database's only: pg_locks shows the whole server's, and the
                        # suite's other workers claim inbox rows in databases of their own.
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND NOT granted AND classid = %s AND database = "
                        "(SELECT oid FROM pg_database WHERE datname = current_database())",
                        [CLAIM_LOCK_CLASS],
                    ).fetchone()
                    waits.append(row[0] if row else 0)
                    watching.set()
                    done.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # The batch takes milliseconds: it must not be over before the watcher looks.
        assert watching.wait(10), "the pg_locks watcher did not start"
        processor = DeliveryProcessor(spec)
        jobs = [
            Job(processor, dataclasses.replace(delivery_for(spec, m), redelivered=True))
            for m in (held_id, free_id)
        ]
        outcomes = process_batch(jobs)
        done.set()
        watcher.join(10)
    finally:
        done.set()
        holder.rollback()
        holder.close()

    assert isinstance(outcomes[0], ScheduleRetry) and outcomes[0].deferred
    assert outcomes[0].next_attempt == 1  # put aside, not charged
    assert outcomes[1] == Acknowledge("processed")
    assert (effects_of(held_id), effects_of(free_id)) == (0, 1)
    assert waits and max(waits) == 0, "the claim waited for the row another transaction holds"


def _dsn() -> str:
    params = connection.get_connection_params()
    return psycopg.conninfo.make_conninfo(
        **{k: v for k, v in params.items() if k in ("dbname", "user", "host", "port", "password")}
    )
