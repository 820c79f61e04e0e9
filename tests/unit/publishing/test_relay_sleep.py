"""The relay's wait between reconnects survives a clock that moves past its end between the
check and the sleep (a loaded host): CI met a relay that died of a negative sleep while the
broker was down."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest

from reliable_messaging.publishing import relay


def test_a_wait_ending_between_the_check_and_the_sleep_never_sleeps_a_negative_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # end = 0 + 1; the check reads 0.9 (not over), the sleep's read 1.1, the next check 1.2.
    readings: Iterator[float] = iter([0.0, 0.9, 1.1, 1.2])
    slept: list[float] = []
    beats: list[None] = []
    owner = types.SimpleNamespace(
        _stop_requested=False, health=types.SimpleNamespace(heartbeat=lambda: beats.append(None))
    )
    with monkeypatch.context() as patched:  # the clock is ours for this call only
        patched.setattr(relay.time, "monotonic", lambda: next(readings))
        patched.setattr(relay.time, "sleep", slept.append)
        relay.OutboxRelay._sleep(owner, 1.0)  # type: ignore[arg-type]
    assert slept == [0.0]
    assert len(beats) == 1
