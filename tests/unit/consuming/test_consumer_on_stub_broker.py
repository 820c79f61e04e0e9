"""The real ConsumerService over the in-memory broker twin (reliable_messaging.testing_broker):
batching, ack coalescing, held partitions and a channel closed mid-batch, without RabbitMQ.

The database is real (the inbox, the crash guard and the handlers' effects); what the consumer
did on the broker is read from the twin's log, never from the service's private objects.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection as db_connection
from django.db import transaction
from django.test import override_settings

from reliable_messaging import Breaker, Message
from reliable_messaging.consuming.service import ConsumerService
from reliable_messaging.core.envelope import ORDERING_KEY_HEADER, Delivery
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.outcomes import Acknowledge, Outcome
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import build_relay
from reliable_messaging.testing_broker import StubConnectionLost, StubPublisher, StubTransport
from tests.support import wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


class Outcomes:
    """The service's ``on_outcome`` callback."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, Outcome]] = []

    def __call__(self, spec: ConsumerSpec, delivery: Delivery, outcome: Outcome) -> None:
        with self.lock:
            self.seen.append((str(delivery.message_id), outcome))

    def processed(self) -> list[str]:
        with self.lock:
            return [m for m, o in self.seen if o == Acknowledge("processed")]

    def of(self, message_id: str) -> list[Outcome]:
        with self.lock:
            return [o for m, o in self.seen if m == message_id]


@pytest.fixture
def broker() -> StubTransport:
    return StubTransport()


@pytest.fixture
def outcomes() -> Outcomes:
    return Outcomes()


@pytest.fixture
def run_service(
    broker: StubTransport, outcomes: Outcomes, transactional_db: None
) -> Iterator[Callable[..., ConsumerService]]:
    """``run_service(specs, **kwargs)``: a ConsumerService on the twin, in a thread, connected,
    with a relay over a twin publisher that puts the retry copies it sends back on the twin's
    queues (as ``consume`` runs one beside its handlers); stopped and joined in teardown."""
    running: list[tuple[ConsumerService, threading.Thread]] = []
    relay = build_relay(transport=StubPublisher(delivers_to=broker), listen=False)
    relay_thread = threading.Thread(target=relay.run, name="rm-stub-relay", daemon=True)
    relay_thread.start()

    def start(specs: list[ConsumerSpec], **kwargs: Any) -> ConsumerService:
        service = ConsumerService(specs, transport=broker, on_outcome=outcomes, **kwargs)
        thread = threading.Thread(target=service.run, name="rm-stub-service", daemon=True)
        thread.start()
        running.append((service, thread))
        assert service.connected.wait(10), "the service did not connect to the twin"
        return service

    yield start
    for service, _ in running:
        service.request_stop()
    relay.request_stop()
    for service, thread in running:
        thread.join(30)
        assert not thread.is_alive(), "the service did not stop within 30s"
    relay_thread.join(30)
    assert not relay_thread.is_alive(), "the relay did not stop within 30s"


def spec(handler: Callable[[Message], None], **kwargs: Any) -> ConsumerSpec:
    name = f"stub.{uuid.uuid4().hex[:8]}"
    return ConsumerSpec(name=name, queue=name, handler=handler, bindings=("order.*",), **kwargs)


def body(**payload: Any) -> bytes:
    return json.dumps(payload).encode()


def publish(broker: StubTransport, queue: str, data: bytes, **kwargs: Any) -> None:
    """Publish as if routed by the consumers' binding ``order.*``."""
    broker.publish(queue, data, routing_key="order.placed", **kwargs)


def record(message: Message, **extra: Any) -> None:
    Effect.objects.create(
        consumer="stub", message_id=message.message_id, attempt=message.attempt, payload=extra
    )


def effects() -> list[tuple[str, int]]:
    return list(Effect.objects.order_by("id").values_list("message_id", "attempt"))


def test_waiting_deliveries_run_in_one_transaction_and_are_acked_by_one_multiple_ack_after_it(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    gate = threading.Event()
    commits: dict[str, float] = {}

    def handler(message: Message) -> None:
        if message.message_id == "warm":
            assert gate.wait(10)
        with db_connection.cursor() as cursor:
            cursor.execute("SELECT txid_current()")
            (txid,) = cursor.fetchone()
        record(message, txid=txid)
        mid = message.message_id
        transaction.on_commit(lambda: commits.setdefault(mid, time.monotonic()))

    consumer = spec(handler)
    run_service([consumer])
    publish(broker, consumer.queue, body(n=0), message_id="warm")
    ids = [f"m-{i}" for i in range(10)]
    # The warm-up holds the only worker while the ten arrive, so they wait on the board together.
    wait_until(lambda: broker.unacked() == 1, timeout=10, message="the warm-up delivered")
    for i, message_id in enumerate(ids):
        publish(broker, consumer.queue, body(n=i), message_id=message_id)
    wait_until(lambda: broker.unacked() == 11, timeout=10, message="all eleven delivered")
    gate.set()
    wait_until(lambda: len(outcomes.processed()) == 11, timeout=15, message="eleven processed")
    wait_until(lambda: broker.unacked() == 0, timeout=10, message="everything acked")

    # One transaction for the ten: their effects share PostgreSQL's transaction id.
    rows = Effect.objects.values_list("message_id", "payload")
    txids = {message_id: (payload or {})["txid"] for message_id, payload in rows}
    assert len({txids[m] for m in ids}) == 1
    assert txids["warm"] != txids[ids[0]]
    # Their acks: one multiple ack that covers exactly the ten, sent after their commit.
    acks = broker.events("ack")
    (batch_ack,) = [a for a in acks if set(a.message_ids) & set(ids)]
    assert batch_ack.multiple and sorted(batch_ack.message_ids) == sorted(ids)
    assert batch_ack.at >= max(commits[m] for m in ids)
    assert broker.events("nack") == [] and broker.events("channel_closed") == []
    assert broker.ready(consumer.queue) == 0


def test_an_ack_never_covers_a_delivery_still_being_handled(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    slow_started, slow_gate = threading.Event(), threading.Event()
    commits: dict[str, float] = {}

    def handler(message: Message) -> None:
        if message.message_id == "slow":
            slow_started.set()
            assert slow_gate.wait(10)
        record(message)
        mid = message.message_id
        transaction.on_commit(lambda: commits.setdefault(mid, time.monotonic()))

    consumer = spec(handler)
    # Two workers: "slow" holds one while the other handles the deliveries behind it.
    run_service([consumer], concurrency=2)
    publish(broker, consumer.queue, body(), message_id="first")
    wait_until(lambda: outcomes.processed() == ["first"], timeout=10, message="first processed")
    publish(broker, consumer.queue, body(), message_id="slow")
    assert slow_started.wait(10), "slow never reached its handler"
    after = [f"after-{i}" for i in range(3)]
    for message_id in after:
        publish(broker, consumer.queue, body(), message_id=message_id)
    wait_until(lambda: len(outcomes.processed()) == 4, timeout=10, message="the three processed")
    assert broker.unacked() == 1  # only slow
    slow_gate.set()
    wait_until(lambda: broker.unacked() == 0, timeout=10, message="everything acked")

    # Each message acked once; the three behind "slow" one by one (a multiple ack would have
    # covered slow, still running); slow's own ack after its commit.
    acks = broker.events("ack")
    assert sorted(m for a in acks for m in a.message_ids) == sorted(["first", "slow", *after])
    assert all(not a.multiple for a in acks if set(a.message_ids) & set(after))
    (slow_ack,) = [a for a in acks if "slow" in a.message_ids]
    assert slow_ack.message_ids == ("slow",)
    assert slow_ack.at >= commits["slow"]
    assert broker.events("channel_closed") == []  # no unknown delivery tag


def test_a_retrying_key_holds_only_its_own_partition(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    fixed = threading.Event()
    failures: list[int] = []  # a-0's failed attempts (their effects roll back)

    def handler(message: Message) -> None:
        record(message)
        if message.message_id == "a-0" and not fixed.is_set():
            failures.append(message.attempt)
            raise RuntimeError("a-0 fails until fixed")

    fast = {"ORDERED_PARTITIONS": 2, "RETRY_DELAYS": [0.1], "MAX_ATTEMPTS": 1000}
    from django.conf import settings

    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, **fast}):
        consumer = spec(handler, ordered=True)
        p0, p1 = f"{consumer.queue}.p0", f"{consumer.queue}.p1"
        # One worker for both partitions: the held one must not stop it.
        run_service([consumer], concurrency=1)

        def send(queue: str, message_id: str, key: str) -> None:
            publish(
                broker, queue, body(), message_id=message_id, headers={ORDERING_KEY_HEADER: key}
            )

        send(p0, "a-0", "a")
        send(p0, "a-1", "a")
        others = [f"b-{i}" for i in range(4)]
        for message_id in others:
            send(p1, message_id, "b")

        wait_until(
            lambda: set(others) <= set(outcomes.processed()) and len(failures) >= 2,
            timeout=15,
            message=lambda: f"the other partition flowed; outcomes: {outcomes.seen}",
        )
        # a-0 retries in place: not acked, no retry copy, not requeued; a-1 waits behind it.
        assert "a-1" not in [m for m, _ in effects()]
        assert not [e for e in broker.events() if "a-0" in e.message_ids or "a-1" in e.message_ids]
        assert not OutboxMessage.objects.exists()

        fixed.set()
        wait_until(
            lambda: {"a-0", "a-1"} <= set(outcomes.processed()),
            timeout=15,
            message=lambda: f"a-0 and a-1 processed; outcomes: {outcomes.seen}",
        )
        wait_until(lambda: broker.unacked() == 0, timeout=10, message="everything acked")

    order = [m for m, _ in effects() if m.startswith("a-")]
    assert order.index("a-1") > max(i for i, m in enumerate(order) if m == "a-0")
    assert [m for m, _ in effects()].count("a-1") == 1
    assert broker.events("nack") == [] and broker.events("channel_closed") == []


def test_a_stopping_process_gives_an_ordered_partition_back_by_dropping_it_never_by_a_nack(
    broker: StubTransport, run_service: Callable[..., ConsumerService]
) -> None:
    """The stop lands while a worker holds a partition: the worker gives its deliveries back at
    once, before the connection's thread has noticed the stop. None of them is nacked: while
    this process is still the partition's active consumer, a quorum queue hands a nacked
    message straight back to it, behind a later one delivered meanwhile, and the dropped
    connection then returns them to the standby in that order. They go back with the
    connection, in the order they came."""
    services: list[ConsumerService] = []
    ids = [f"a-{i}" for i in range(5)]
    stopped = threading.Event()

    def handler(message: Message) -> None:
        if message.message_id == ids[0]:
            services[0].request_stop()  # SIGTERM landing mid-handler
            stopped.set()
            raise RuntimeError("fails: its partition waits for the retry in place")
        record(message)

    fast = {"ORDERED_PARTITIONS": 1, "RETRY_DELAYS": [30.0], "MAX_ATTEMPTS": 5}
    from django.conf import settings

    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, **fast}):
        consumer = spec(handler, ordered=True)
        p0 = f"{consumer.queue}.p0"
        services.append(run_service([consumer], concurrency=1))
        for message_id in ids:
            publish(broker, p0, body(), message_id=message_id, headers={ORDERING_KEY_HEADER: "a"})
        assert stopped.wait(15), "the first delivery never reached its handler"
        wait_until(
            lambda: (
                not services[0].connected.is_set()
                and broker.ready(p0) == len(ids)
                and broker.unacked() == 0
            ),
            timeout=15,
            message=lambda: f"the stopped service gave back {ids}; log: {broker.events()}",
        )
    assert broker.events("nack") == [], "a stopping process nacked an ordered partition's delivery"
    assert [m.properties.message_id for m in broker.queues[p0]] == ids
    assert effects() == []


def test_a_channel_the_broker_closes_mid_batch_loses_nothing_and_doubles_nothing(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    gate = threading.Event()
    started = threading.Event()

    def handler(message: Message) -> None:
        if message.message_id == "m-0" and not message.redelivered:
            started.set()
            assert gate.wait(10)
        record(message)

    consumer = spec(handler)
    service = run_service([consumer])
    ids = [f"m-{i}" for i in range(5)]
    for message_id in ids:
        publish(broker, consumer.queue, body(), message_id=message_id)
    assert started.wait(10), "m-0 never reached its handler"
    wait_until(lambda: broker.unacked() == 5, timeout=10, message="all five delivered")

    closed = broker.close_channel(consumer.queue)
    gate.set()  # the batch in flight commits after its channel is gone

    wait_until(
        lambda: (
            broker.ready(consumer.queue) == 0
            and broker.unacked() == 0
            and len(broker.connections) >= 2
            and service.connected.is_set()
        ),
        timeout=20,
        message=lambda: f"reconnected and drained; outcomes: {outcomes.seen}",
    )
    # Every message's effect exactly once (m-0's commit survived; its redelivery is a duplicate).
    assert sorted(m for m, _ in effects()) == ids
    assert outcomes.of("m-0")[-1] == Acknowledge("duplicate")
    # Nothing was settled on the closed channel, and everything was acked on the new connection.
    (close,) = broker.events("channel_closed")
    assert (close.connection, close.channel) == (1, closed)
    assert not [e for e in broker.events("ack") if e.connection == 1 and e.at > close.at]
    acked = [m for a in broker.events("ack") if a.at > close.at for m in a.message_ids]
    assert sorted(acked) == ids
    assert broker.events("nack") == []


def test_a_failed_delivery_is_acked_only_once_its_retry_copy_waits_in_the_outbox(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    def handler(message: Message) -> None:
        record(message)
        if message.attempt == 1:
            raise RuntimeError("transient")

    from django.conf import settings

    with override_settings(
        RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "RETRY_DELAYS": [0.2]}
    ):
        consumer = spec(handler)
        run_service([consumer])
        publish(broker, consumer.queue, body(), message_id="r-1", headers={"x-tenant": b"\x00\xff"})
        wait_until(lambda: outcomes.processed() == ["r-1"], timeout=20, message="r-1 processed")
        wait_until(lambda: broker.unacked() == 0, timeout=10, message="everything acked")

    # The copy was a row for the consumer's queue alone, sent by the relay once due; the
    # original's ack followed its commit, the copy's ack its processing.
    (row,) = OutboxMessage.objects.filter(message_id="r-1")
    assert (row.exchange, row.routing_key, row.status) == ("", consumer.queue, "sent")
    assert bytes(row.raw_body) == body()
    acks = [e for e in broker.events() if "r-1" in e.message_ids]
    assert [e.kind for e in acks] == ["ack", "ack"]
    assert effects() == [("r-1", 2)]  # the first attempt's effect rolled back
    assert broker.events("nack") == [] and broker.events("channel_closed") == []


def test_an_ordered_consumer_with_an_open_breaker_keeps_its_partition_in_hand(
    broker: StubTransport, run_service: Callable[..., ConsumerService], outcomes: Outcomes
) -> None:
    """Circuit breaker on an ordered consumer: the head of a key failing in place opens it.
    Nothing is given back (a nack, or a cancel handing the partition to a standby, would let
    the messages behind the head go first): the partition waits in the process, unstarted,
    and the head runs again only as a probe, once per opening, its attempts counted. Once the
    downstream is back, every message is handled once, in order."""
    down = threading.Event()
    down.set()
    failures: list[tuple[str, int]] = []

    def handler(message: Message) -> None:
        if down.is_set():
            failures.append((message.message_id, message.attempt))
            raise RuntimeError("the provider is down")
        record(message)

    fast = {"ORDERED_PARTITIONS": 1, "RETRY_DELAYS": [0.05], "MAX_ATTEMPTS": 1000}
    from django.conf import settings

    config = Breaker(failure_rate=0.5, window=10, min_failures=3, pause=0.2, probes=1)
    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, **fast}):
        consumer = spec(handler, ordered=True, breaker=config)
        service = run_service([consumer], concurrency=1)
        ids = [f"a-{i}" for i in range(6)]
        p0 = f"{consumer.queue}.p0"
        for message_id in ids:
            publish(broker, p0, body(), message_id=message_id, headers={ORDERING_KEY_HEADER: "a"})
        breaker = service.breakers.get(consumer.name)
        assert breaker is not None
        wait_until(lambda: breaker.opened >= 4, timeout=20, message="the breaker reopening")
        # The partition stays in hand, unacked: nothing went back to the queue.
        assert broker.ready(p0) == 0 and broker.unacked() == len(ids)
        opened = breaker.opened
        assert {message_id for message_id, _ in failures} == {"a-0"}
        # Three failures opened it; then one probe per opening (the pause doubling).
        assert len(failures) <= 3 + opened
        assert [attempt for _, attempt in failures] == list(range(1, len(failures) + 1))

        down.clear()
        wait_until(
            lambda: set(ids) <= set(outcomes.processed()),
            timeout=30,
            message=lambda: f"every message processed; outcomes: {outcomes.seen}",
        )
        wait_until(lambda: broker.unacked() == 0, timeout=10, message="everything acked")
    assert [m for m, _ in effects()] == ids  # each once, in order
    assert not OutboxMessage.objects.exists() and broker.events("nack") == []


def test_a_stop_while_the_breaker_is_open_is_graceful(
    broker: StubTransport, run_service: Callable[..., ConsumerService]
) -> None:
    def handler(message: Message) -> None:
        raise RuntimeError("the provider is down")

    fast = {"RETRY_DELAYS": [30.0], "MAX_ATTEMPTS": 1000}
    from django.conf import settings

    config = Breaker(failure_rate=0.5, window=10, min_failures=2, pause=60, probes=1)
    with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, **fast}):
        consumer = spec(handler, breaker=config)
        service = run_service([consumer], concurrency=2)
        for n in range(10):
            publish(broker, consumer.queue, body(), message_id=f"m-{n}")
        breaker = service.breakers.get(consumer.name)
        assert breaker is not None
        wait_until(lambda: breaker.opened == 1, timeout=10, message="the breaker opened")
        # The eight not started wait in the process, unacked; none was given back. The two
        # failures that opened it wait in the outbox, their originals acked.
        wait_until(lambda: broker.unacked() == 8, timeout=10, message="all kept in hand")
        assert broker.events("nack") == []
        service.request_stop()
        wait_until(lambda: not service.connected.is_set(), timeout=20, message="stopped")
    assert service.exit_code == 0
    # The eight went back at the stop, uncharged; the two retry copies wait their 30 s.
    assert broker.ready(consumer.queue) == 8
    assert OutboxMessage.objects.filter(status="scheduled").count() == 2


def test_waiting_to_reconnect_is_unhealthy_for_the_broker_alone_never_a_stuck_loop() -> None:
    """While the broker refuses every connection, ``/healthz`` says so and nothing else: the
    reconnect wait beats the heartbeat, so an outage longer than the stall limit does not read
    as a hung main loop."""

    class Refusing(StubTransport):
        def connect(self, settings: Any, name: str) -> Any:
            raise StubConnectionLost("connection refused")

    # Five of the wait's beats (0.2 s apart): a process starved by a loaded machine still
    # beats in time, and the reconnect waits within the 3 s (0.5, 1, 2 s) outlast it.
    health = HealthState(stall_after=1.0)
    service = ConsumerService([spec(lambda message: None)], transport=Refusing(), health=health)
    thread = threading.Thread(target=service.run, name="rm-stub-refused", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert health.check() == (False, ["broker not connected"])
            time.sleep(0.05)
    finally:
        service.request_stop()
        thread.join(10)
    assert not thread.is_alive()
