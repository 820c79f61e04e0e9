"""The retry policy is a pure function of the attempt, the delays and the exception."""

from __future__ import annotations

import pytest

from reliable_messaging import PermanentError
from reliable_messaging.consuming.retries import GiveUp, RetryLater, decide
from reliable_messaging.core.backoff import Backoff
from reliable_messaging.core.delays import delay_for
from reliable_messaging.core.outcomes import FailureReason

DELAYS = (1.0, 5.0, 30.0)


@pytest.mark.parametrize(
    ("attempt", "expected"), [(1, 1.0), (2, 5.0), (3, 30.0), (4, 30.0), (50, 30.0)]
)
def test_delay_for_uses_the_nth_delay_and_repeats_the_last(attempt: int, expected: float) -> None:
    assert delay_for(attempt, DELAYS) == expected


def test_decide_retries_with_the_next_attempt_number() -> None:
    assert decide(RuntimeError("x"), attempt=1, max_attempts=4, delays=DELAYS) == RetryLater(1.0, 2)
    assert decide(KeyError("x"), attempt=2, max_attempts=4, delays=DELAYS) == RetryLater(5.0, 3)
    assert decide(ValueError(), attempt=3, max_attempts=4, delays=DELAYS) == RetryLater(30.0, 4)


def test_decide_gives_up_when_attempts_are_exhausted() -> None:
    assert decide(RuntimeError(), attempt=4, max_attempts=4, delays=DELAYS) == GiveUp(
        FailureReason.RETRIES_EXHAUSTED
    )
    # A redelivery past the limit (e.g. a policy lowered meanwhile) also gives up.
    assert decide(RuntimeError(), attempt=9, max_attempts=4, delays=DELAYS) == GiveUp(
        "retries_exhausted"
    )


def test_max_attempts_one_means_no_retry() -> None:
    assert decide(RuntimeError(), attempt=1, max_attempts=1, delays=DELAYS) == GiveUp(
        "retries_exhausted"
    )


def test_no_delays_means_no_retry() -> None:
    assert decide(RuntimeError(), attempt=1, max_attempts=5, delays=()) == GiveUp(
        "retries_exhausted"
    )


def test_permanent_error_gives_up_at_once_whatever_the_attempt() -> None:
    for attempt in (1, 2, 10):
        assert decide(
            PermanentError("no"), attempt=attempt, max_attempts=5, delays=DELAYS
        ) == GiveUp(FailureReason.PERMANENT)


def test_subclass_of_permanent_error_is_permanent() -> None:
    class CardDeclined(PermanentError):
        pass

    assert decide(CardDeclined(), attempt=1, max_attempts=5, delays=DELAYS) == GiveUp("permanent")


def test_backoff_grows_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial=1.0, maximum=4.0, factor=2.0)
    waits = [backoff.next() for _ in range(6)]
    for wait, base in zip(waits, [1, 2, 4, 4, 4, 4], strict=True):
        assert base * 0.8 <= wait <= base * 1.2
    backoff.reset()
    assert 0.8 <= backoff.next() <= 1.2
