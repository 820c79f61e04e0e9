"""The whole pipeline under faults: steady traffic through publish() → relay → two consumers,
one fault kind per test, then the exactly-once verdict (see harness.py).

Every test checks the final state the same way: every message committed to the outbox took
effect exactly once in each consumer (``tests.alpha`` and ``tests.beta``), except those beta
must refuse for good, which are its dead letters and nothing else is; the transient failures
went through a retry; and no queue holds anything. The processes recover by themselves: the
test never restarts them, except after a ``kill -9``, where it does what a supervisor would.
Each service a test breaks is restored in a ``finally``.

The broker, PostgreSQL and Redis tests stop or block a shared service: run them alone, under
the exclusive lock (``flock -o /tmp/rm-services.lock .venv/bin/pytest tests/faults``;
tests/conftest.py marks them serial). The kill -9 tests and the one closing every connection of
the rig's own vhost break nothing shared: they run in the parallel part of ``make test``.
"""

from __future__ import annotations

import pytest

from tests import support
from tests.support import wait_until

from .harness import (
    HANDLER_SQL,
    RELAY_BATCH_SQL,
    FaultRig,
    broker_stopped,
    close_all_connections,
    log_count,
    memory_alarm,
    postgresql_stopped,
    redis_keys,
    redis_stopped,
    wait_log_count,
    with_slow_handlers,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def effects_so_far() -> int:
    from tests.testapp.models import Effect

    return Effect.objects.count()


def wait_for_more_effects(count: int, timeout: float = 60.0) -> None:
    target = effects_so_far() + count
    wait_until(
        lambda: effects_so_far() >= target,
        timeout=timeout,
        interval=0.2,
        message=f"{count} more effects",
    )


# --------------------------------------------------------------------------- crashes


def test_consumers_killed_mid_handler_again_and_again(rig: FaultRig) -> None:
    thresholds = (40, 110, 180, 250)
    # The kill comes while a handler runs, often a redelivered message that the process runs
    # alone under the crash guard; one caught in CRASH_LIMIT (3) of the kills was a dead letter
    # `worker_crashed` on a slow machine. The guard cannot tell the rig's kills from a
    # message's own (tests/faults/test_poison_pills.py tests it): here none can reach its limit.
    limit = {"RM_TEST_CRASH_LIMIT": str(len(thresholds) + 1)}
    with rig.starting_together():
        consumers = [rig.consumer("--concurrency", "2", **limit) for _ in range(2)]
        relay = rig.relay()
    traffic = rig.start_traffic(360, rate=30, payload=with_slow_handlers(every=5, seconds=0.15))
    for round_, threshold in enumerate(thresholds):
        traffic.wait_published(threshold)
        index = round_ % 2
        victim = consumers[index]
        # A handler of this very process is inside its transaction (effect written, not
        # committed, not acked): that is the instant to die.
        rig.wait_in_transaction(victim, HANDLER_SQL, timeout=30)
        rig.kill_9(victim)
        consumers[index] = rig.consumer(*victim.args, **limit)  # the supervisor starts it again
    rig.assert_exactly_once()
    rig.assert_still_running(relay, *consumers)


def test_relay_killed_mid_batch_again_and_again(rig: FaultRig) -> None:
    # The relay killed is the only one sending: a consumer's relay beside its handlers would
    # take the rows it restarts to (and, once the traffic is over, every row before it starts).
    with rig.starting_together():
        consumers = [rig.consumer("--no-relay"), rig.consumer("--no-relay")]
        relay = rig.relay("--batch-size", "10")
    traffic = rig.start_traffic(400, rate=40)
    for threshold in (50, 150, 250):
        traffic.wait_published(threshold)
        # The relay holds its claim's transaction open until the batch's confirms are in: a
        # kill now leaves rows on the broker that are still pending in the outbox.
        rig.wait_in_transaction(relay, RELAY_BATCH_SQL, timeout=30)
        rig.kill_9(relay)
        relay = rig.relay(*relay.args)  # the supervisor starts it again
    rig.assert_exactly_once()
    rig.assert_still_running(relay, *consumers)


# --------------------------------------------------------------------------- RabbitMQ


def test_broker_restarted_twice_everyone_reconnects_by_themselves(rig: FaultRig) -> None:
    with rig.starting_together():
        consumers = [rig.consumer(), rig.consumer()]
        relay = rig.relay()
    traffic = rig.start_traffic(450, rate=30, payload=with_slow_handlers(every=5, seconds=0.1))
    for restart, threshold in enumerate((60, 240), start=1):
        traffic.wait_published(threshold)
        with broker_stopped():
            # Publishing goes on meanwhile: the rows wait in the outbox.
            traffic.wait_published(traffic.published + 30)
        # Work flows again without anyone touching the processes.
        wait_for_more_effects(20)
        # Everyone is back before the next stop: a process whose reconnect backoff falls
        # outside a short window between two restarts would otherwise skip one.
        for consumer in consumers:
            wait_log_count(consumer, "consuming ", restart + 1)
        wait_log_count(relay, "relay: publishing the outbox", restart + 1)
    rig.assert_exactly_once(timeout=150)
    rig.assert_still_running(relay, *consumers)
    for consumer in consumers:
        assert consumer.log().count("lost or refused") >= 2, consumer.log()
        assert consumer.log().count("consuming ") >= 3  # the first time, then once per restart
    assert relay.log().count("relay: publishing the outbox") >= 3, relay.log()


def test_broker_closes_every_connection_while_acks_are_in_flight(rig: FaultRig) -> None:
    with rig.starting_together():
        consumers = [rig.consumer(), rig.consumer()]
        relay = rig.relay()
    traffic = rig.start_traffic(360, rate=30, payload=with_slow_handlers(every=3, seconds=0.2))
    for round_, threshold in enumerate((50, 130, 210)):
        # Everyone is back on the broker since the last close (or there would be nothing to
        # close), and traffic has flowed meanwhile.
        for consumer in consumers:
            wait_log_count(consumer, "consuming ", round_ + 1)
        wait_log_count(relay, "relay: publishing the outbox", round_ + 1)
        traffic.wait_published(threshold)
        # A handler is running: its commit comes after the close, and its ack has nowhere to go.
        rig.wait_in_transaction(consumers[round_ % 2], HANDLER_SQL, timeout=30)
        close_all_connections(rig.vhost)
    rig.assert_exactly_once()
    rig.assert_still_running(relay, *consumers)
    for consumer in consumers:
        assert consumer.log().count("lost or refused") >= 3, consumer.log()
    assert relay.log().count("relay: publishing the outbox") >= 4, relay.log()


def test_publishers_blocked_by_a_memory_alarm_then_released(rig: FaultRig) -> None:
    with rig.starting_together():
        consumers = [rig.consumer(), rig.consumer()]
        relay = rig.relay()
    # Traffic for 30 s: it must still be writing rows once the alarm is on, which takes a few
    # rabbitmqctl calls (seconds each on a loaded host), for the relay to publish into it.
    traffic = rig.start_traffic(900, rate=30)
    traffic.wait_published(60)
    with memory_alarm():
        # The relay's connection is blocked as soon as it publishes, or the broker tells the relay
        # first (connection.blocked goes to connections that published before) and it claims
        # nothing more, its connection staying "blocking"; either way the rows pile up.
        wait_until(
            lambda: (
                "blocked" in connection_states(rig.vhost)
                or "the broker blocked the connection" in relay.log()
            ),
            timeout=60,  # generous: on a loaded host the relay's next batch can come late
            interval=0.2,
            message=lambda: (
                f"a blocked relay; states: {connection_states(rig.vhost)}; the relay's log:\n"
                f"{relay.log()[-3000:]}"
            ),
        )
        traffic.wait_published(traffic.published + 45)
    rig.assert_exactly_once()
    rig.assert_still_running(relay, *consumers)


def connection_states(vhost: str) -> list[str]:
    out = support.rabbitmqctl("list_connections", "-p", vhost, "state", "--no-table-headers")
    return [line.strip() for line in out.splitlines() if line.strip()]


# --------------------------------------------------------------------------- PostgreSQL, Redis


def test_postgresql_restarted_mid_run(rig: FaultRig) -> None:
    with rig.starting_together():
        consumers = [rig.consumer(), rig.consumer()]
        relay = rig.relay()
    traffic = rig.start_traffic(300, rate=30, payload=with_slow_handlers(every=5, seconds=0.1))
    traffic.wait_published(90)
    with postgresql_stopped():
        wait_until(
            lambda: traffic.database_errors >= 5 and "database unavailable" in relay.log(),
            timeout=30,
            interval=0.2,
            message="the traffic and the relay running into the outage",
        )
    rig.assert_exactly_once(timeout=150)
    rig.assert_still_running(relay, *consumers)


def test_redis_stopped_and_started_mid_run(rig: FaultRig) -> None:
    # RM_TEST_CACHE_ALIAS turns the Redis duplicate fast path on; the duplicates on the wire
    # are what it is for. The outcome must not depend on Redis at all. Redis comes back empty
    # (nothing is saved), so this is also the "flushed mid-run" case.
    with rig.starting_together():
        consumers = [rig.consumer(RM_TEST_CACHE_ALIAS="messaging") for _ in range(2)]
        relay = rig.relay()
    fast_path = all("duplicate fast path in cache" in c.log() for c in consumers)
    assert fast_path, consumers[0].log()
    traffic = rig.start_traffic(360, rate=30, duplicate_every=5)
    traffic.wait_published(80)
    with redis_stopped():
        traffic.wait_published(traffic.published + 60)
    if fast_path:
        # Redis came back empty (nothing is saved): once the consumers use it again by
        # themselves, keys of this test's namespace reappear.
        wait_until(
            lambda: redis_keys(f"rmtest.{rig.ns}:*") > 0,
            timeout=45,
            interval=0.5,
            message="the fast path writing to Redis again",
        )
    traffic.wait_published(traffic.published + 30)  # and traffic after it is back
    rig.assert_exactly_once()
    rig.assert_still_running(relay, *consumers)
    if fast_path:
        # The consumers noticed Redis going away and went on without it.
        assert log_count(consumers, "duplicate fast path: cannot") >= 1
