"""Where a retry waits, when the leader of the queue it goes back to dies (issue 48).

One traffic, two kinds of waiting message, one fault: each even message fails once for alpha,
so its retry waits in the outbox as a scheduled row due 0.2 s after the failure; each odd one
is a scheduled outbox row due 0.4 s after its commit (``publish(delay=...)``). A relay sends
both when due. Alpha's quorum leader is killed (kill -9, 8 s down). The nodes run with
RabbitMQ's defaults (``dead_letter_worker_publisher_confirm_timeout`` 180 s among them, which
stranded a delay-queue retry that long before): no broker setting is asked. The verdict of
tests/faults, and for each kind how late messages took effect after their due time, printed;
no retry may wait for the broker's confirm timeout.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
from django.db import transaction

from reliable_messaging import publish
from tests.faults.harness import ROUTING_KEY
from tests.testapp.models import Effect

from .rig import ClusterRig, OpenTraffic, longest_idle
from .test_cluster_faults import AFTER, RATE, node_down_for, report, start_pipeline, where

# RabbitMQ's default dead_letter_worker_publisher_confirm_timeout: what a retry waiting in a
# delay queue on the dead leader's node waited for.
BROKER_CONFIRM_TIMEOUT = 180.0
RETRY_DELAY = 0.2  # the suite's first retry delay (tests.settings RETRY_DELAYS)
SCHEDULED_DELAY = 0.4

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]


class RetriesAndScheduledRows(OpenTraffic):
    """Even messages fail once for alpha (a retry); odd ones are scheduled rows. Each payload
    carries its commit time, ``t``."""

    def _publish_one(self, seq: int) -> None:
        payload: dict[str, Any] = {"seq": seq, "t": time.time()}
        with transaction.atomic():
            if seq % 2 == 0:
                payload["fail"] = {"alpha": 1}
                message_id = publish(ROUTING_KEY, payload, exchange=self.exchange)
            else:
                message_id = publish(
                    ROUTING_KEY, payload, exchange=self.exchange, delay=SCHEDULED_DELAY
                )
        with self._lock:
            self.committed.append(message_id)
            self.payloads[message_id] = payload


def late_by_kind(rig: ClusterRig) -> dict[str, list[float]]:
    """Seconds from each message's due time to alpha's effect: a scheduled row's commit and its
    delay; a retry's failure (its first attempt's outcome, near its commit) and the retry
    delay."""
    effects = {
        message_id: created.timestamp()
        for message_id, created in Effect.objects.filter(consumer="alpha").values_list(
            "message_id", "created_at"
        )
    }
    late: dict[str, list[float]] = {"retry": [], "scheduled row": []}
    assert rig.traffic is not None
    for message_id, payload in rig.traffic.payloads.items():
        if message_id not in effects:
            continue
        retried = payload["seq"] % 2 == 0
        due = payload["t"] + (RETRY_DELAY if retried else SCHEDULED_DELAY)
        late["retry" if retried else "scheduled row"].append(effects[message_id] - due)
    return late


def test_retries_waiting_when_their_queue_leader_dies(cluster_rig: ClusterRig) -> None:
    rig = cluster_rig
    began = time.monotonic()
    consumers, relay = start_pipeline(rig)
    traffic = RetriesAndScheduledRows(rig.exchange, RATE)
    rig.traffic = traffic
    traffic.start()
    traffic.wait_published(90)
    before = where(rig, consumers)
    start = time.time()
    leader = rig.cluster.quorum_leader(rig.vhost, rig.queues["alpha"])
    node_down_for(rig.cluster, leader, 8)
    end = time.time()
    print(f"\n[retry placement] killed {leader}; {end - start:.1f}s; before: {before}")
    time.sleep(AFTER)
    traffic.finish()
    verdict = rig.check_exactly_once(timeout=150)
    late = late_by_kind(rig)
    lines = [
        f"{kind}: {len(values)} messages, from due to effect: median "
        f"{statistics.median(values):.2f}s, p99 {statistics.quantiles(values, n=100)[-1]:.1f}s, "
        f"longest {max(values):.1f}s, {sum(v > 10 for v in values)} over 10 s"
        for kind, values in late.items()
        if len(values) > 1
    ]
    report(
        "retry placement, alpha's leader kill -9",
        began,
        rig,
        longest_idle(start, end),
        "RabbitMQ's default broker settings",
        f"after: {where(rig, consumers)}",
        f"verdict: {verdict.summary()}",
        *lines,
    )
    rig.assert_still_running(relay, *consumers)
    assert all(late.values()), late
    # No retry waited for the broker: not its confirm timeout, nor half of it.
    assert max(late["retry"]) < BROKER_CONFIRM_TIMEOUT / 2, lines
