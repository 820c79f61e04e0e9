"""The circuit breaker's state machine (reliable_messaging.consuming.breaker), on a fake clock."""

from __future__ import annotations

import logging
import threading

import pytest
from django.test import override_settings

from reliable_messaging import Breaker, consumer
from reliable_messaging.conf import messaging_settings
from reliable_messaging.consuming.breaker import (
    Admission,
    BreakerState,
    CircuitBreaker,
    ConsumerBreakers,
    breaker_for,
    handler_verdict,
)
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.outcomes import (
    Acknowledge,
    FailureReason,
    Release,
    RetryInPlace,
    ScheduleRetry,
)
from reliable_messaging.core.registry import ConsumerRegistry

SMALL = Breaker(failure_rate=0.5, window=10, min_failures=4, pause=5.0, probes=2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(config: Breaker = SMALL) -> tuple[CircuitBreaker, Clock, list[tuple[int, int]]]:
    clock = Clock()
    moves: list[tuple[int, int]] = []
    breaker = CircuitBreaker(
        "billing.charge", config, clock=clock, listener=lambda _, old, new: moves.append((old, new))
    )
    return breaker, clock, moves


def decide(breaker: CircuitBreaker, failed: bool | None) -> BreakerState | None:
    """One delivery offered to ``breaker`` and, when let in, decided with verdict ``failed``."""
    admission = breaker.admit()
    return None if admission is None else breaker.record(admission, failed)


def open_it(breaker: CircuitBreaker) -> None:
    for _ in range(4):
        decide(breaker, True)
    assert breaker.state is BreakerState.OPEN


# --------------------------------------------------------------------------- closed


def test_opens_at_min_failures_when_the_rate_is_reached() -> None:
    breaker, _, moves = make()
    for _ in range(3):
        assert decide(breaker, True) is None
        assert breaker.admit()
    assert decide(breaker, True) is BreakerState.OPEN
    assert not breaker.admit()
    assert moves == [(BreakerState.CLOSED, BreakerState.OPEN)]
    assert breaker.opened == 1


def test_stays_closed_below_the_failure_rate() -> None:
    breaker, _, _ = make()
    # 4 failures among 10: at min_failures but 40% < 50%.
    for failed in [False, False, True, False, True, False, True, False, True, False]:
        decide(breaker, failed)
    assert breaker.state is BreakerState.CLOSED


def test_the_window_forgets_old_failures() -> None:
    breaker, _, _ = make()
    for _ in range(3):
        decide(breaker, True)
    for _ in range(10):
        decide(breaker, False)  # the three failures slide out of the window of 10
    for _ in range(3):
        decide(breaker, True)
    assert breaker.state is BreakerState.CLOSED  # 3 failures in the window, fewer than 4
    decide(breaker, True)
    assert breaker.state is BreakerState.CLOSED  # 4 of 10 = 40%
    decide(breaker, True)
    assert breaker.state is BreakerState.OPEN  # 5 of 10 = 50%


def test_min_failures_guards_a_small_sample() -> None:
    breaker, _, _ = make(Breaker(failure_rate=0.5, window=100, min_failures=20, pause=1, probes=1))
    for _ in range(19):
        decide(breaker, True)  # 100% failures, but only 19
    assert breaker.state is BreakerState.CLOSED
    decide(breaker, True)
    assert breaker.state is BreakerState.OPEN


def test_what_says_nothing_about_the_handler_is_not_counted() -> None:
    breaker, _, _ = make()
    for _ in range(50):
        decide(breaker, None)
        decide(breaker, True)
        decide(breaker, True)
        decide(breaker, False)
        decide(breaker, False)
        if breaker.state is BreakerState.OPEN:
            break
    # Two failures out of four counted verdicts reach 50%; the Nones did not dilute the rate.
    assert breaker.state is BreakerState.OPEN


# --------------------------------------------------------------------------- open, half-open


def test_open_refuses_for_the_pause_then_half_opens() -> None:
    breaker, clock, moves = make()
    open_it(breaker)
    clock.now += 4.9
    assert not breaker.admit()
    assert breaker.resumes_in == pytest.approx(0.1)
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN
    assert moves[-1] == (BreakerState.OPEN, BreakerState.HALF_OPEN)


def test_outcomes_of_deliveries_started_before_the_open_are_not_counted() -> None:
    breaker, clock, _ = make()
    started = [breaker.admit() for _ in range(10)]
    open_it(breaker)
    for admission in started:
        assert admission is not None
        assert breaker.record(admission, False) is None
    assert breaker.state is BreakerState.OPEN
    clock.now += 5
    assert breaker.state is BreakerState.HALF_OPEN


def test_deliveries_started_before_the_open_never_pass_for_probes() -> None:
    """Two deliveries admitted while closed finish after the pause: their successes do not
    close it (no probe ran), and saying nothing they free no probe's place."""
    breaker, clock, _ = make()
    early = [breaker.admit(), breaker.admit(), breaker.admit()]
    open_it(breaker)
    clock.now += 5
    assert breaker.state is BreakerState.HALF_OPEN
    probe = breaker.admit()
    assert probe is not None and probe.probe
    first, second, third = early
    assert first is not None and second is not None and third is not None
    assert breaker.record(first, False) is None
    assert breaker.record(second, False) is None
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit() is not None  # the second probe's place
    assert breaker.record(third, None) is None
    assert breaker.admit() is None  # two probes run: no third place


def test_half_open_admits_probes_and_closes_when_they_succeed() -> None:
    breaker, clock, moves = make()
    open_it(breaker)
    clock.now += 5
    first, second = breaker.admit(), breaker.admit()
    assert first is not None and second is not None
    assert not breaker.admit()  # probes=2
    assert breaker.record(first, False) is None
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record(second, False) is BreakerState.CLOSED
    assert breaker.admit()
    assert moves[-1] == (BreakerState.HALF_OPEN, BreakerState.CLOSED)
    # The window starts empty: the failures before the pause do not count again.
    for _ in range(3):
        decide(breaker, True)
    assert breaker.state is BreakerState.CLOSED


def test_a_failed_probe_opens_it_again_for_another_pause() -> None:
    breaker, clock, _ = make()
    open_it(breaker)
    clock.now += 5
    probe = breaker.admit()
    assert probe is not None
    assert breaker.record(probe, True) is BreakerState.OPEN
    assert breaker.opened == 2
    assert not breaker.admit()
    clock.now += 9.9  # the second pause is twice the first
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN


def test_each_failed_round_doubles_the_pause_up_to_max_pause_until_it_closes() -> None:
    breaker, clock, _ = make(Breaker(window=10, min_failures=4, pause=1.0, probes=1, max_pause=5))
    open_it(breaker)
    pauses = [breaker.pause]
    for _ in range(4):
        clock.now += breaker.pause
        probe = breaker.admit()
        assert probe is not None and probe.probe
        breaker.record(probe, True)
        pauses.append(breaker.pause)
    assert pauses == [1.0, 2.0, 4.0, 5.0, 5.0]
    clock.now += breaker.pause
    probe = breaker.admit()
    assert probe is not None
    assert breaker.record(probe, False) is BreakerState.CLOSED
    open_it(breaker)
    assert breaker.pause == 1.0  # closed in between: the first pause again
    assert Breaker(pause=3).longest_pause == 30


def test_an_overdue_delivery_runs_while_open_and_its_verdict_is_not_counted() -> None:
    breaker, clock, _ = make()
    open_it(breaker)
    assert breaker.admit() is None
    overdue = breaker.admit(overdue=True)
    assert overdue is not None and not overdue.probe
    clock.now += 5
    assert breaker.record(overdue, False) is None
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.record(Admission(overdue.epoch), True) is None


def test_a_probe_that_says_nothing_frees_its_slot() -> None:
    breaker, clock, _ = make()
    open_it(breaker)
    clock.now += 5
    first, second = breaker.admit(), breaker.admit()
    assert first is not None and second is not None
    assert not breaker.admit()
    breaker.record(first, None)  # a duplicate, or given back because the database is down
    assert breaker.admit()
    assert not breaker.admit()


def test_it_is_thread_safe() -> None:
    breaker, _, moves = make(Breaker(failure_rate=1.0, window=100, min_failures=100, pause=60))
    start = threading.Barrier(8)
    admitted = [[breaker.admit() for _ in range(50)] for _ in range(8)]

    def report(admissions: list[Admission | None]) -> None:
        start.wait()
        for admission in admissions:
            assert admission is not None
            breaker.record(admission, True)

    threads = [threading.Thread(target=report, args=(batch,)) for batch in admitted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    # 400 failures: it opened exactly once (the later ones are not counted while open).
    assert breaker.opened == 1
    assert moves == [(BreakerState.CLOSED, BreakerState.OPEN)]


# --------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("outcome", "verdict"),
    [
        (Acknowledge("processed"), False),
        (Acknowledge("dead_lettered", FailureReason.RETRIES_EXHAUSTED), True),
        (Acknowledge("dead_lettered", FailureReason.PERMANENT), True),
        (Acknowledge("dead_lettered", FailureReason.TIMEOUT), True),
        (ScheduleRetry(1.0, 2, error="RuntimeError: down"), True),
        (RetryInPlace(1.0, 2, error="RuntimeError: down"), True),
        (Acknowledge("duplicate"), None),
        (Acknowledge("expired"), None),
        (Acknowledge("dead_lettered", FailureReason.INVALID_JSON), None),
        (Acknowledge("dead_lettered", FailureReason.MISSING_MESSAGE_ID), None),
        (Acknowledge("dead_lettered", FailureReason.PARKED), None),
        (Acknowledge("dead_lettered", FailureReason.WORKER_CRASHED), None),
        (Acknowledge("dead_lettered", FailureReason.CONSUMER_ERROR), None),
        (Acknowledge("dead_lettered", FailureReason.DELIVERY_LIMIT), None),
        (ScheduleRetry(1.0, 1, error="lease held", deferred=True), None),
        (RetryInPlace(1.0, 1, error="lease held", deferred=True), None),
        (Release("stopping while the database is unavailable"), None),
    ],
)
def test_only_the_handlers_own_failures_count(outcome: object, verdict: bool | None) -> None:
    assert handler_verdict(outcome) is verdict  # type: ignore[arg-type]


# --------------------------------------------------------------------------- configuration


def test_breaker_for_reads_the_consumer_then_the_setting() -> None:
    registry = ConsumerRegistry()
    consumer("q.own", breaker=SMALL, registry=registry, name="own")(lambda m: None)
    consumer("q.off", breaker=False, registry=registry, name="off")(lambda m: None)
    consumer("q.default", registry=registry, name="default")(lambda m: None)
    specs = {spec.queue: spec for spec in registry.all()}
    with override_settings(RELIABLE_MESSAGING={}):
        assert breaker_for(specs["q.default"], messaging_settings) is None
        assert breaker_for(specs["q.own"], messaging_settings) == SMALL
    with override_settings(RELIABLE_MESSAGING={"BREAKER": {"window": 40, "min_failures": 8}}):
        assert breaker_for(specs["q.default"], messaging_settings) == Breaker(
            window=40, min_failures=8
        )
        assert breaker_for(specs["q.off"], messaging_settings) is None
        assert breaker_for(specs["q.own"], messaging_settings) == SMALL


def test_transitions_show_in_health_notes_and_log_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = ConsumerRegistry()
    consumer("q.paid", breaker=SMALL, registry=registry, name="shop.paid")(lambda m: None)
    health = HealthState()
    health.set_broker(True)
    clock = Clock()
    with override_settings(RELIABLE_MESSAGING={}):
        breakers = ConsumerBreakers(registry.all(), messaging_settings, health=health, clock=clock)
    breaker = breakers.get("shop.paid")
    assert breaker is not None
    with caplog.at_level(logging.INFO, logger="reliable_messaging.consuming.breaker"):
        for _ in range(20):
            decide(breaker, True)
        assert health.check()[0]  # a note, not a failure of liveness
        assert any("shop.paid open" in note for note in health.notes())
        clock.now += 5
        assert breaker.state is BreakerState.HALF_OPEN
        assert any("half-open" in note for note in health.notes())
        probes = [breaker.admit(), breaker.admit()]
        for probe in probes:
            assert probe is not None
            breaker.record(probe, False)
        assert health.notes() == []
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "INFO"]
    assert "4 of the last 4 deliveries failed" in lines[0][1]
    assert "for 5s" in lines[0][1]


def test_room_is_what_may_still_fail_before_it_opens() -> None:
    breaker, clock, _ = make()
    assert breaker.room() == 4
    decide(breaker, True)
    decide(breaker, False)
    assert breaker.room() == 3
    decide(breaker, True)
    decide(breaker, True)
    assert breaker.room() == 1  # at least one: a closed breaker always lets work through
    decide(breaker, True)
    assert breaker.state is BreakerState.OPEN
    assert breaker.room() == 0
    clock.now += 5
    assert breaker.room() == 0  # half-open: probes go one by one through admit()


@pytest.mark.parametrize(
    "value",
    [{"window": 3, "min_failures": 5}, {"pause": 0}, {"pauze": 30}, [0.5, 100], "on"],
)
def test_a_bad_breaker_setting_is_reported_by_a_system_check(value: object) -> None:
    from reliable_messaging.checks import check_settings

    with override_settings(RELIABLE_MESSAGING={"BREAKER": value}):
        ids = [message.id for message in check_settings()]
    assert ids == ["reliable_messaging.E053"]


@pytest.mark.parametrize("value", [None, {}, {"window": 40, "min_failures": 8, "pause": 5}])
def test_a_good_breaker_setting_passes_the_checks(value: object) -> None:
    from reliable_messaging.checks import check_settings

    with override_settings(RELIABLE_MESSAGING={"BREAKER": value}):
        assert check_settings() == []
