"""``consume``'s ``/healthz`` covers the relay it runs beside its handlers: retry copies wait in
the outbox for a relay, so a consumer whose relay died must not say it is healthy."""

from __future__ import annotations

import pytest

from reliable_messaging.core.liveness import HealthState
from reliable_messaging.management.relay_beside import RelayBeside
from tests.support import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_consumer_whose_relay_stopped_is_not_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    beside = RelayBeside()

    def dies() -> None:
        raise RuntimeError("the relay's bug")

    monkeypatch.setattr(beside.relay, "run", dies)
    health = HealthState()
    health.set_broker(True)
    health.add_problem_source(beside.problems)
    beside.start()
    try:
        wait_until(lambda: not beside._thread.is_alive(), timeout=10, message="the relay died")
        healthy, reasons = health.check()
        assert not healthy
        assert reasons == [
            "the relay beside the handlers stopped: the outbox waits for another relay"
        ], reasons
    finally:
        beside.stop()
    assert beside.problems() == [], "a relay stopped with its consumer is no problem"


def test_what_the_relay_notes_shows_on_the_consumers_healthz() -> None:
    """A broker alarm blocking the relay's publishing is a note of the consumer's too (it does
    not fail the check: the handlers go on), as the retry copies wait for that relay."""
    beside = RelayBeside()
    health = HealthState()
    health.set_broker(True)
    health.add_note_source(beside.notes)
    beside.relay.health.note("blocked", "the broker blocks publishing (low on memory)")
    assert health.check() == (True, [])
    assert health.notes() == [
        "the relay beside the handlers: the broker blocks publishing (low on memory)"
    ]
