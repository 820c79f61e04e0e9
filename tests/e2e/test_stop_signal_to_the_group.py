"""Every long-lived command stops under ``SIGTERM`` to its whole process group as it does under
``SIGTERM`` to its pid: within the documented grace (``SHUTDOWN_TIMEOUT``), exit code 0, nothing
lost.

systemd's default ``KillMode=control-group`` (and ``kill -TERM -<pgid>``) signals every process
of the unit at once, so a child the command started gets the signal too: the relay's
dead-letter operations process (``dead_letters/operation_process.py``) did, and the relay then
waited for it forever. Each command runs in its own session here (``ManageProcess`` starts it
with ``start_new_session=True``), with work in flight when the signal comes.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from django.conf import settings
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from tests.conftest import subprocess_env
from tests.support import (
    ConsumeProcess,
    ManageProcess,
    Publisher,
    RelayProcess,
    broker_connection,
    queue_counts,
    wait_until,
)
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# What docs/deploy.md asks of a supervisor: a stop timeout longer than SHUTDOWN_TIMEOUT.
GRACE = float(settings.RELIABLE_MESSAGING["SHUTDOWN_TIMEOUT"])  # type: ignore[arg-type]

ROWS = 3000


def stop(process: ManageProcess, target: str) -> tuple[int, float]:
    """SIGTERM to the process's group (as systemd sends it) or to its pid; its exit code and
    how long it took, or a failure once the grace is over."""
    started = time.monotonic()
    if target == "group":
        os.killpg(os.getpgid(process.pid), signal.SIGTERM)
    else:
        os.kill(process.pid, signal.SIGTERM)
    code = process.wait(GRACE)
    return code, time.monotonic() - started


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:  # not there yet, or gone
        pass
    return 0


def operations_process_running(relay: RelayProcess) -> bool:
    """The relay's dead-letter operations child is up and looking for work (its runner thread
    started beside its main thread, which then waits for the relay's stop)."""
    if relay.returncode is not None:
        raise AssertionError(f"relay exited with {relay.returncode}:\n{relay.log()}")
    return any(threads(child) >= 2 for child in children(relay.pid))


def message_ids_on(queue: str) -> Counter[str]:
    """Every message on ``queue`` by message_id, taken off it."""
    found: Counter[str] = Counter()
    connection = broker_connection(name="rm-tests drain")
    try:
        channel = connection.channel()
        for method, properties, _ in channel.consume(queue, inactivity_timeout=1.0):
            if method is None or properties is None:
                break
            found[str(properties.message_id)] += 1
            channel.basic_ack(int(method.delivery_tag or 0))
        channel.cancel()
    finally:
        connection.close()
    return found


@pytest.mark.parametrize("target", ["group", "pid"])
def test_relay_stops_within_the_grace_with_every_row_sent_once_or_pending(
    ns: str,
    rm_settings: dict,
    processes: list[ManageProcess],
    tmp_path: Path,
    target: str,
) -> None:
    relay = RelayProcess(["--batch-size", "20"], subprocess_env(ns), tmp_path / "relay.log")
    processes.append(relay)
    wait_until(
        lambda: operations_process_running(relay),
        timeout=30,
        interval=0.05,
        message="the relay's dead-letter operations process",
    )
    # A backlog committed now wakes the relay; the signal comes while it works through it.
    with transaction.atomic():
        ids = [publish("order.placed", {"n": n}) for n in range(ROWS)]
    wait_until(
        lambda: OutboxMessage.objects.filter(status=OutboxStatus.SENT).exists(),
        timeout=30,
        interval=0.01,
        message="the relay sending",
    )

    code, took = stop(relay, target)

    assert code == 0, relay.log()
    assert "received SIGTERM" in relay.log()
    print(f"relay exited {took:.2f}s after SIGTERM to its {target}")
    sent = set(
        OutboxMessage.objects.filter(status=OutboxStatus.SENT).values_list("message_id", flat=True)
    )
    pending = set(
        OutboxMessage.objects.filter(status=OutboxStatus.PENDING).values_list(
            "message_id", flat=True
        )
    )
    assert sent | pending == set(ids) and not sent & pending
    print(f"{len(sent)} row(s) sent, {len(pending)} left pending")
    # Each row marked sent is on the queue once; none still pending went out.
    assert message_ids_on(f"{ns}.alpha") == Counter(sent)


@pytest.mark.parametrize("target", ["group", "pid"])
def test_consume_stops_within_the_grace_with_every_message_handled_once(
    consume, ns: str, publisher: Publisher, target: str
) -> None:
    proc: ConsumeProcess = consume(
        "--queue", f"{ns}.alpha", "--concurrency", "2", "--progress-interval", "0"
    ).wait_consuming()
    ids = [
        publisher.publish(f"rmtest.{ns}", "order.placed", {"sleep": {"alpha": 0.3}})
        for _ in range(20)
    ]
    wait_until(
        lambda: Effect.objects.filter(consumer="alpha").exists(),
        timeout=30,
        interval=0.02,
        message="handlers at work",
    )

    code, took = stop(proc, target)

    assert code == 0, proc.log()
    assert "stopped gracefully" in proc.log()
    print(f"consume exited {took:.2f}s after SIGTERM to its {target}")
    handled = Counter(Effect.objects.filter(consumer="alpha").values_list("message_id", flat=True))
    assert all(count == 1 for count in handled.values()), handled
    # What it did not handle is back on the queue: a second consume handles it, once.
    wait_until(lambda: queue_counts(f"{ns}.alpha") == (len(ids) - len(handled), 0), timeout=30)
    rest = consume("--queue", f"{ns}.alpha", "--idle-timeout", "2")
    assert rest.wait(60) == 0, rest.log()
    handled = Counter(Effect.objects.filter(consumer="alpha").values_list("message_id", flat=True))
    assert handled == Counter(ids)
