"""Features where they meet inside one consume process (issue 45), with a real ConsumerService
in a thread of this process against the real broker and database.

- The circuit breaker and expiry: a delivery waiting for an open breaker that passes its
  ``max_age`` meanwhile is expired when its turn comes: never run, never charged, and its
  verdict says nothing to the breaker (it neither closes nor opens it again).
  An edited replay of an expired message is handled, whatever its age.
- The breaker and the time limit: a handler interrupted at its time limit is a handler failure,
  so timeouts open the breaker, and the deliveries behind them wait uncharged.
- The breaker and replays (plain and edited): a replayed copy arriving while the breaker is open
  waits with the rest and is handled once after; nothing fails again for being replayed then.
- The crash guard and expiry: a redelivered delivery (a suspect) past its deadline is expired,
  not run, and leaves no suspicion behind.
- Ordered consumers and expiry: an expired message never stalls its key (``on_expiry="drop"``),
  or parks it like any dead letter (``"dead_letter"``); a replay, exempt from ``max_age``,
  releases it oldest first, in order.
- A quorum queue's delivery limit and replays: a message the broker dropped past the limit is a
  dead letter ``delivery_limit`` that a replay gets handled once.
- Ordered consumers and a quorum queue's delivery limit: a message the broker took off its
  partition past the limit (while nobody consumed) is a dead letter ``delivery_limit`` that
  parks its key like any other.
- The breaker and concurrent deliveries: those started before it opened, ending after its
  pause, are no probes; it closes only on the probes it let in.
- The breaker and declared payloads: a message that does not match its consumer's type is a
  dead letter ``invalid_payload`` decided before the handler, which the breaker never counts
  (neither toward opening nor as a probe's verdict); one arriving while it is open waits with
  the rest and is still ``invalid_payload`` after, never a retry or another reason.
- Replays and the time limit: a message whose handler ran past its time limit on every
  attempt is a dead letter ``timeout`` (the process alive, no suspicion kept); replayed after
  the fix, it starts again at attempt 1 and is handled once.
- ``async def`` handlers and the breaker: their failures open it as a handler's do, and the
  deliveries behind wait uncharged.
- ``async def`` handlers and ordered consumers: a failure is retried in place, so no later
  message of its key overtakes it.

The "downstream" of the breaker's tests is a switch: an ``Effect`` row of consumer ``switch``
(tests/testapp/consumers.py, ``fail_while``); the test deletes it to bring the downstream back.
"""

# ruff: noqa: F811 - pytest fixtures imported from the consumer service tests, used by name
from __future__ import annotations

import decimal
import time
from collections import Counter
from typing import Any

import pydantic
import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from reliable_messaging import Breaker, Message
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, ReplayOutcome
from reliable_messaging.consuming.breaker import BreakerState
from reliable_messaging.contracts import contract_of
from reliable_messaging.core.coroutines import CoroutineHandler
from reliable_messaging.core.envelope import ORDERING_KEY_HEADER, PUBLISHED_AT_HEADER
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.dead_letters.edit import original_payload_text, replay_edited
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, ProcessedMessage, Replay
from tests.e2e.test_replay_routing import relay_once
from tests.integration.consuming.test_consumer_service import (  # noqa: F401 - fixtures
    Recorder,
    effects,
    exchange_of,
    make_spec,
    rec,
)
from tests.support import (
    Publisher,
    all_queue_counts,
    broker_connection,
    drained,
    no_suspect_left,
    rabbitmqctl,
    wait_until,
)
from tests.testapp.consumers import behave
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

SWITCH = "downstream-down"


def downstream_down() -> None:
    Effect.objects.create(consumer="switch", message_id=SWITCH, attempt=0, payload={})


def downstream_up() -> None:
    Effect.objects.filter(consumer="switch", message_id=SWITCH).delete()


def now_ms() -> int:
    return int(time.time() * 1000)


def results_by_id(rec: Recorder, consumer: str) -> dict[str, list[str]]:
    """The outcomes ``consumer``'s deliveries ended with, by message_id, in order."""
    found: dict[str, list[str]] = {}
    for seen in rec.of(consumer):
        outcome = seen.outcome
        if isinstance(outcome, Acknowledge):
            word = str(outcome.result)
            if outcome.result == "dead_lettered":
                word = f"{word}:{outcome.reason}"
        elif isinstance(outcome, ScheduleRetry):
            word = "deferred" if outcome.deferred else "retry"
        else:
            word = "release"
        found.setdefault(seen.delivery.message_id, []).append(word)
    return found


def consumers_of(queue: str) -> int | None:
    out = rabbitmqctl("list_queues", "-p", "/", "name", "consumers", "--no-table-headers")
    for line in out.splitlines():
        name, _, count = line.partition("\t")
        if name == queue and count.strip().isdigit():
            return int(count)
    return None


def return_until_dropped(queue: str, most: int) -> int:
    """Consume ``queue`` as another client would (a quorum queue with a single active consumer
    refuses ``basic.get``) and give back what comes as failed (reject, requeue) until the broker
    stops delivering it; how many times it was given back. (RabbitMQ 4.3 no longer counts a
    ``basic.nack`` with requeue toward the delivery limit.)"""
    connection = broker_connection(name="rm-tests returner")
    returned = 0
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1)
        for method, _, _ in channel.consume(queue, inactivity_timeout=2.0):
            if method is None:
                break
            assert method.delivery_tag is not None
            channel.basic_reject(method.delivery_tag, requeue=True)
            returned += 1
            if returned >= most:
                break
        channel.cancel()
    finally:
        connection.close()
    return returned


def dead_letter_reasons(consumer: str) -> Counter[str]:
    return Counter(DeadLetter.objects.filter(consumer=consumer).values_list("reason", flat=True))


# --------------------------------------------------------------------------- breaker x expiry


def test_a_delivery_waiting_for_an_open_breaker_expires_uncharged_and_uncounted(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """Four permanent failures open the breaker; six messages arrive meanwhile, each near its
    ``max_age`` of 3 s, and wait. Past it when their turn comes, each is expired (a dead letter
    ``expired``, as the consumer asks): its handler never ran, no attempt was charged, and the
    breaker, half-open, neither closed on them nor opened again. Two fresh messages after them
    are its probes: it closes. An edited replay of one of the expired is handled, not expired
    again."""
    pay = make_spec(
        "lpay",
        bindings=("lpay.*",),
        max_age=3.0,
        on_expiry="dead_letter",
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=1.5, probes=2),
    )
    svc = service([pay], on_outcome=rec)
    breaker = svc.breakers.get(pay.name)
    publisher = Publisher()
    try:
        for n in range(4):
            publisher.publish(
                exchange_of(ns),
                "lpay.due",
                {"permanent": {"lpay": 1}},
                message_id=f"refused-{n}",
            )
        wait_until(lambda: breaker.opened == 1, timeout=30, message="the breaker opening")
        waiting = [f"late-{n}" for n in range(6)]
        for message_id in waiting:
            publisher.publish(
                exchange_of(ns),
                "lpay.due",
                {"n": message_id},
                message_id=message_id,
                # 2.5 s old on arrival: in time now, past 3 s when the 1.5 s pause ends.
                headers={PUBLISHED_AT_HEADER: now_ms() - 2500},
            )
        rec.wait_count(pay.name, 10, timeout=30)
        by_id = results_by_id(rec, pay.name)
        for message_id in waiting:
            assert by_id[message_id] == ["expired"], (message_id, by_id)
        # Expired deliveries say nothing about the handler: the half-open breaker waits for a
        # verdict, neither closed by them (the downstream could still be down) nor opened again.
        assert breaker.state is BreakerState.HALF_OPEN
        assert breaker.opened == 1
        assert [m for m, _ in effects("lpay")] == []  # no handler ran for them (nor committed)
        assert not ProcessedMessage.objects.filter(consumer=pay.name).exists()
        assert dead_letter_reasons(pay.name) == {"permanent": 4, "expired": 6}
        for letter in DeadLetter.objects.filter(consumer=pay.name, reason="expired"):
            assert letter.attempts == 1, (letter.message_id, letter.attempts)

        for n in range(2):
            publisher.publish(exchange_of(ns), "lpay.due", {"n": n}, message_id=f"fresh-{n}")
        rec.wait_count(pay.name, 12, timeout=30)
        assert breaker.state is BreakerState.CLOSED
        assert sorted(m for m, _ in effects("lpay")) == ["fresh-0", "fresh-1"]

        # An edited replay of an expired one is an operator's decision to handle it now: it
        # keeps the original's publish time (past max_age) and is handled, not expired again.
        late = DeadLetter.objects.get(consumer=pay.name, message_id="late-0")
        edited = replay_edited(
            late,
            payload_text=original_payload_text(late).replace("late-0", "late-0, edited"),
            headers={},
            reason="handle it late",
            replayed_by="operator",
        )
        relay_once(ns)
        rec.wait_count(pay.name, 13, timeout=30)
        assert results_by_id(rec, pay.name)[edited.message_id] == ["processed"]
        assert effects("lpay")[-1] == (edited.message_id, 1)
        late.refresh_from_db()
        assert late.status == DeadLetterStatus.RESOLVED
        wait_until(lambda: drained(f"{ns}.lpay"), timeout=20, message="lpay's queue drained")
    finally:
        publisher.close()


# --------------------------------------------------------------------------- breaker x time limit


def slow_while_down(label: str, rec: Recorder) -> Any:
    """A handler whose downstream is slow while the switch is on: it spins in Python (so its
    time limit interrupts it) for 5 s, else it behaves as the testapp's."""

    def handler(message: Message) -> None:
        with rec.lock:
            rec.messages.append((label, message))
        if Effect.objects.filter(consumer="switch", message_id=SWITCH).exists():
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                pass
        behave(label, message)

    return handler


def test_handlers_timing_out_open_the_breaker_and_the_rest_wait_uncharged(
    ns: str, rm_settings: dict[str, Any], service: Any, rec: Recorder, publisher: Publisher
) -> None:
    """The downstream turns slow: handlers run into their 0.5 s time limit. Each interruption
    is a failure of the handler (its attempt charged, a retry), so four of them open the
    breaker; the six messages behind wait unstarted. The downstream is fast again: each of the
    ten takes effect once, the six on their first attempt, the four on their second; nothing
    is a dead letter."""
    spec = ConsumerSpec(
        name=f"{ns}.spay",
        queue=f"{ns}.spay",
        handler=slow_while_down("spay", rec),
        bindings=("spay.*",),
        timeout=0.5,
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=1.0, probes=2),
    )
    failed_while_down_and_handled_once_after(ns, service, rec, publisher, spec, "spay")
    for seen in rec.of(spec.name):
        if isinstance(seen.outcome, ScheduleRetry):
            assert "time limit" in seen.outcome.error or "Timeout" in seen.outcome.error, seen


def failed_while_down_and_handled_once_after(
    ns: str, service: Any, rec: Recorder, publisher: Publisher, spec: ConsumerSpec, label: str
) -> None:
    """Ten messages for ``spec`` (its breaker opening at four failures) while the downstream is
    down: four fail, open the breaker, and the six behind wait unstarted. Once it is up, each of
    the ten takes effect once, the six on their first attempt, the four on their second; the
    breaker opened once and closed, nothing is a dead letter."""
    downstream_down()
    svc = service([spec], on_outcome=rec)
    breaker = svc.breakers.get(spec.name)
    ids = [f"{label}-{n}" for n in range(10)]
    for message_id in ids:
        publisher.publish(exchange_of(ns), f"{label}.due", {"n": message_id}, message_id=message_id)
    wait_until(lambda: breaker.opened >= 1, timeout=30, message="failures opening the breaker")
    downstream_up()
    wait_until(
        lambda: Effect.objects.filter(consumer=label).count() == len(ids),
        timeout=45,
        message=lambda: f"every message handled; outcomes {results_by_id(rec, spec.name)}",
    )
    by_id = results_by_id(rec, spec.name)
    failed = sorted(m for m, words in by_id.items() if "retry" in words)
    assert len(failed) == 4, by_id
    attempts = dict(effects(label))
    assert sorted(attempts) == ids
    assert {m: a for m, a in attempts.items() if a != 1} == dict.fromkeys(failed, 2)
    assert breaker.opened == 1 and breaker.state is BreakerState.CLOSED
    assert not DeadLetter.objects.exists()
    wait_until(lambda: drained(spec.queue), timeout=20, message=f"{label}'s queue drained")


# --------------------------------------------------------------------------- async x breaker


def async_failing_while_down(label: str, rec: Recorder) -> CoroutineHandler:
    """An ``async def`` handler whose downstream fails while the switch is on; it reads the
    switch and writes its effect through ``sync_to_async``, in the delivery's transaction."""

    async def handler(message: Message) -> None:
        with rec.lock:
            rec.messages.append((label, message))
        down = await sync_to_async(
            Effect.objects.filter(consumer="switch", message_id=SWITCH).exists
        )()
        if down:
            raise ConnectionError("the downstream is down")
        await sync_to_async(behave)(label, message)

    return CoroutineHandler(handler)


def test_async_handlers_failing_open_the_breaker_and_the_rest_wait_uncharged(
    ns: str, rm_settings: dict[str, Any], service: Any, rec: Recorder, publisher: Publisher
) -> None:
    """An ``async def`` handler's failures count for its breaker as a handler's do: four open
    it, and the six messages behind wait unstarted. The downstream is back: each of the ten
    takes effect once, the six on their first attempt, the four on their second; nothing is a
    dead letter."""
    spec = ConsumerSpec(
        name=f"{ns}.apay",
        queue=f"{ns}.apay",
        handler=async_failing_while_down("apay", rec),
        bindings=("apay.*",),
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=1.0, probes=2),
    )
    failed_while_down_and_handled_once_after(ns, service, rec, publisher, spec, "apay")


# --------------------------------------------------------------------------- breaker x payloads


class Payment(pydantic.BaseModel):
    n: str
    amount: decimal.Decimal


def paying_while_up(label: str, rec: Recorder) -> Any:
    """A handler of ``Payment`` objects that fails while the switch is on (the downstream is
    down), else writes one ``Effect`` row."""

    def handler(message: Message) -> None:
        with rec.lock:
            rec.messages.append((label, message))
        payment = message.payload
        assert isinstance(payment, Payment), payment  # the stage gave it the typed object
        if Effect.objects.filter(consumer="switch", message_id=SWITCH).exists():
            raise RuntimeError(f"{label}: the downstream is down")
        Effect.objects.create(
            consumer=label,
            message_id=message.message_id,
            attempt=message.attempt,
            payload={"n": payment.n},
        )

    return handler


def test_invalid_payloads_never_count_for_the_breaker_nor_turn_into_anything_else_while_open(
    ns: str, rm_settings: dict[str, Any], service: Any, rec: Recorder, publisher: Publisher
) -> None:
    """Eight payloads that do not match the consumer's type, the downstream up: eight dead
    letters ``invalid_payload``, no handler run, and the breaker (opening at four failures)
    stays closed. The downstream goes down: four payments fail and open it; the downstream comes
    back. Three more bad payloads and two payments arrive while it is open, and wait.
    After the pause the bad ones are ``invalid_payload`` again (no retry, no other reason) and
    say nothing to the half-open breaker: it closes on payments, having opened once. Every
    payment takes effect once; every dead letter is a bad payload, its first attempt unspent."""
    spec = ConsumerSpec(
        name=f"{ns}.ppay",
        queue=f"{ns}.ppay",
        handler=paying_while_up("ppay", rec),
        bindings=("ppay.*",),
        payload=contract_of(Payment),
        max_attempts=50,
        breaker=Breaker(failure_rate=0.5, window=10, min_failures=4, pause=3.0, probes=2),
    )
    svc = service([spec], on_outcome=rec)
    breaker = svc.breakers.get(spec.name)

    def send(message_id: str, payload: Any) -> None:
        publisher.publish(exchange_of(ns), "ppay.due", payload, message_id=message_id)

    bad_first = [f"bad-{n}" for n in range(8)]
    for message_id in bad_first:
        send(message_id, {"n": message_id, "amount": "not a number"})
    rec.wait_count(spec.name, len(bad_first), timeout=30)
    assert results_by_id(rec, spec.name) == {
        m: ["dead_lettered:invalid_payload"] for m in bad_first
    }
    assert breaker.opened == 0 and breaker.state is BreakerState.CLOSED

    downstream_down()
    failing = [f"down-{n}" for n in range(4)]
    for message_id in failing:
        send(message_id, {"n": message_id, "amount": "10.00"})
    wait_until(lambda: breaker.opened == 1, timeout=30, message="failed payments opening it")
    # Back before anything arrives: a probe of the half-open breaker, 3 s on, must find it up
    # however long the sends below take on a loaded machine.
    downstream_up()
    bad_while_open = [f"bad-open-{n}" for n in range(3)]
    fresh = [f"fresh-{n}" for n in range(2)]
    send(bad_while_open[0], {"n": bad_while_open[0], "amount": "twelve"})
    send(fresh[0], {"n": fresh[0], "amount": "12.50"})
    send(bad_while_open[1], {"n": bad_while_open[1]})  # no amount
    send(fresh[1], {"n": fresh[1], "amount": "7.25"})
    send(bad_while_open[2], ["not", "an", "object"])
    assert breaker.state is BreakerState.OPEN  # they wait (pause 3 s)

    payments = failing + fresh
    # Decided, not only written: a payment's outcome is told after its commit, a moment after
    # its effect can be read (the race a PgBouncer run lost).
    wait_until(
        lambda: all(
            results_by_id(rec, spec.name).get(m, [""])[-1] == "processed" for m in payments
        ),
        timeout=45,
        message=lambda: f"every payment handled; outcomes {results_by_id(rec, spec.name)}",
    )
    assert Effect.objects.filter(consumer="ppay").count() == len(payments)
    wait_until(
        lambda: all(m in results_by_id(rec, spec.name) for m in bad_while_open),
        timeout=30,
        message="the bad payloads that waited decided",
    )
    by_id = results_by_id(rec, spec.name)
    for message_id in bad_first + bad_while_open:
        assert by_id[message_id] == ["dead_lettered:invalid_payload"], (message_id, by_id)
    for message_id in failing:  # failed while down (retries), then processed
        assert by_id[message_id][-1] == "processed", by_id
        assert set(by_id[message_id][:-1]) <= {"retry"}, by_id
    for message_id in fresh:
        assert by_id[message_id] == ["processed"], by_id
    assert breaker.opened == 1 and breaker.state is BreakerState.CLOSED
    assert sorted(m for m, _ in effects("ppay")) == sorted(payments)
    given = {message.message_id for label, message in rec.messages if label == "ppay"}
    assert given.isdisjoint(bad_first + bad_while_open)  # never reached the handler
    letters = DeadLetter.objects.filter(consumer=spec.name)
    assert sorted(letters.values_list("message_id", flat=True)) == sorted(
        bad_first + bad_while_open
    )
    assert {letter.reason for letter in letters} == {DeadLetterReason.INVALID_PAYLOAD}
    assert {letter.attempts for letter in letters} == {1}
    wait_until(lambda: drained(f"{ns}.ppay"), timeout=20, message="ppay's queue drained")


# --------------------------------------------------------------------------- breaker x replay


def test_replays_arriving_while_the_breaker_is_open_wait_and_are_handled_once(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """A consumer that gives up at the first failure: four failures with the downstream down
    are four dead letters, and open the breaker (for 30 s: on a loaded machine running the relay
    and listing the queues below take long, and the pause must outlast them). An operator
    replays three of them and an edited copy of the fourth while it is open; two fresh
    messages come too. Everything waits, unstarted (the dead letters are not failed again);
    with the downstream back, the breaker closes and each copy and message takes effect once:
    the dead letters resolved, the ledger saying processed, and no new dead letter."""
    pay = make_spec(
        "rpay",
        bindings=("rpay.*",),
        max_attempts=1,
        breaker=Breaker(
            failure_rate=0.5, window=10, min_failures=4, pause=30.0, probes=2, max_pause=30.0
        ),
    )
    downstream_down()
    svc = service([pay], on_outcome=rec)
    breaker = svc.breakers.get(pay.name)
    publisher = Publisher()
    try:
        failing = {"fail_while": {"rpay": SWITCH}}
        for n in range(4):
            publisher.publish(exchange_of(ns), "rpay.due", failing, message_id=f"gave-up-{n}")
        wait_until(lambda: breaker.opened == 1, timeout=30, message="the breaker opening")
        assert dead_letter_reasons(pay.name) == {"retries_exhausted": 4}
        letters = list(DeadLetter.objects.filter(consumer=pay.name).order_by("pk"))
        result = replay(
            DeadLetter.objects.filter(pk__in=[letter.pk for letter in letters[:3]]),
            replayed_by="operator",
        )
        assert len(result.replayed) == 3, result
        edited = replay_edited(
            letters[3],
            payload_text=original_payload_text(letters[3]).replace("fail_while", "was_failing"),
            headers={},
            reason="the fourth, edited",
            replayed_by="operator",
        )
        relay_once(ns)
        for n in range(2):
            publisher.publish(exchange_of(ns), "rpay.due", failing, message_id=f"fresh-{n}")
        # All six are in the process, unacked, unstarted: nothing decided since the opening.
        wait_until(
            lambda: all_queue_counts().get(f"{ns}.rpay") == (0, 6),
            timeout=30,
            message=lambda: f"six deliveries held; {all_queue_counts().get(f'{ns}.rpay')}",
        )
        assert len(rec.of(pay.name)) == 4
        assert breaker.state is BreakerState.OPEN
        downstream_up()
        rec.wait_count(pay.name, 10, timeout=60)
    finally:
        publisher.close()
    assert breaker.state is BreakerState.CLOSED
    assert [seen.outcome for seen in rec.of(pay.name)[4:]] == [Acknowledge("processed")] * 6
    handled = Counter(m for m, _ in effects("rpay"))
    expected = [f"gave-up-{n}" for n in range(3)] + [edited.message_id, "fresh-0", "fresh-1"]
    assert handled == Counter(expected), handled
    assert dead_letter_reasons(pay.name) == {"retries_exhausted": 4}
    assert set(DeadLetter.objects.values_list("status", flat=True)) == {DeadLetterStatus.RESOLVED}
    assert set(Replay.objects.values_list("outcome", flat=True)) == {ReplayOutcome.PROCESSED}
    wait_until(lambda: drained(f"{ns}.rpay"), timeout=20, message="rpay's queue drained")


# --------------------------------------------------------------------------- crash guard x expiry


def test_a_redelivered_suspect_past_its_deadline_is_expired_and_leaves_no_suspicion(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """A message given back by another client comes redelivered: a suspect, run alone under the
    crash guard. Past its ``max_age`` by then, it is expired (its handler never runs), and the
    guard keeps no suspicion of it; a fresh message behind it is handled."""
    nu = make_spec("nu", bindings=("nu.*",), max_age=10.0)
    declaring = service([nu])
    declaring.request_stop()
    wait_until(lambda: consumers_of(f"{ns}.nu") == 0, timeout=30, message="no consumer")
    publisher = Publisher()
    try:
        publisher.publish(
            exchange_of(ns),
            "nu.due",
            {"n": 0},
            message_id="old-suspect",
            headers={PUBLISHED_AT_HEADER: now_ms() - 60_000},
        )
        assert return_until_dropped(f"{ns}.nu", most=1) == 1  # now redelivered
        publisher.publish(exchange_of(ns), "nu.due", {"n": 1}, message_id="fresh")
    finally:
        publisher.close()
    service([nu], on_outcome=rec)
    rec.wait_count(nu.name, 2, timeout=30)
    seen = {s.delivery.message_id: s for s in rec.of(nu.name)}
    assert seen["old-suspect"].delivery.redelivered
    assert results_by_id(rec, nu.name) == {"old-suspect": ["expired"], "fresh": ["processed"]}
    assert effects("nu") == [("fresh", 1)]
    no_suspect_left()
    assert not DeadLetter.objects.exists()
    wait_until(lambda: drained(f"{ns}.nu"), timeout=20, message="nu's queue drained")


# --------------------------------------------------------------------------- ordered x expiry


def test_an_expired_message_never_stalls_its_key_and_a_kept_one_parks_it_in_order(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """One partition, two ordered consumers of the same key with a ``max_age`` of 10 s (room
    for a loaded machine's start and handling): seq 0 and 3 arrive already too old. ``iota``
    drops them and handles 1, 2 and 4 in order, the key never waiting. ``eta`` keeps them as
    dead letters: 1 to 4 are parked behind seq 0; replayed oldest first (a replay is exempt
    from ``max_age``) all five are handled in publish order."""
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "ORDERED_PARTITIONS": 1}):
        iota = make_spec("iota", bindings=("seq.*",), ordered=True, max_age=10.0)
        eta = make_spec(
            "eta", bindings=("seq.*",), ordered=True, max_age=10.0, on_expiry="dead_letter"
        )
        service([iota, eta], on_outcome=rec)
        publisher = Publisher()
        try:
            for seq in range(5):
                headers: dict[str, Any] = {ORDERING_KEY_HEADER: "k"}
                if seq in (0, 3):
                    headers[PUBLISHED_AT_HEADER] = now_ms() - 60_000
                publisher.publish(
                    exchange_of(ns),
                    "seq.next",
                    {"key": "k", "seq": seq},
                    message_id=f"k-{seq}",
                    headers=headers,
                )
        finally:
            publisher.close()
        rec.wait_count(iota.name, 5)
        rec.wait_count(eta.name, 5)
        assert [m for m, _ in effects("iota")] == ["k-1", "k-2", "k-4"]
        iota_results = results_by_id(rec, iota.name)
        assert iota_results["k-0"] == iota_results["k-3"] == ["expired"]
        assert not DeadLetter.objects.filter(consumer=iota.name).exists()

        assert effects("eta") == []
        reasons = dict(
            DeadLetter.objects.filter(consumer=eta.name).values_list("message_id", "reason")
        )
        assert reasons == {
            "k-0": DeadLetterReason.EXPIRED,
            "k-1": DeadLetterReason.PARKED,
            "k-2": DeadLetterReason.PARKED,
            # Expired comes before the key's dead letters are looked at.
            "k-3": DeadLetterReason.EXPIRED,
            "k-4": DeadLetterReason.PARKED,
        }
        wait_until(lambda: drained(f"{ns}.iota.p0", f"{ns}.eta.p0"), timeout=20, message="drained")
        result = replay(DeadLetter.objects.filter(consumer=eta.name), replayed_by="operator")
        assert len(result.replayed) == 5, result
        relay_once(ns)
        wait_until(
            lambda: len(effects("eta")) == 5,
            timeout=30,
            message=lambda: f"the key replayed; eta took effect for {effects('eta')}",
        )
    assert [m for m, _ in effects("eta")] == [f"k-{seq}" for seq in range(5)]
    assert set(DeadLetter.objects.filter(consumer=eta.name).values_list("status", flat=True)) == {
        DeadLetterStatus.RESOLVED
    }


# --------------------------------------------------------------------------- async x ordered


def async_behaving(label: str, rec: Recorder) -> CoroutineHandler:
    """An ``async def`` handler that behaves as the testapp's, through ``sync_to_async``."""

    async def handler(message: Message) -> None:
        with rec.lock:
            rec.messages.append((label, message))
        await sync_to_async(behave)(label, message)

    return CoroutineHandler(handler)


def test_an_async_ordered_consumer_retries_in_place_and_keeps_each_keys_order(
    ns: str, rm_settings: dict[str, Any], service: Any, rec: Recorder, publisher: Publisher
) -> None:
    """One partition, two keys, an ``async def`` ordered handler: ``k-1`` fails its first two
    attempts and is retried in place, so no later message of ``k`` overtakes it; every message
    takes effect once, in its key's publish order, none a dead letter."""
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "ORDERED_PARTITIONS": 1}):
        spec = ConsumerSpec(
            name=f"{ns}.aseq",
            queue=f"{ns}.aseq",
            handler=async_behaving("aseq", rec),
            bindings=("aseq.*",),
            ordered=True,
            max_attempts=5,
        )
        service([spec], on_outcome=rec)
        for seq in range(4):
            for key in ("k", "j"):
                payload: dict[str, Any] = {"key": key, "seq": seq}
                if (key, seq) == ("k", 1):
                    payload["fail"] = {"aseq": 2}
                publisher.publish(
                    exchange_of(ns),
                    "aseq.next",
                    payload,
                    message_id=f"{key}-{seq}",
                    headers={ORDERING_KEY_HEADER: key},
                )
        wait_until(
            lambda: len(effects("aseq")) == 8,
            timeout=45,
            message=lambda: f"every message handled; outcomes {results_by_id(rec, spec.name)}",
        )
    done = effects("aseq")
    for key in ("k", "j"):
        assert [m for m, _ in done if m.startswith(f"{key}-")] == [f"{key}-{n}" for n in range(4)]
    assert dict(done) == {**{m: 1 for m, _ in done}, "k-1": 3}
    assert not DeadLetter.objects.exists()


# --------------------------------------------------------------------------- quorum limit x replay


def test_a_message_past_the_quorum_delivery_limit_is_replayed_and_handled_once(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """Another client returns a message on a quorum queue (delivery limit 2) until the broker
    drops it to ``.dead``: ``consume`` keeps it as a dead letter ``delivery_limit``, not
    handled; the message behind it is handled. A replay (its copy a new delivery, its count
    at zero) takes effect once and resolves it."""
    quorum = {**rm_settings, "QUEUE_TYPE": "quorum", "QUORUM_DELIVERY_LIMIT": 2}
    with override_settings(RELIABLE_MESSAGING=quorum):
        mu = make_spec("mu", bindings=("mu.*",))
        declaring = service([mu])
        declaring.request_stop()
        wait_until(lambda: consumers_of(f"{ns}.mu") == 0, timeout=30, message="no consumer")
        publisher = Publisher()
        try:
            publisher.publish(exchange_of(ns), "mu.due", {"n": 0}, message_id="returned")
            returned = return_until_dropped(f"{ns}.mu", most=10)
            assert 2 <= returned <= 4, returned
            publisher.publish(exchange_of(ns), "mu.due", {"n": 1}, message_id="behind")
        finally:
            publisher.close()
        service([mu], on_outcome=rec)
        rec.wait_count(mu.name, 2, timeout=30)
        assert effects("mu") == [("behind", 1)]
        assert dead_letter_reasons(mu.name) == {"delivery_limit": 1}
        result = replay(DeadLetter.objects.filter(consumer=mu.name), replayed_by="operator")
        assert len(result.replayed) == 1, result
        relay_once(ns)
        rec.wait_count(mu.name, 3, timeout=30)
    assert effects("mu") == [("behind", 1), ("returned", 1)]
    assert DeadLetter.objects.get(consumer=mu.name).status == DeadLetterStatus.RESOLVED
    wait_until(lambda: drained(f"{ns}.mu"), timeout=20, message="mu's queue drained")


# --------------------------------------------------------------------------- ordered x quorum limit


def test_a_key_whose_message_passed_the_quorum_delivery_limit_is_parked_in_order(
    ns: str, rm_settings: dict[str, Any], service: Any, make_spec: Any, rec: Recorder
) -> None:
    """An ordered consumer on quorum queues with a delivery limit of 2: another client returns
    seq 0 of key k until the broker takes it off the partition (to ``.dead``); seq 1 to 3 come
    after. ``consume`` keeps seq 0 as a dead letter ``delivery_limit`` and parks 1 to 3 behind
    it (none handled before it); another key flows. Replayed oldest first, the key's four are
    handled in publish order."""
    quorum = {
        **rm_settings,
        "ORDERED_PARTITIONS": 1,
        "QUEUE_TYPE": "quorum",
        "QUORUM_DELIVERY_LIMIT": 2,
    }
    with override_settings(RELIABLE_MESSAGING=quorum):
        kappa = make_spec("kappa", bindings=("seq.*",), ordered=True)
        declaring = service([kappa])
        declaring.request_stop()
        partition = f"{ns}.kappa.p0"
        # Its consumer gone before another client takes the message.
        wait_until(lambda: consumers_of(partition) == 0, timeout=30, message="no consumer")
        publisher = Publisher()
        try:

            def send(key: str, seq: int) -> None:
                publisher.publish(
                    exchange_of(ns),
                    "seq.next",
                    {"key": key, "seq": seq},
                    message_id=f"{key}-{seq}",
                    headers={ORDERING_KEY_HEADER: key},
                )

            send("k", 0)
            returned = return_until_dropped(partition, most=10)
            assert 2 <= returned <= 4, returned
            for seq in (1, 2, 3):
                send("k", seq)
            send("j", 0)
        finally:
            publisher.close()
        service([kappa], on_outcome=rec)
        # Five outcomes: k-0 from the .dead queue, k-1..3 and j-0 from the partition.
        rec.wait_count(kappa.name, 5, timeout=30)
        assert effects("kappa") == [("j-0", 1)]
        reasons = dict(
            DeadLetter.objects.filter(consumer=kappa.name).values_list("message_id", "reason")
        )
        assert reasons == {
            "k-0": DeadLetterReason.DELIVERY_LIMIT,
            "k-1": DeadLetterReason.PARKED,
            "k-2": DeadLetterReason.PARKED,
            "k-3": DeadLetterReason.PARKED,
        }
        result = replay(DeadLetter.objects.filter(consumer=kappa.name), replayed_by="operator")
        assert len(result.replayed) == 4, result
        relay_once(ns)
        wait_until(
            lambda: len(effects("kappa")) == 5,
            timeout=30,
            message=lambda: f"the key replayed; kappa took effect for {effects('kappa')}",
        )
    assert [m for m, _ in effects("kappa") if m.startswith("k-")] == [f"k-{s}" for s in range(4)]


# --------------------------------------------------------------------------- breaker x probes


def test_deliveries_started_before_the_breaker_opened_never_count_as_probes(
    ns: str, rm_settings: dict[str, Any], service: Any, publisher: Publisher
) -> None:
    """Two slow deliveries start while the breaker is closed; two quick failures beside them
    open it, and the slow ones succeed after its pause has ended. They were no probes: the
    breaker stays half-open (no probe ran yet) until two deliveries it let in as probes
    succeed."""

    def handler(message: Message) -> None:
        if message.message_id.startswith("slow"):
            time.sleep(1.5)
        elif message.message_id.startswith("bad"):
            raise RuntimeError("the provider refused it")
        Effect.objects.create(consumer="probes", message_id=message.message_id, attempt=1)

    fast = {**rm_settings, "RETRY_DELAYS": [30.0], "MAX_ATTEMPTS": 5, "CONSUMER_BATCH_SIZE": 1}
    config = Breaker(failure_rate=0.5, window=10, min_failures=2, pause=0.5, probes=2)
    with override_settings(RELIABLE_MESSAGING=fast):
        spec = ConsumerSpec(
            name=f"{ns}.probes",
            queue=f"{ns}.probes",
            handler=handler,
            bindings=("probe.*",),
            breaker=config,
        )
        svc = service([spec], concurrency=4)
        breaker = svc.breakers.get(spec.name)
        assert breaker is not None
        for message_id in ("slow-1", "slow-2", "bad-1", "bad-2"):
            publisher.publish(exchange_of(ns), "probe.due", {}, message_id=message_id)
        wait_until(lambda: breaker.opened == 1, timeout=20, message="the breaker opened")
        wait_until(
            lambda: Effect.objects.filter(consumer="probes").count() == 2,
            timeout=20,
            message="the slow deliveries succeeded",
        )
        time.sleep(0.3)  # their verdicts recorded (the commit comes just before)
        assert breaker.state is BreakerState.HALF_OPEN
        for message_id in ("good-1", "good-2"):
            publisher.publish(exchange_of(ns), "probe.due", {}, message_id=message_id)
        wait_until(
            lambda: breaker.state is BreakerState.CLOSED,
            timeout=20,
            message="closed by two probes",
        )
    assert Effect.objects.filter(consumer="probes").count() == 4


# --------------------------------------------------------------------------- replay x time limit


def test_a_replay_of_a_message_past_its_time_limit_starts_afresh_and_is_handled_once(
    ns: str, rm_settings: dict[str, Any], service: Any, rec: Recorder, publisher: Publisher
) -> None:
    """While the downstream is slow, the handler spins past its 0.5 s time limit on each of its
    3 attempts: interrupted each time, then a dead letter ``timeout``, with no suspicion kept
    (the process lived). The downstream is fast again: the replay starts at attempt 1, is
    handled once and resolves the dead letter."""
    spec = ConsumerSpec(
        name=f"{ns}.tpay",
        queue=f"{ns}.tpay",
        handler=slow_while_down("tpay", rec),
        bindings=("tpay.*",),
        timeout=0.5,
    )
    downstream_down()
    service([spec], on_outcome=rec)
    publisher.publish(exchange_of(ns), "tpay.due", {"n": 0}, message_id="slow")
    letters = DeadLetter.objects.filter(consumer=spec.name, message_id="slow")
    wait_until(
        letters.exists,
        timeout=30,
        message=lambda: f"a dead letter; outcomes {results_by_id(rec, spec.name)}",
    )
    letter = letters.get()
    assert (letter.reason, letter.attempts) == (DeadLetterReason.TIMEOUT, 3), (
        letter.reason,
        letter.attempts,
        letter.exception_message,
    )
    # The recorder hears of an outcome after its transaction commits, the dead letter's with it.
    wait_until(
        lambda: (
            results_by_id(rec, spec.name) == {"slow": ["retry", "retry", "dead_lettered:timeout"]}
        ),
        timeout=10,
        message=lambda: f"the three outcomes; outcomes {results_by_id(rec, spec.name)}",
    )
    no_suspect_left()
    downstream_up()
    result = replay(letters, replayed_by="operator")
    assert result.replayed == [letter.pk], result
    relay_once(ns)
    wait_until(
        lambda: letters.exclude(status=DeadLetterStatus.REPLAYED).exists(),
        timeout=30,
        message=lambda: f"the replay's outcome; outcomes {results_by_id(rec, spec.name)}",
    )
    letter.refresh_from_db()
    assert letter.status == DeadLetterStatus.RESOLVED, (letter.status, letter.exception_message)
    assert effects("tpay") == [("slow", 1)]
    assert list(Replay.objects.values_list("outcome", flat=True)) == [ReplayOutcome.PROCESSED]
    no_suspect_left()
    wait_until(lambda: drained(f"{ns}.tpay"), timeout=20, message="tpay's queue drained")
