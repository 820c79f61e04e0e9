"""ConsumerService against the real broker and database, run in a thread of this process.

Each test has its own namespace: its own exchange (``rmtest.<ns>``) and consumer queues, all
deleted afterwards. The ``on_outcome`` callback shows what the service decided for
each delivery (and so the attempts of which the effects rolled back).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging import Message
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.consuming.service import ConsumerService
from reliable_messaging.consuming.time_limit import time_limits
from reliable_messaging.consuming.workers import EXIT_WORKERS_DYING, WORKER_DEATH_LIMIT
from reliable_messaging.core.envelope import ATTEMPT_HEADER
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.outcomes import Acknowledge, Outcome, Release, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.management.relay_beside import RelayBeside
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.testing import deliver
from tests import support
from tests.support import Publisher, queue_counts, wait_until
from tests.testapp.consumers import GATES, behave
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

MAX_BODY = 64 * 1024  # tests/settings.py


@dataclass(frozen=True)
class Seen:
    consumer: str
    delivery: Any
    outcome: Outcome


class Recorder:
    """The service's ``on_outcome`` callback, plus what the handlers were given."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Seen] = []
        self.messages: list[tuple[str, Message]] = []
        self.started = threading.Event()

    def __call__(self, spec: ConsumerSpec, delivery: Any, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(Seen(spec.name, delivery, outcome))

    def of(self, consumer: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.outcomes if s.consumer == consumer]

    def results(self, consumer: str) -> list[str]:
        out: list[str] = []
        for s in self.of(consumer):
            if isinstance(s.outcome, Acknowledge):
                out.append(s.outcome.result)
            elif isinstance(s.outcome, ScheduleRetry):
                out.append("retry")
            else:
                out.append("release")
        return out

    def wait_count(self, consumer: str, count: int, timeout: float = 20) -> list[Seen]:
        wait_until(
            lambda: len(self.of(consumer)) >= count,
            timeout=timeout,
            message=f"{count} outcome(s) for {consumer}",
        )
        return self.of(consumer)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def make_spec(ns: str, rec: Recorder) -> Callable[..., ConsumerSpec]:
    """A consumer named and queued ``<ns>.<label>`` that behaves like the testapp's."""

    def make(label: str, bindings: tuple[str, ...] = ("order.*",), **kwargs: Any) -> ConsumerSpec:
        def handler(message: Message) -> None:
            with rec.lock:
                rec.messages.append((label, message))
            rec.started.set()
            behave(label, message)

        return ConsumerSpec(
            name=f"{ns}.{label}",
            queue=f"{ns}.{label}",
            handler=handler,
            bindings=bindings,
            **kwargs,
        )

    return make


def exchange_of(ns: str) -> str:
    return f"rmtest.{ns}"


def effects(label: str) -> list[tuple[str, int]]:
    return list(
        Effect.objects.filter(consumer=label).order_by("id").values_list("message_id", "attempt")
    )


def drained(*queues: str, vhost: str = "/") -> bool:
    return support.drained(*queues, vhost=vhost)


# --------------------------------------------------------------------------- duplicates


def test_same_message_id_twice_has_one_effect_and_both_are_acked(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    for _ in range(2):
        publisher.publish(exchange_of(ns), "order.placed", {"order": 1}, message_id="dup-1")
    rec.wait_count(alpha.name, 2)
    assert rec.results(alpha.name) == ["processed", "duplicate"]
    assert effects("alpha") == [("dup-1", 1)]
    assert ProcessedMessage.objects.filter(consumer=alpha.name).count() == 1
    wait_until(lambda: drained(alpha.queue), timeout=10, message="both copies acked")


def test_redelivered_message_is_processed_once(
    ns: str, rm_settings: Any, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    conn = support.broker_connection()
    try:
        channel = conn.channel()
        declare_topology(channel, [alpha])
        publisher.publish(exchange_of(ns), "order.placed", {"order": 2}, message_id="redo-1")
        # Another consumer takes it and dies without acking: the broker redelivers it.
        wait_until(
            lambda: channel.basic_get(alpha.queue, auto_ack=False)[0],
            timeout=10,
            message="basic_get of the message",
        )
    finally:
        conn.close()
    wait_until(
        lambda: support.ready_count(alpha.queue) == 1,
        timeout=10,
        message="the unacked message back in the queue",
    )
    service([alpha], on_outcome=rec)
    (seen,) = rec.wait_count(alpha.name, 1)
    assert seen.delivery.redelivered is True
    assert seen.outcome == Acknowledge("processed")
    ((_, message),) = rec.messages
    assert message.redelivered is True and message.attempt == 1
    assert effects("alpha") == [("redo-1", 1)]
    wait_until(lambda: drained(alpha.queue), timeout=10)


def test_redelivery_after_commit_is_a_duplicate(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    # The handler committed but the ack never reached the broker (the crash window).
    assert deliver(alpha, {"order": 3}, message_id="late-1") == Acknowledge("processed")
    service([alpha], on_outcome=rec)
    publisher.publish(exchange_of(ns), "order.placed", {"order": 3}, message_id="late-1")
    (seen,) = rec.wait_count(alpha.name, 1)
    assert seen.outcome == Acknowledge("duplicate")
    assert effects("alpha") == [("late-1", 1)]
    wait_until(lambda: drained(alpha.queue), timeout=10)


def test_many_duplicates_with_concurrent_workers(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec, concurrency=4)
    ids = [f"many-{i}" for i in range(25)]
    for message_id in ids:
        for _ in range(2):
            publisher.publish(
                exchange_of(ns), "order.placed", {"sleep": {"alpha": 0.02}}, message_id=message_id
            )
    rec.wait_count(alpha.name, 50, timeout=60)
    results = rec.results(alpha.name)
    assert results.count("processed") == 25 and results.count("duplicate") == 25
    assert sorted(m for m, _ in effects("alpha")) == sorted(ids)
    wait_until(lambda: drained(alpha.queue), timeout=10)


# --------------------------------------------------------------------------- retries


def test_retry_attempts_and_delays_reach_only_the_failed_consumer(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha, beta = make_spec("alpha"), make_spec("beta")
    service([alpha, beta], on_outcome=rec)
    publisher.publish(
        exchange_of(ns),
        "order.placed",
        {"fail": {"alpha": 2}},
        message_id="retry-1",
        headers={"tenant": "acme"},
    )
    alpha_seen = rec.wait_count(alpha.name, 3)

    # Attempts 1 and 2 failed (their effects rolled back) and were scheduled with the
    # configured delays; attempt 3 succeeded.
    assert [s.delivery.headers.get(ATTEMPT_HEADER, 1) for s in alpha_seen] == [1, 2, 3]
    first, second, third = (s.outcome for s in alpha_seen)
    assert isinstance(first, ScheduleRetry) and (first.delay, first.next_attempt) == (0.2, 2)
    assert isinstance(second, ScheduleRetry) and (second.delay, second.next_attempt) == (0.4, 3)
    assert third == Acknowledge("processed")
    assert effects("alpha") == [("retry-1", 3)]

    # The copies waited in the outbox, each a row for alpha's queue alone, and came back to it
    # by the default exchange.
    for seen in alpha_seen[1:]:
        assert seen.delivery.exchange == ""
        assert seen.delivery.routing_key == alpha.queue
        assert "x-death" not in seen.delivery.headers
    copies = OutboxMessage.objects.filter(message_id="retry-1").order_by("id")
    assert [(c.exchange, c.routing_key, c.status) for c in copies] == [
        ("", alpha.queue, "sent")
    ] * 2
    # ... and the handler still saw where the message was published, and the user's headers.
    alpha_messages = [m for label, m in rec.messages if label == "alpha"]
    assert [(m.attempt, m.routing_key, m.exchange) for m in alpha_messages] == [
        (1, "order.placed", exchange_of(ns)),
        (2, "order.placed", exchange_of(ns)),
        (3, "order.placed", exchange_of(ns)),
    ]
    assert all(dict(m.headers) == {"tenant": "acme"} for m in alpha_messages)

    # beta succeeded the first time and never saw the retried copies.
    assert rec.results(beta.name) == ["processed"]
    assert effects("beta") == [("retry-1", 1)]
    queues = (alpha.queue, beta.queue)
    wait_until(lambda: drained(*queues), timeout=10, message=f"{queues} drained")
    assert rec.results(beta.name) == ["processed"]


def test_retries_exhausted_through_the_broker(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    publisher.publish(
        exchange_of(ns), "order.shipped", {"fail": {"alpha": 99}}, message_id="exhaust-1"
    )
    seen = rec.wait_count(alpha.name, 3)
    assert rec.results(alpha.name) == ["retry", "retry", "dead_lettered"]
    assert seen[-1].outcome == Acknowledge("dead_lettered", "retries_exhausted")
    dl = DeadLetter.objects.get(message_id="exhaust-1")
    assert (dl.consumer, dl.queue, dl.reason, dl.attempts) == (
        alpha.name,
        alpha.queue,
        "retries_exhausted",
        3,
    )
    # Where it was published, not the default exchange the last copy came through.
    assert (dl.exchange, dl.routing_key) == (exchange_of(ns), "order.shipped")
    assert dl.exception_type == "builtins.RuntimeError"
    assert "attempt 3" in dl.exception_message
    assert dl.first_failed_at < dl.last_failed_at
    assert effects("alpha") == [] and not ProcessedMessage.objects.exists()
    wait_until(lambda: drained(alpha.queue), timeout=10)


def test_consumer_own_retry_policy(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha", max_attempts=2, retry_delays=(0.3,))
    service([alpha], on_outcome=rec)
    publisher.publish(exchange_of(ns), "order.placed", {"fail": {"alpha": 99}}, message_id="own-1")
    seen = rec.wait_count(alpha.name, 2)
    assert isinstance(seen[0].outcome, ScheduleRetry) and seen[0].outcome.delay == 0.3
    assert seen[1].outcome == Acknowledge("dead_lettered", "retries_exhausted")
    assert DeadLetter.objects.get().attempts == 2


def test_consumer_on_its_own_exchange(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    other = f"{exchange_of(ns)}.other"
    alpha = make_spec("alpha", exchange=other)
    service([alpha], on_outcome=rec)
    publisher.publish(other, "order.placed", {"fail": {"alpha": 1}}, message_id="own-ex")
    rec.wait_count(alpha.name, 2)
    assert rec.results(alpha.name) == ["retry", "processed"]
    assert [(m.exchange, m.attempt) for _, m in rec.messages] == [(other, 1), (other, 2)]
    assert effects("alpha") == [("own-ex", 2)]


def test_quorum_queues(
    ns: str,
    rm_settings: dict[str, Any],
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
    transactional_db: None,
) -> None:
    alpha = make_spec("alpha")
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": "quorum"}):
        svc = ConsumerService([alpha], on_outcome=rec)
        thread = threading.Thread(target=svc.run, daemon=True)
        thread.start()
        relay = RelayBeside()  # the retry copy waits in the outbox
        relay.start()
        try:
            assert svc.connected.wait(30)
            # Past the delivery limit the broker moves a message to <queue>.dead (ingested as
            # a delivery_limit dead letter), never drops it.
            assert support.queue_arguments(alpha.queue) == {
                "x-queue-type": "quorum",
                "x-delivery-limit": 50,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": f"{alpha.queue}.dead",
            }
            # .dead states its own limit (RabbitMQ 4 would give it 20 and drop past it); what
            # passes it goes to the classic .dead.kept, which has none.
            assert support.queue_arguments(f"{alpha.queue}.dead") == {
                "x-queue-type": "quorum",
                "x-delivery-limit": 50,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": f"{alpha.queue}.dead.kept",
            }
            assert support.queue_arguments(f"{alpha.queue}.dead.kept") == {
                "x-queue-type": "classic"
            }
            publisher.publish(
                exchange_of(ns), "order.placed", {"fail": {"alpha": 1}}, message_id="quorum-1"
            )
            rec.wait_count(alpha.name, 2)
        finally:
            relay.stop()
            svc.request_stop()
            thread.join(30)
    assert rec.results(alpha.name) == ["retry", "processed"]
    assert effects("alpha") == [("quorum-1", 2)]


def test_each_bad_input_is_dead_lettered_and_the_consumer_keeps_going(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    ex = exchange_of(ns)
    too_large = b'"' + b"x" * MAX_BODY + b'"'
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("invalid_json", "bad-json", {"body": b'{"order": '}),
        ("invalid_utf8", "bad-utf8", {"body": b'{"name": "\xff\xfe"}'}),
        ("empty_body", "bad-empty", {"body": b""}),
        ("missing_message_id", "", {"body": b'{"order": 4}', "message_id": None}),
        ("body_too_large", "bad-large", {"body": too_large}),
        (
            "unsupported_content_type",
            "bad-ctype",
            {"body": b"order=4", "content_type": "text/plain"},
        ),
        ("invalid_headers", "bad-attempt", {"body": b"{}", "headers": {ATTEMPT_HEADER: "abc"}}),
        ("permanent", "bad-permanent", {"body": b'{"permanent": {"alpha": 1}}'}),
    ]
    for _, message_id, kwargs in cases:
        kwargs.setdefault("message_id", message_id)
        publisher.publish(ex, "order.placed", **kwargs)
    publisher.publish(ex, "order.placed", {"order": 5}, message_id="good-after")

    seen = rec.wait_count(alpha.name, len(cases) + 1)
    assert [s.outcome for s in seen] == [
        *(Acknowledge("dead_lettered", reason) for reason, _, _ in cases),
        Acknowledge("processed"),
    ]
    for reason, message_id, kwargs in cases:
        dl = DeadLetter.objects.get(consumer=alpha.name, message_id=message_id)
        assert dl.reason == reason
        assert bytes(dl.body) == kwargs["body"]
        assert dl.queue == alpha.queue and dl.routing_key == "order.placed"
        assert dl.exception_message
    assert DeadLetter.objects.count() == len(cases)
    assert effects("alpha") == [("good-after", 1)]
    wait_until(lambda: drained(alpha.queue), timeout=10)


def test_body_at_the_limit_is_processed_and_one_byte_more_is_not(
    ns: str, service: Any, make_spec: Any, rec: Recorder, publisher: Publisher
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    at_limit = b'{"pad": "' + b"a" * (MAX_BODY - 11) + b'"}'
    assert len(at_limit) == MAX_BODY
    over = at_limit[:-2] + b'a"}'
    publisher.publish(exchange_of(ns), "order.placed", body=at_limit, message_id="at-limit")
    publisher.publish(exchange_of(ns), "order.placed", body=over, message_id="over-limit")
    rec.wait_count(alpha.name, 2)
    assert rec.results(alpha.name) == ["processed", "dead_lettered"]
    dl = DeadLetter.objects.get()
    assert (dl.message_id, dl.reason) == ("over-limit", "body_too_large")
    assert bytes(dl.body) == over and dl.payload is None
    assert str(MAX_BODY) in dl.exception_message
    assert effects("alpha") == [("at-limit", 1)]


POISON = [
    pytest.param(
        {"body": b'{"order": 1}', "headers": {b"\xff\xfe": 1}},
        "processed",  # the name is read with escapes; nothing else is wrong with the message
        id="non-utf8-header-name",
    ),
    pytest.param(
        {"body": b"not json", "headers": {"k\x00": "v"}},
        "dead_lettered",
        id="nul-in-header-name",
    ),
    pytest.param(
        {"body": b'{"order": 1}', "message_id": "a\x00b"},
        "dead_lettered",
        id="nul-in-message-id",
    ),
]


@pytest.mark.parametrize(("poison", "result"), POISON)
def test_poison_message_is_dead_lettered_and_does_not_block_the_queue(
    ns: str,
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
    poison: dict[str, Any],
    result: str,
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    poison.setdefault("message_id", "poison")
    publisher.publish(exchange_of(ns), "order.placed", **poison)
    publisher.publish(exchange_of(ns), "order.placed", {"order": 2}, message_id="after-poison")
    try:
        wait_until(
            lambda: ("after-poison", 1) in effects("alpha"),
            timeout=4,
            message="the message after the poison one",
        )
    except AssertionError as exc:
        pytest.fail(str(exc))
    assert rec.results(alpha.name)[0] == result
    assert DeadLetter.objects.count() == (result == "dead_lettered")


# --------------------------------------------------------------------------- connection loss


@pytest.fixture
def vhost(ns: str, rm_settings: dict[str, Any]) -> Iterator[str]:
    """A vhost of the test's own, so closing its connections touches nothing else."""
    support.rabbitmqctl("add_vhost", ns)
    try:
        support.rabbitmqctl("set_permissions", "-p", ns, "guest", ".*", ".*", ".*")
        with override_settings(
            RELIABLE_MESSAGING={**rm_settings, "BROKER_URL": support.broker_url(ns)}
        ):
            yield ns
    finally:
        support.rabbitmqctl("delete_vhost", ns)


def close_connections(vhost: str) -> None:
    support.rabbitmqctl("close_all_connections", "--vhost", vhost, "test")


def test_dropped_connection_reconnects_and_processes_later_messages(
    ns: str,
    vhost: str,
    service: Any,
    make_spec: Any,
    rec: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    alpha = make_spec("alpha")
    svc = service([alpha], on_outcome=rec)
    pub = Publisher(vhost)
    try:
        pub.publish(exchange_of(ns), "order.placed", {"n": 1}, message_id="before-drop")
        rec.wait_count(alpha.name, 1)
        close_connections(vhost)
        wait_until(
            lambda: any("lost or refused" in r.getMessage() for r in caplog.records),
            timeout=20,
            message="the service noticing the dropped connection",
        )
        assert svc.connected.wait(30), "the service did not reconnect"
        pub.close()  # ours was closed too
        pub.publish(exchange_of(ns), "order.placed", {"n": 2}, message_id="after-drop")
        rec.wait_count(alpha.name, 2)
    finally:
        pub.close()
    assert rec.results(alpha.name) == ["processed", "processed"]
    assert effects("alpha") == [("before-drop", 1), ("after-drop", 1)]
    wait_until(lambda: drained(alpha.queue, vhost=vhost), timeout=10)


def test_connection_lost_while_a_handler_runs_commits_once(
    ns: str, vhost: str, service: Any, make_spec: Any, rec: Recorder
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    pub = Publisher(vhost)
    try:
        pub.publish(
            exchange_of(ns), "order.placed", {"hold": {"alpha": ns}}, message_id="in-flight"
        )
        assert rec.started.wait(20), "the handler did not start"
        # The handler commits once its connection is gone: its ack cannot be sent.
        close_connections(vhost)
        GATES[ns].set()
    finally:
        pub.close()
    # The broker redelivers it on the new connection; the inbox recognises it.
    wait_until(
        lambda: Acknowledge("duplicate") in [s.outcome for s in rec.of(alpha.name)],
        timeout=30,
        message="the redelivery acked as a duplicate",
    )
    assert effects("alpha") == [("in-flight", 1)]
    wait_until(lambda: drained(alpha.queue, vhost=vhost), timeout=10)


# --------------------------------------------------------------------------- lifecycle


def test_graceful_stop_releases_prefetched_messages(
    ns: str,
    rm_settings: Any,
    transactional_db: None,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    alpha = make_spec("alpha")
    svc = ConsumerService([alpha], on_outcome=rec)
    thread = threading.Thread(target=svc.run, daemon=True)
    thread.start()
    try:
        assert svc.connected.wait(30)
        for i in range(6):
            publisher.publish(
                exchange_of(ns), "order.placed", {"sleep": {"alpha": 0.3}}, message_id=f"stop-{i}"
            )
        assert rec.started.wait(20)
        svc.request_stop()
        thread.join(30)
        assert not thread.is_alive()
        assert svc.exit_code == 0
    finally:
        svc.request_stop()
        thread.join(30)
    done = {m for m, _ in effects("alpha")}
    assert done  # the handler in flight finished and committed
    # Whatever had been handed to the service but not started was given back, not handled.
    assert {type(s.outcome) for s in rec.of(alpha.name)} <= {Acknowledge, Release}
    assert sum(s.outcome == Acknowledge("processed") for s in rec.of(alpha.name)) == len(done)
    # Nothing lost and nothing unacked: the rest is back in the queue, ready.
    wait_until(lambda: queue_counts(alpha.queue) == (6 - len(done), 0), timeout=10)

    again = ConsumerService([alpha], idle_timeout=1.0)
    assert again.run() == 0
    assert sorted(m for m, _ in effects("alpha")) == sorted(f"stop-{i}" for i in range(6))
    assert drained(alpha.queue)


def test_shutdown_timeout_leaves_the_message_for_redelivery_and_effects_stay_once(
    ns: str,
    rm_settings: dict[str, Any],
    transactional_db: None,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    alpha = make_spec("alpha")
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "SHUTDOWN_TIMEOUT": 0.3}):
        svc = ConsumerService([alpha], on_outcome=rec)
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(svc.run()), daemon=True)
        thread.start()
        try:
            assert svc.connected.wait(30)
            publisher.publish(
                exchange_of(ns), "order.placed", {"sleep": {"alpha": 1.5}}, message_id="slow-stop"
            )
            assert rec.started.wait(20)
            svc.request_stop()
            thread.join(30)
        finally:
            svc.request_stop()
            thread.join(30)
    assert result == [1]  # not a clean stop: a handler was still running
    # Its ack was never sent, so the broker has the message again ...
    wait_until(lambda: queue_counts(alpha.queue) == (1, 0), timeout=20)
    # ... and whether or not that handler got to commit, it takes effect once.
    again = ConsumerService([alpha], idle_timeout=1.0, on_outcome=rec)
    assert again.run() == 0
    assert effects("alpha") == [("slow-stop", 1)]
    assert drained(alpha.queue)


def test_idle_timeout_returns_zero(
    ns: str, rm_settings: Any, transactional_db: None, make_spec: Any
) -> None:
    svc = ConsumerService([make_spec("alpha")], idle_timeout=0.5)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(svc.run()), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and result == [0]


def test_topology_mismatch_stops_with_a_clear_error(
    ns: str,
    rm_settings: Any,
    transactional_db: None,
    make_spec: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    alpha = make_spec("alpha")
    conn = support.broker_connection()
    try:
        conn.channel().queue_declare(alpha.queue, durable=True, arguments={"x-message-ttl": 1000})
    finally:
        conn.close()
    svc = ConsumerService([alpha])
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(svc.run()), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        svc.request_stop()
        thread.join(30)
        pytest.fail("the service kept running on a mismatched queue")
    assert result == [2]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert alpha.queue in text and "other arguments" in text


def test_unreachable_broker_is_retried_until_stopped(
    ns: str,
    rm_settings: Any,
    transactional_db: None,
    make_spec: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    values = {**rm_settings, "BROKER_URL": "amqp://guest:s3cret@127.0.0.1:1/%2F"}
    with override_settings(RELIABLE_MESSAGING=values):
        svc = ConsumerService([make_spec("alpha")])
        thread = threading.Thread(target=svc.run, daemon=True)
        thread.start()
        try:
            wait_until(
                lambda: sum("lost or refused" in r.getMessage() for r in caplog.records) >= 2,
                timeout=20,
                message="two reconnect attempts",
            )
        finally:
            svc.request_stop()
            thread.join(30)
    assert not thread.is_alive()
    assert not svc.connected.is_set()
    assert all("s3cret" not in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- a worker thread dies


def dying_spec(ns: str, label: str, deaths: int) -> tuple[ConsumerSpec, list[str]]:
    """A consumer whose handler raises SystemExit (a BaseException: it escapes every
    ``except Exception`` on the worker's path, as a stray time-limit interrupt or a
    MemoryError would) on its first ``deaths`` calls, then records an Effect; and its calls."""
    calls: list[str] = []

    def handler(message: Message) -> None:
        calls.append(message.message_id)
        if len(calls) <= deaths:
            raise SystemExit(f"handler called sys.exit() on {message.message_id}")
        Effect.objects.create(consumer=label, message_id=message.message_id, attempt=1)

    spec = ConsumerSpec(
        name=f"{ns}.{label}", queue=f"{ns}.{label}", handler=handler, bindings=("order.*",)
    )
    return spec, calls


def test_a_dead_worker_thread_gives_its_batch_back_and_is_replaced(
    ns: str, service: Any, rec: Recorder, publisher: Publisher
) -> None:
    spec, calls = dying_spec(ns, "dies", deaths=1)
    health = HealthState()
    svc = service([spec], on_outcome=rec, health=health)
    ids = [f"dies-{i}" for i in range(3)]
    for message_id in ids:
        publisher.publish(exchange_of(ns), "order.placed", {"order": 1}, message_id=message_id)
    # What the dead worker held was given back to the broker, redelivered, then handled once.
    wait_until(
        lambda: rec.results(spec.name).count("processed") == len(ids),
        timeout=30,
        message="every delivery processed, those the dead worker held after their redelivery",
    )
    results = rec.results(spec.name)
    assert results.count("release") >= 1 and set(results) == {"release", "processed"}
    assert sorted(m for m, _ in effects("dies")) == ids
    assert calls[0] == "dies-0" and sorted(set(calls)) == ids
    wait_until(lambda: drained(spec.queue), timeout=10, message="every message acked")
    # The pool is whole again and /healthz says what happened without failing.
    assert all(thread.is_alive() for thread in svc._workers._threads)
    healthy, reasons = health.check()
    assert healthy, reasons
    assert any("worker thread(s) died and were replaced" in note for note in health.notes())


def test_an_interrupt_escaping_the_time_limit_gives_the_batch_back(
    ns: str, service: Any, rec: Recorder, publisher: Publisher
) -> None:
    # The one point no Python code can guard: the watchdog's interrupt delivered as the time
    # limit's __exit__ starts, after the handler returned. Forced here: the handler's last act
    # makes the watchdog fire (its real check, past every deadline) when the next __exit__ of
    # this thread is called, which is the time limit's.
    calls: list[str] = []

    def fire_as_the_limit_exits(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "__exit__":
            sys.setprofile(None)
            # This thread's call only: a call an earlier test left registered in this process
            # belongs to a thread id that another thread of this test may now have.
            time_limits.check(time.monotonic() + 3600, thread=threading.get_ident())

    def handler(message: Message) -> None:
        calls.append(message.message_id)
        Effect.objects.create(consumer="late", message_id=message.message_id, attempt=1)
        if len(calls) == 1:
            sys.setprofile(fire_as_the_limit_exits)

    spec = ConsumerSpec(
        name=f"{ns}.late", queue=f"{ns}.late", handler=handler, bindings=("order.*",)
    )
    health = HealthState()
    svc = service([spec], on_outcome=rec, health=health)
    publisher.publish(exchange_of(ns), "order.placed", {"order": 1}, message_id="late-1")
    wait_until(
        lambda: "processed" in rec.results(spec.name),
        timeout=30,
        message="the delivery processed after its redelivery",
    )
    assert rec.results(spec.name) == ["release", "processed"]
    assert calls == ["late-1", "late-1"]
    assert effects("late") == [("late-1", 1)]  # the first run's effect rolled back
    assert time_limits.overdue() == []  # the escaped call is not left registered
    assert all(thread.is_alive() for thread in svc._workers._threads)
    assert health.check()[0]


def test_worker_threads_that_keep_dying_stop_the_process_with_an_exit_code(
    ns: str, rm_settings: Any, transactional_db: None, rec: Recorder, publisher: Publisher
) -> None:
    spec, calls = dying_spec(ns, "keeps-dying", deaths=1000)
    health = HealthState()
    svc = ConsumerService([spec], on_outcome=rec, health=health)
    thread = threading.Thread(target=svc.run, daemon=True)
    thread.start()
    try:
        assert svc.connected.wait(30)
        publisher.publish(exchange_of(ns), "order.placed", {"order": 1}, message_id="poison-1")
        thread.join(60)
        assert not thread.is_alive(), "the consumer did not stop after its workers kept dying"
    finally:
        svc.request_stop()
        thread.join(30)
    assert svc.exit_code == EXIT_WORKERS_DYING
    assert calls == ["poison-1"] * WORKER_DEATH_LIMIT
    healthy, reasons = health.check()
    assert not healthy and any("worker threads died" in reason for reason in reasons), reasons
    # Nothing was acked or decided: the message is back in its queue for the next process.
    assert rec.results(spec.name) == ["release"] * WORKER_DEATH_LIMIT
    assert effects("keeps-dying") == []
    wait_until(lambda: support.ready_count(spec.queue) == 1, timeout=10, message="requeued")
    # The next process: the crash guard counted the deaths of the redelivered (suspect) runs,
    # so the message is a dead letter now, not a loop of dying processes.
    again = ConsumerService([spec], idle_timeout=1.0)
    assert again.run() == 0
    (dead,) = DeadLetter.objects.filter(consumer=spec.name)
    assert dead.message_id == "poison-1" and dead.reason == "worker_crashed"
    assert calls == ["poison-1"] * WORKER_DEATH_LIMIT
    assert drained(spec.queue)


def test_no_specs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no consumers"):
        ConsumerService([])
