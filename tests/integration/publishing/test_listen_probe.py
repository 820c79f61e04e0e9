"""The relay's LISTEN probe against the real PostgreSQL, its clock moved by hand: a LISTEN that
never heard its probe (what a transaction pooler does) is given up for the rest of the process,
so a relay leaves at most one LISTEN on a pool's connections; one that heard before and then
missed a probe is tried again later."""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from reliable_messaging.publishing import listener
from reliable_messaging.publishing.listener import WakeUps
from tests.markers import postgresql_only

pytestmark = [pytest.mark.django_db(transaction=True), postgresql_only]


class Loop:
    def __init__(self) -> None:
        self.watched: dict[int, Callable[[], None]] = {}

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None:
        self.watched[fd] = callback

    def unwatch(self, fd: int) -> None:
        self.watched.pop(fd, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    # The listener module's clock only: psycopg and the rest keep the real one.
    monkeypatch.setattr(listener, "time", types.SimpleNamespace(monotonic=clock))
    return clock


def wake_ups(probes: list[str]) -> WakeUps:
    return WakeUps(
        "default", True, 1.0, send_probe=lambda using, token: probes.append(token), health=None
    )


def test_a_listen_that_never_heard_its_probe_is_given_up_for_the_process(clock: Clock) -> None:
    probes: list[str] = []
    wake = wake_ups(probes)
    loop = Loop()
    try:
        wake.look_after(loop, lambda: None)
        assert len(probes) == 1 and loop.watched  # a LISTEN opened, its probe sent
        assert not wake.listening  # not before the probe arrives
        clock.now += listener.PROBE_TIMEOUT + 1  # the probe never arrives (a pooler)
        wake.look_after(loop, lambda: None)
        assert not loop.watched and not wake.listening
        clock.now += listener.PROBE_INTERVAL * 3
        wake.look_after(loop, lambda: None)
        assert not loop.watched, "a fresh LISTEN was opened through what swallowed the first"
        assert len(probes) == 1
    finally:
        wake.close()


def test_a_listen_that_heard_before_and_missed_a_probe_is_tried_again(clock: Clock) -> None:
    probes: list[str] = []
    wake = wake_ups(probes)
    loop = Loop()
    woken: list[Any] = []
    try:
        wake.look_after(loop, lambda: woken.append(1))
        with psycopg.connect(listener.listen_conninfo("default"), autocommit=True) as other:
            other.execute(f"NOTIFY {listener.NOTIFY_CHANNEL}, '{probes[0]}'")
        (callback,) = loop.watched.values()
        for _ in range(100):  # the notification crosses the loopback: bounded wait
            callback()
            if wake.listening:
                break
            time.sleep(0.02)
        assert wake.listening and woken
        clock.now += listener.PROBE_INTERVAL + 1  # the next probe is due: sent, then lost
        wake.look_after(loop, lambda: None)
        assert len(probes) == 2
        clock.now += listener.PROBE_TIMEOUT + 1
        wake.look_after(loop, lambda: None)
        assert not loop.watched and not wake.listening
        clock.now += listener.PROBE_INTERVAL + 1
        wake.look_after(loop, lambda: None)
        assert loop.watched and len(probes) == 3, "no fresh LISTEN after a single miss"
    finally:
        wake.close()
