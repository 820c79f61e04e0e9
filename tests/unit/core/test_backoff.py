"""The one capped exponential every growing wait uses (reliable_messaging.core.backoff)."""

from __future__ import annotations

from reliable_messaging.core.backoff import Backoff, exponential
from reliable_messaging.core.breaker import Breaker
from reliable_messaging.publishing.sent import resend_backoff


def test_every_growing_wait_is_the_one_capped_exponential() -> None:
    assert [exponential(0.5, step, 3.0) for step in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert exponential(1.0, 10**6, 60.0) == 60.0  # no overflow however long it lasts
    assert [resend_backoff(n).total_seconds() for n in (1, 2, 3, 10, 100)] == [1, 2, 4, 300, 300]
    assert [Breaker(pause=1.0, max_pause=5).pause_after(n) for n in range(5)] == [1, 2, 4, 5, 5]


def test_backoff_grows_to_its_maximum_with_jitter_and_starts_over_when_reset() -> None:
    backoff = Backoff(initial=1.0, maximum=4.0)
    waits = [backoff.next() for _ in range(5)]
    for wait, base in zip(waits, [1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert 0.8 * base <= wait <= 1.2 * base
    backoff.reset()
    assert 0.8 <= backoff.next() <= 1.2
