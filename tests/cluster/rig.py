"""The fault harness of tests/faults, pointed at the 3-node cluster.

:class:`ClusterRig` is a :class:`~tests.faults.harness.FaultRig` whose vhost lives on the cluster
(made and deleted with ``rabbitmqctl -n``), whose processes get the cluster's three URLs
(``;``-joined, each list starting at a node of its own), quorum queues, a short
AMQP heartbeat and a short inbox lock timeout, and whose "every queue is empty" check asks the
cluster. :class:`OpenTraffic` is the harness's traffic, run until the fault is over rather than
for a fixed count. :func:`longest_idle` measures the longest time no message was handled.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import connection

from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import DeadLetter, OutboxMessage
from tests.faults.harness import LABELS, FaultRig, RelayProcess, Traffic, Verdict
from tests.support import ConsumeProcess, ManageProcess, WaitTimeout, wait_until
from tests.testapp.models import Effect

from .netns import ConsumerHost, NetnsConsumeProcess
from .rabbit_cluster import RabbitCluster

HEARTBEAT = 5  # seconds: RM_TEST_HEARTBEAT of every process


class OpenTraffic(Traffic):
    """:class:`Traffic` (commits of ``publish()`` at a steady rate) that runs until
    :meth:`finish`, at most ``limit`` messages: the fault decides how long it flows."""

    def __init__(self, exchange: str, rate: float, limit: int = 5000, **kwargs: Any) -> None:
        super().__init__(exchange, limit, rate, **kwargs)

    def finish(self) -> int:
        """Stop publishing; what was committed is the whole traffic from now on."""
        self._stop.set()
        self._thread.join(30)
        if self._thread.is_alive():
            raise WaitTimeout("the traffic thread did not stop within 30s")
        if self.error is not None:
            raise AssertionError(f"the traffic thread failed: {self.error!r}") from self.error
        self.total = self.published
        return self.total


@dataclass(kw_only=True)
class ClusterRig(FaultRig):
    """One cluster fault test's vhost (on the cluster), processes, traffic and verdict."""

    cluster: RabbitCluster
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.vhost = self.ns
        self.exchange = f"rmtest.{self.ns}"
        self.queues = {label: f"{self.ns}.{label}" for label in LABELS}
        self.cluster.add_vhost(self.vhost)
        self.broker_url = self.cluster.url_list(self.vhost)
        self.database_name = str(connection.settings_dict["NAME"])

    # -- processes ---------------------------------------------------------------------------

    def env(self, app_name: str, **extra: str) -> dict[str, str]:
        settings = {
            "RM_TEST_QUEUE_TYPE": "quorum",
            "RM_TEST_HEARTBEAT": str(HEARTBEAT),
            **self.extra_env,
        }
        return super().env(app_name, **{**settings, **extra})

    def consumer_on(self, first: int, *args: str, **env: str) -> ConsumeProcess:
        """``manage.py consume ARGS`` whose URL list starts with node ``first`` (0-based)."""
        return self.consumer(
            *args, **{"RM_BROKER_URL": self.cluster.url_list(self.vhost, first=first), **env}
        )

    def relay_on(self, first: int, *args: str) -> RelayProcess:
        name = self._app_name("relay")
        env = self.env(name, RM_BROKER_URL=self.cluster.url_list(self.vhost, first=first))
        proc = RelayProcess(list(args), env, self.tmp_path / f"{name}.log")
        self.app_names[proc.pid] = name
        self.processes.append(proc)
        return self._await_started(proc)

    def consumer_in(self, host: ConsumerHost, first: int, *args: str) -> ConsumeProcess:
        """``manage.py consume ARGS`` inside ``host``'s namespace: the cluster at the host's veth
        address, PostgreSQL through the forwarder."""
        name = self._app_name("consume-ns")
        env = self.env(
            name,
            RM_BROKER_URL=self.cluster.url_list(self.vhost, host=host.host_ip, first=first),
            DATABASE_URL=f"{host.database_url(self.database_name)}?application_name={name}",
        )
        proc = NetnsConsumeProcess(host, list(args), env, self.tmp_path / f"{name}.log")
        self.app_names[proc.pid] = name
        self.processes.append(proc)
        return self._await_started(proc)

    # -- traffic and the verdict ---------------------------------------------------------------

    def start_open_traffic(self, rate: float, **kwargs: Any) -> OpenTraffic:
        traffic = OpenTraffic(self.exchange, rate, **kwargs)
        self.traffic = traffic
        traffic.start()
        return traffic

    def _progress(self) -> str:
        unsent = (
            OutboxMessage.objects.filter(exchange=self.exchange)
            .exclude(status=OutboxStatus.SENT)
            .count()
        )
        done = {
            label: Effect.objects.filter(consumer=label).values("message_id").distinct().count()
            for label in LABELS
        }
        try:
            queues: Any = {
                q: tuple(c) for q, c in self.cluster.queue_depths(self.vhost).items() if not c.empty
            }
        except RuntimeError as exc:
            queues = f"unknown ({exc})"
        return (
            f"outbox rows {len(self.outbox_ids())}, unsent {unsent}; ids with an effect "
            f"{done}; dead letters {DeadLetter.objects.count()}; queues not drained "
            f"(ready, unacked, messages) {queues}"
        )

    def queues_settled(self) -> bool:
        """Every queue of the vhost on the cluster is empty: nothing ready, unacked, or kept for
        at-least-once dead-lettering."""
        if not self._queues_empty():
            return False
        time.sleep(1.2)
        return self._queues_empty()

    def _queues_empty(self) -> bool:
        """Every queue of the vhost holds nothing. Asked twice, more than two of the nodes'
        sampling ticks (0.5 s) apart, so that a count not yet sampled cannot pass for zero."""
        try:
            counts = self.cluster.queue_depths(self.vhost)
        except RuntimeError:
            return False
        return bool(counts) and all(c.empty for c in counts.values())

    def check_exactly_once(self, timeout: float = 75.0) -> Verdict:
        """:meth:`assert_exactly_once`, and when the run never settles, the verdict as it
        stands (lost and doubled counts) in the failure rather than only "timed out"."""
        try:
            return self.assert_exactly_once(timeout)
        except WaitTimeout as exc:
            verdict = self.verdict()
            trace = self.trace(verdict)
            raise AssertionError(
                f"never settled: {exc}\nverdict as it stands: {verdict.summary()}\n{trace}"
                f"{self._linger()}"
            ) from None
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.trace(self.verdict())}") from None

    def _linger(self) -> str:
        """With ``RM_CLUSTER_LINGER=S`` set, a run that did not settle in time is watched for
        S seconds more: does it settle late (a stall) or never (a loss)? The test fails
        either way."""
        linger = float(os.environ.get("RM_CLUSTER_LINGER") or 0)
        if linger <= 0:
            return ""
        began = time.monotonic()
        try:
            wait_until(self.settled, timeout=linger, interval=2.0, message=self._progress)
        except WaitTimeout as exc:
            return f"\nstill not settled {linger:.0f}s later: {exc}"
        return f"\nsettled {time.monotonic() - began:.0f}s later: {self.verdict().summary()}"

    def trace(self, verdict: Verdict, limit: int = 4) -> str:
        """For a few lost and doubled messages: the payload, and every log line naming them."""
        payloads = dict(
            OutboxMessage.objects.filter(exchange=self.exchange).values_list("message_id", "body")
        )
        picked = [(label, m, "lost") for label, ids in verdict.lost.items() for m in ids[:limit]]
        picked += [
            (label, m, "doubled")
            for label, ids in verdict.doubled.items()
            for m in list(ids)[:limit]
        ]
        parts = []
        with contextlib.suppress(RuntimeError):
            depths = self.cluster.queue_depths(self.vhost)
            for row in self.cluster.queues(self.vhost):
                members = ",".join(sorted(m.split("@")[0] for m in row.get("members") or []))
                parts.append(
                    f"  queue {row['name']} {row.get('type')} leader {row.get('leader')} "
                    f"members {members} {row.get('state')}: (ready, unacked, messages) "
                    f"{tuple(depths.get(row['name'], ()))}"
                )
        for label, message_id, what in picked:
            lines = [
                f"      [{proc.command} {proc.pid}] {line.strip()[:240]}"
                for proc in self.processes
                for line in proc.log().splitlines()
                if message_id in line
            ]
            attempts = list(
                Effect.objects.filter(consumer=label, message_id=message_id).values_list(
                    "attempt", "created_at"
                )
            )
            parts.append(
                f"  {what} for {label}: {message_id} payload {payloads.get(message_id)} "
                f"effects {attempts}\n" + "\n".join(lines[:12])
            )
        return "\n".join(parts)

    # -- what the processes say ----------------------------------------------------------------

    def notable(self, proc: ManageProcess, limit: int = 6) -> list[str]:
        """What ``proc`` said about the fault, in its own words: its WARNING and ERROR lines
        and any line about a block, but not the per-message outcome lines; the first few,
        each text once (timestamps aside)."""
        found: list[str] = []
        seen: set[str] = set()
        for line in proc.log().splitlines():
            if "outcome=" in line:
                continue
            if not (" WARNING " in line or " ERROR " in line or "block" in line.lower()):
                continue
            text = line.split(" ", 3)[-1]
            if text in seen:
                continue
            seen.add(text)
            found.append(line.strip())
            if len(found) >= limit:
                break
        return found

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()
        for proc in self.processes:
            proc.close()
        with contextlib.suppress(Exception):  # best effort: a node may be down
            self.cluster.delete_vhost(self.vhost)


def healthz(port: int, host: str = "127.0.0.1") -> tuple[int, dict[str, Any]]:
    """(status, body) of a process's /healthz; (0, {"error": ...}) when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=3) as response:
            return response.status, dict(json.load(response))
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(Exception):
            return exc.code, dict(json.load(exc))
        return exc.code, {}
    except OSError as exc:
        return 0, {"error": str(exc)}


@dataclass(frozen=True)
class Idle:
    """The longest time without a handled message around a fault window."""

    seconds: float
    after_start: float  # where that gap began, relative to the window's start
    handled_in_window: int

    def __str__(self) -> str:
        return (
            f"longest idle {self.seconds:.2f}s (from {self.after_start:+.1f}s after the fault's "
            f"start; {self.handled_in_window} messages handled in the window; AMQP heartbeat "
            f"{HEARTBEAT}s)"
        )


def effect_times(consumer: str | None = None) -> list[float]:
    rows = Effect.objects.all()
    if consumer is not None:
        rows = rows.filter(consumer=consumer)
    return sorted(ts.timestamp() for ts in rows.values_list("created_at", flat=True))


def longest_idle(start: float, end: float) -> Idle:
    """The largest gap between consecutive ``Effect.created_at`` (either consumer) in the
    window ``[start, end]`` (``time.time()`` values), counting from the last effect before it to
    the first after it, so that a stall across the whole window shows in full."""
    times = effect_times()
    inside = [t for t in times if start <= t <= end]
    before = [t for t in times if t < start][-1:]
    after = [t for t in times if t > end][:1]
    points = before + inside + after
    if len(points) < 2:
        return Idle(end - start, 0.0, len(inside))
    gaps = [(b - a, a) for a, b in itertools.pairwise(points)]
    gap, began = max(gaps)
    return Idle(gap, began - start, len(inside))


def handled_between(start: float, end: float) -> int:
    low = datetime.fromtimestamp(start, UTC)
    high = datetime.fromtimestamp(end, UTC)
    return Effect.objects.filter(created_at__gte=low, created_at__lte=high).count()
