"""The broker acting on its own under a running ``manage.py consume`` (issue 11: every delivery
reaches an outcome).

Each test runs real consume processes in a vhost of its own (the ``rig`` fixture) and makes the
broker do what it does in production without asking us:

- close a consuming channel with ``406 PRECONDITION_FAILED`` (what ``consumer_timeout`` does to
  a delivery held unacked too long), with a handler in flight, and while nothing may subscribe;
- cancel a consumer because its queue was deleted (and is expected back);
- hand an ordered partition to the standby process while the active one stops gracefully;
- drop a message off a quorum queue at its ``x-delivery-limit``.

The user's outcome is what is checked: every message handled once (one ``Effect`` row) or kept
as a dead letter, queues drained, the process still running, and ``/healthz`` saying so while it
cannot consume. See broker_api.py for how the broker is made to act.
"""

from __future__ import annotations

import collections
import json
import signal
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import pytest

from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.models import DeadLetter
from tests import support
from tests.integration.ops.conftest import http_json
from tests.support import ConsumeProcess, Publisher, wait_until
from tests.testapp.models import Effect

from . import broker_api
from .harness import HANDLER_SQL, ROUTING_KEY, FaultRig

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

# tests/settings.py logs "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s".
WARNING = " WARNING reliable_messaging"
RECEIVED = "reliable_messaging_consumer_received_total"


# --------------------------------------------------------------------------- helpers


def tail(proc: ConsumeProcess, chars: int = 4000) -> str:
    return f"--- consume pid {proc.pid} rc={proc.returncode} log (tail) ---\n{proc.log()[-chars:]}"


def warnings_in(proc: ConsumeProcess) -> int:
    return proc.log().count(WARNING)


class HealthWatch:
    """``/healthz`` of a consume process, polled every 20 ms from a thread while in the
    ``with``: the answers in order, so a short unhealthy spell is not missed."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/healthz"
        self.seen: list[tuple[float, int | None, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="rm-healthz-watch", daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status, body = http_json(self.url)
            except (OSError, ValueError) as exc:  # not listening (yet, or any more)
                status, body = None, repr(exc)
            self.seen.append((time.monotonic(), status, body))
            self._stop.wait(0.02)

    def status(self) -> int | None:
        return self.seen[-1][1] if self.seen else None

    def unhealthy_seen(self, since: float = 0.0) -> bool:
        return any(status != 200 for at, status, _ in self.seen if at >= since)

    def summary(self) -> str:
        """The answers as runs: ``200 x40, 503 {...} x12, 200 x3``."""
        runs: list[list[Any]] = []
        for _, status, body in list(self.seen):
            if runs and runs[-1][0] == (status, json.dumps(body, sort_keys=True)):
                runs[-1][1] += 1
            else:
                runs.append([(status, json.dumps(body, sort_keys=True)), 1])
        return ", ".join(f"{status} {body} x{count}" for (status, body), count in runs) or "none"


def wait_healthy(port: int, proc: ConsumeProcess, timeout: float = 30.0) -> None:
    url = f"http://127.0.0.1:{port}/healthz"

    def healthy() -> bool:
        try:
            return http_json(url) == (200, {"status": "ok"})
        except (OSError, ValueError):
            return False

    wait_until(
        healthy,
        timeout=timeout,
        interval=0.1,
        message=lambda: f"/healthz ok on port {port}\n{tail(proc)}",
    )


def effects_of(message_ids: Iterable[str], label: str = "alpha") -> dict[str, int]:
    counts = collections.Counter(
        Effect.objects.filter(consumer=label, message_id__in=list(message_ids)).values_list(
            "message_id", flat=True
        )
    )
    return {message_id: counts.get(message_id, 0) for message_id in message_ids}


def wait_handled_once(
    message_ids: list[str],
    queues: list[str],
    rig: FaultRig,
    proc: ConsumeProcess,
    health: HealthWatch | None = None,
    label: str = "alpha",
    timeout: float = 30.0,
) -> None:
    """Wait until each message took effect and ``queues`` hold nothing, then: once each."""

    def done() -> bool:
        return all(effects_of(message_ids, label).values()) and support.drained(
            *queues, vhost=rig.vhost
        )

    def why() -> str:
        counts = effects_of(message_ids, label)
        missing = [m for m, n in counts.items() if not n]
        queue_state = {q: support.queue_counts(q, rig.vhost) for q in queues}
        seen = f"\n/healthz answers: {health.summary()}" if health else ""
        return (
            f"{len(message_ids) - len(missing)}/{len(message_ids)} messages handled (missing "
            f"{missing}); queues (ready, unacked): {queue_state}{seen}\n{tail(proc)}"
        )

    wait_until(done, timeout=timeout, interval=0.2, message=why)
    doubled = {m: n for m, n in effects_of(message_ids, label).items() if n != 1}
    assert not doubled, f"messages that took effect more than once: {doubled}\n{tail(proc)}"


def close_consuming_channel(rig: FaultRig, queue: str, proc: ConsumeProcess) -> list[str]:
    """The broker closes (406) the channel(s) consuming ``queue``; returns once the client
    answered the ``channel.close`` (the channel process ended)."""
    closed = broker_api.fail_consuming_channels(rig.vhost, queue)
    assert closed, f"no channel consumes {queue} in vhost {rig.vhost}\n{tail(proc)}"
    wait_until(
        lambda: not broker_api.alive(closed),
        timeout=15,
        interval=0.1,
        message=lambda: f"the broker to close channel(s) {closed} of {queue}\n{tail(proc)}",
    )
    return closed


# --------------------------------------------------------------------------- channel closed (406)


def test_a_channel_the_broker_closes_mid_handler_is_noticed_and_nothing_is_lost(
    rig: FaultRig,
) -> None:
    """The broker closes the consuming channel (406, as ``consumer_timeout`` does) while a
    handler runs. The process notices (a warning), consumes again, and every message, the one
    in flight and those published after, takes effect exactly once."""
    alpha = rig.queues["alpha"]
    proc = rig.consumer("--queue", alpha, "--metrics-port", "0")
    port = proc.ops_port()
    wait_healthy(port, proc)
    publisher = Publisher(rig.vhost)
    try:
        in_flight = publisher.publish(rig.exchange, ROUTING_KEY, {"sleep": {"alpha": 1.5}})
        assert in_flight is not None
        rig.wait_in_transaction(proc, HANDLER_SQL, timeout=20)
        warned_before = warnings_in(proc)
        with HealthWatch(port) as health:
            close_consuming_channel(rig, alpha, proc)
            later = [publisher.publish(rig.exchange, ROUTING_KEY, {"n": n}) for n in range(5)]
            ids = [in_flight, *[m for m in later if m is not None]]
            wait_handled_once(ids, [alpha], rig, proc, health)
            wait_healthy(port, proc)
        rig.assert_still_running(proc)
        assert warnings_in(proc) > warned_before, (
            f"the closed channel was not reported (no WARNING line since)\n{tail(proc)}"
        )
    finally:
        publisher.close()


def test_healthz_is_unhealthy_while_the_broker_keeps_the_consumer_off(rig: FaultRig) -> None:
    """The broker closes the consuming channel (406) and, for a while, refuses every new
    subscription (403: no read permission in the vhost). Meanwhile ``/healthz`` says unhealthy
    and stays so; once the broker takes subscriptions again it is healthy again and the
    messages published meanwhile take effect once each."""
    alpha = rig.queues["alpha"]
    proc = rig.consumer("--queue", alpha, "--metrics-port", "0")
    port = proc.ops_port()
    wait_healthy(port, proc)
    publisher = Publisher(rig.vhost)
    try:
        with HealthWatch(port) as health:
            with broker_api.reads_refused(rig.vhost):
                close_consuming_channel(rig, alpha, proc)
                ids = [publisher.publish(rig.exchange, ROUTING_KEY, {"n": n}) for n in range(3)]
                wait_until(
                    lambda: health.status() == 503,
                    timeout=15,
                    interval=0.05,
                    message=lambda: (
                        f"/healthz 503 after the broker closed the consuming channel and "
                        f"refuses to let it subscribe again; answers: {health.summary()}\n"
                        f"{tail(proc)}"
                    ),
                )
                unhealthy_from = time.monotonic()
                time.sleep(2.0)  # nothing can subscribe: it must not look healthy meanwhile
                window = [s for at, s, _ in list(health.seen) if at >= unhealthy_from]
                assert window and 200 not in window, (
                    f"/healthz said ok while no subscription was possible: {health.summary()}\n"
                    f"{tail(proc)}"
                )
                rig.assert_still_running(proc)
            wait_healthy(port, proc)
            wait_handled_once([m for m in ids if m], [alpha], rig, proc, health)
        rig.assert_still_running(proc)
    finally:
        publisher.close()


# --------------------------------------------------------------------------- basic.cancel


def test_a_queue_deleted_under_the_consumer_is_declared_again_and_consumed(
    rig: FaultRig,
) -> None:
    """The queue is deleted while consume runs (the broker cancels its consumer). The process
    notices, declares the queue again and consumes it: what is published to it afterwards takes
    effect once each, and the process said something was wrong meanwhile."""
    alpha = rig.queues["alpha"]
    proc = rig.consumer("--queue", alpha, "--metrics-port", "0")
    port = proc.ops_port()
    wait_healthy(port, proc)
    publisher = Publisher(rig.vhost)
    try:
        warned_before = warnings_in(proc)
        with HealthWatch(port) as health:
            broker_api.delete_queue(rig.vhost, alpha)
            wait_until(
                lambda: broker_api.queue_consumers(rig.vhost).get(alpha, 0) >= 1,
                timeout=30,
                interval=0.3,
                message=lambda: (
                    f"{alpha} declared again and consumed after the broker cancelled the "
                    f"consumer (queue deleted); queues and their consumers now: "
                    f"{broker_api.queue_consumers(rig.vhost)}; /healthz answers: "
                    f"{health.summary()}\n{tail(proc)}"
                ),
            )
            ids = [publisher.publish(rig.exchange, ROUTING_KEY, {"n": n}) for n in range(5)]
            wait_handled_once([m for m in ids if m], [alpha], rig, proc, health)
            wait_healthy(port, proc)
        rig.assert_still_running(proc)
        assert health.unhealthy_seen() or warnings_in(proc) > warned_before, (
            f"the cancelled consumer went unreported: /healthz never unhealthy "
            f"({health.summary()}) and no WARNING line\n{tail(proc)}"
        )
    finally:
        publisher.close()


# --------------------------------------------------------------------------- ordered hand-over


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_an_ordered_partition_handed_to_the_standby_on_sigterm_keeps_key_order(
    rig: FaultRig, queue_type: str
) -> None:
    """Two processes on the ordered consumer tests.gamma: the first holds every partition
    (single active consumer), the second stands by. The first is stopped gracefully mid-stream:
    the standby takes over, and every key's messages still first take effect in ``seq`` order,
    once each. A small prefetch leaves messages ready beyond the stopping process's window, so
    the standby has something to take the moment it becomes active. A close handshake would
    have RabbitMQ 4.0 activate the standby before it requeues what the first held. On quorum
    queues a nack from the stopping process (its workers give back what they hold as soon as
    the stop is asked for) would hand the message straight back to it, behind a later one of
    its key, and the drop would return them to the standby in that order."""
    gamma = f"{rig.ns}.gamma"
    args = ["--queue", gamma, "--concurrency", "2"]
    env = {"RM_TEST_PREFETCH": "10", "RM_TEST_QUEUE_TYPE": queue_type}
    active = rig.consumer(*args, **env)
    standby = rig.consumer(*args, **env)
    keys = [f"k{n}" for n in range(6)]
    per_key = 30
    ids: dict[str, list[str]] = collections.defaultdict(list)
    publisher = Publisher(rig.vhost)
    try:
        for seq in range(per_key):
            for key in keys:
                message_id = publisher.publish(
                    rig.exchange,
                    f"seq.{key}",
                    {"key": key, "seq": seq, "sleep": {"gamma": 0.03}},
                    headers={ORDERING_KEY_HEADER: key},
                )
                assert message_id is not None
                ids[key].append(message_id)
    finally:
        publisher.close()
    total = len(keys) * per_key
    wait_until(
        lambda: Effect.objects.filter(consumer="gamma").count() >= 30,
        timeout=30,
        message=lambda: f"30 gamma effects before the SIGTERM\n{tail(active)}",
    )
    active.send(signal.SIGTERM)
    assert active.wait(45) == 0, tail(active)

    def backlog() -> dict[str, tuple[int, int]]:
        return {q: c for q, c in support.all_queue_counts(rig.vhost).items() if q.startswith(gamma)}

    wait_until(
        lambda: (
            Effect.objects.filter(consumer="gamma").values("message_id").distinct().count() >= total
            and not any(sum(c) for c in backlog().values())
        ),
        timeout=60,
        interval=0.2,
        message=lambda: (
            f"all {total} messages handled by the standby; backlog {backlog()}\n"
            f"{tail(active)}\n{tail(standby)}"
        ),
    )
    first_seqs: dict[str, list[int]] = collections.defaultdict(list)
    seen: set[str] = set()
    for message_id, payload in (
        Effect.objects.filter(consumer="gamma").order_by("id").values_list("message_id", "payload")
    ):
        if message_id not in seen and isinstance(payload, dict):
            seen.add(message_id)
            first_seqs[payload["key"]].append(payload["seq"])
    broken = {key: first_seqs[key] for key in keys if first_seqs[key] != list(range(per_key))}
    assert not broken, (
        f"keys whose messages first took effect out of seq order across the hand-over: "
        f"{broken}\n{tail(active)}\n{tail(standby)}"
    )
    doubled = {
        m: n
        for key in keys
        for m, n in effects_of(ids[key], "gamma").items()
        if n != 1  # (an effect rolls back with a failed attempt: one row per message)
    }
    assert not doubled, f"messages that took effect more than once: {doubled}"
    assert "consumer=tests.gamma" in standby.log(), f"the standby took nothing\n{tail(standby)}"
    rig.assert_still_running(standby)


# --------------------------------------------------------------------------- quorum delivery limit


def test_a_message_past_the_quorum_delivery_limit_becomes_a_dead_letter(rig: FaultRig) -> None:
    """On a quorum queue with ``x-delivery-limit`` 2, a message returned three times is taken
    off the queue by the broker. It must not vanish: consume keeps it as a dead letter with
    reason ``delivery_limit`` and its raw body. (Another client returns it here, so the crash
    guard never sees it first.)"""
    alpha = rig.queues["alpha"]
    env = {"RM_TEST_QUEUE_TYPE": "quorum", "RM_TEST_QUORUM_DELIVERY_LIMIT": "2"}
    declaring = rig.consumer("--queue", alpha, **env)  # declares the quorum queue, as it wants
    declaring.send(signal.SIGTERM)
    assert declaring.wait(30) == 0, tail(declaring)
    body = json.dumps({"n": 1, "note": "returned past the delivery limit"}).encode()
    publisher = Publisher(rig.vhost)
    try:
        message_id = publisher.publish(rig.exchange, ROUTING_KEY, body=body)
    finally:
        publisher.close()
    returned = return_until_gone(rig.vhost, alpha, most=10)
    assert returned <= 4, f"still on {alpha} after {returned} returns: no delivery limit?"
    proc = rig.consumer("--queue", alpha, **env)

    def letter() -> DeadLetter | None:
        return DeadLetter.objects.filter(consumer="tests.alpha", reason="delivery_limit").first()

    wait_until(
        letter,
        timeout=30,
        interval=0.2,
        message=lambda: (
            f"a dead letter (tests.alpha, delivery_limit) for message_id={message_id} returned "
            f"{returned} times; dead letters now "
            f"{list(DeadLetter.objects.values_list('consumer', 'message_id', 'reason'))}; "
            f"queues {support.all_queue_counts(rig.vhost)}\n{tail(proc)}"
        ),
    )
    found = letter()
    assert found is not None
    assert bytes(found.body) == body, (found.message_id, bytes(found.body))
    assert not Effect.objects.filter(message_id=message_id).exists()
    rig.assert_still_running(proc)


def return_until_gone(vhost: str, queue: str, most: int) -> int:
    """Take the message on ``queue`` with a plain client and return it as failed (reject,
    requeue) until the broker stops giving it back; how many times it was returned. (RabbitMQ
    4.3 no longer counts a ``basic.nack`` with requeue toward the delivery limit.)"""
    connection = support.broker_connection(vhost, name="rm-tests returner")
    returned = 0
    try:
        channel = connection.channel()
        for _ in range(most):
            method = None
            deadline = time.monotonic() + 2.0  # a requeue on a quorum queue is a Raft command
            while method is None and time.monotonic() < deadline:
                method, _, _ = channel.basic_get(queue)
                if method is None:
                    time.sleep(0.05)
            if method is None or method.delivery_tag is None:
                break
            channel.basic_reject(method.delivery_tag, requeue=True)
            returned += 1
    finally:
        connection.close()
    return returned
