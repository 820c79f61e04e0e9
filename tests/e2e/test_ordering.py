"""Ordered consumers with real processes: publish() → relay → partitions → consume.

tests.gamma is ``ordered=True`` and bound to ``seq.*``. Every message carries its key as the
ordering key and ``seq``, its place within the key. The Effect rows a handler writes commit with
the handler, so their ids give the order in which each key's messages took effect.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus
from reliable_messaging.dead_letters.replay import replay_batch
from reliable_messaging.models import DeadLetter
from tests import support
from tests.conftest import subprocess_env
from tests.rabbitmq4 import NODES
from tests.support import ConsumeProcess, RelayProcess, all_queue_counts, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

BROKEN = "RM_TEST_GAMMA_BROKEN"


def env_for(ns: str, **extra: str) -> dict[str, str]:
    return subprocess_env(ns, unset=(BROKEN,), **extra)  # only the processes that ask are broken


def publish_keys(
    keys: list[str],
    per_key: int,
    special: dict[tuple[str, int], dict[str, Any]],
    first: int = 0,
) -> dict[str, list[str]]:
    """Publish ``per_key`` messages for each key (``seq`` from ``first`` on), interleaved
    across keys, one transaction per round; returns {key: [message ids in publish order]}."""
    ids: dict[str, list[str]] = collections.defaultdict(list)
    for seq in range(first, first + per_key):
        with transaction.atomic():
            for key in keys:
                payload = {"key": key, "seq": seq, **special.get((key, seq), {})}
                ids[key].append(publish(f"seq.{key}", payload, ordering_key=key))
    return ids


def order_of_effects(label: str = "gamma") -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = collections.defaultdict(list)
    for effect in Effect.objects.filter(consumer=label).order_by("id"):
        payload: dict[str, Any] = effect.payload or {}
        seqs[payload["key"]].append(payload["seq"])
    return seqs


def gamma_backlog(ns: str) -> int:
    """Messages ready or unacked in gamma's partition queues."""
    counts = all_queue_counts()
    return sum(sum(counts.get(f"{ns}.gamma.p{index}", (0, 0))) for index in range(4))


def test_keys_keep_publish_order_across_processes_and_a_kill(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """Two consume processes (one active per partition, the other standing by) and a relay;
    the process holding the partitions is killed -9 in the middle and replaced. Every key's
    messages still take effect once each, in publish order."""
    env = env_for(ns)
    args = ["--queue", f"{ns}.gamma", "--concurrency", "2"]
    first = ConsumeProcess(args, env, tmp_path / "consume-1.log").wait_consuming()
    second = ConsumeProcess(args, env, tmp_path / "consume-2.log").wait_consuming()
    relay = RelayProcess([], env, tmp_path / "relay.log")
    third: ConsumeProcess | None = None
    keys = [f"k{n}" for n in range(8)]
    try:
        slow = {(key, seq): {"sleep": {"gamma": 0.01}} for key in keys for seq in range(40)}
        ids = publish_keys(keys, 40, slow)
        wait_until(lambda: Effect.objects.filter(consumer="gamma").count() >= 60, timeout=60)
        first.kill()  # the first process took every partition: single active consumer
        third = ConsumeProcess(args, env, tmp_path / "consume-3.log").wait_consuming()
        wait_until(
            lambda: (
                Effect.objects.filter(consumer="gamma").count() >= 320 and gamma_backlog(ns) == 0
            ),
            timeout=120,
            message="all 320 messages handled",
        )
        seqs = order_of_effects()
        assert set(seqs) == set(keys)
        for key in keys:
            assert seqs[key] == list(range(40)), f"key {key} out of order: {seqs[key]}"
        for key in keys:
            for message_id in ids[key]:
                assert Effect.objects.filter(consumer="gamma", message_id=message_id).count() == 1
        assert "consumer=tests.gamma" in second.log()  # the standby took over
    finally:
        for proc in (first, second, third, relay):
            if proc is not None:
                proc.close()


@pytest.mark.skipif(
    support.BROKER.name not in NODES,
    reason="restarts the node under test: only a RabbitMQ 4 node of scripts/rabbitmq4.sh (on "
    "3.10 the cluster's rolling restart covers it)",
)
def test_keys_keep_publish_order_across_a_restart_of_the_node(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """The whole node restarted (on 4.x its metadata store, Khepri on 4.3, holds the
    consistent-hash exchange and its bindings) while keyed messages are handled, and more are
    published meanwhile: every key's messages take effect once each, in publish order, and those
    published during the outage are routed to their partitions when the node is back."""
    env = env_for(ns)
    args = ["--queue", f"{ns}.gamma", "--concurrency", "2"]
    first = ConsumeProcess(args, env, tmp_path / "consume-1.log").wait_consuming()
    second = ConsumeProcess(args, env, tmp_path / "consume-2.log").wait_consuming()
    relay = RelayProcess([], env, tmp_path / "relay.log")
    keys = [f"k{n}" for n in range(8)]
    try:
        slow = {(key, seq): {"sleep": {"gamma": 0.01}} for key in keys for seq in range(30)}
        ids = publish_keys(keys, 30, slow)
        wait_until(lambda: Effect.objects.filter(consumer="gamma").count() >= 60, timeout=60)
        node = NODES[support.BROKER.name]
        node.restart()
        more = publish_keys(keys, 10, {}, first=30)  # the relay may still be reconnecting
        wait_until(
            lambda: (
                Effect.objects.filter(consumer="gamma").count() >= 320 and gamma_backlog(ns) == 0
            ),
            timeout=150,
            message="all 320 messages handled after the restart",
        )
        seqs = order_of_effects()
        for key in keys:
            assert seqs[key] == list(range(40)), f"key {key} out of order: {seqs[key]}"
            for message_id in ids[key] + more[key]:
                assert Effect.objects.filter(consumer="gamma", message_id=message_id).count() == 1
        assert relay.log().count("relay: publishing the outbox") >= 2, relay.log()  # reconnected
    finally:
        for proc in (first, second, relay):
            proc.close()


def test_a_failing_message_is_never_overtaken_by_its_key(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    """One key retries in place and keeps its order; another key's message breaks for good:
    the later messages of that key are parked behind it, other keys go on. Replaying the key's
    dead letters oldest first, after the fix, runs them in order and resolves them all."""
    broken_env = env_for(ns, **{BROKEN: "1"})
    args = ["--queue", f"{ns}.gamma", "--concurrency", "2"]
    consume = ConsumeProcess(args, broken_env, tmp_path / "consume-broken.log").wait_consuming()
    relay = RelayProcess([], env_for(ns), tmp_path / "relay.log")
    fixed: ConsumeProcess | None = None
    keys = ["a", "b", "c", "d"]
    special: dict[tuple[str, int], dict[str, Any]] = {
        ("b", 3): {"fail": {"gamma": 2}},  # fails twice, then succeeds: retried in place
        ("c", 4): {"broken_while_env": {"gamma": BROKEN}},  # a dead letter in this deploy
    }
    try:
        ids = publish_keys(keys, 10, special)
        wait_until(
            lambda: (
                Effect.objects.filter(consumer="gamma").count() >= 34
                and DeadLetter.objects.filter(consumer="tests.gamma").count() >= 6
            ),
            timeout=60,
            message="34 effects (a, b, d and c up to seq 3) and 6 dead letters",
        )
        seqs = order_of_effects()
        assert seqs["a"] == seqs["b"] == seqs["d"] == list(range(10))
        assert seqs["c"] == [0, 1, 2, 3]
        letters = list(DeadLetter.objects.filter(consumer="tests.gamma").order_by("pk"))
        assert [letter.message_id for letter in letters] == ids["c"][4:]
        assert letters[0].reason == DeadLetterReason.PERMANENT
        assert {letter.reason for letter in letters[1:]} == {DeadLetterReason.PARKED}
        assert {letter.ordering_key for letter in letters} == {"c"}
        assert f"dead letter #{letters[0].pk}" in letters[1].exception_message

        # The fixed deploy replaces the broken one, and the key's dead letters are replayed.
        consume.send(signal.SIGTERM)
        assert consume.wait(30) == 0
        fixed = ConsumeProcess(args, env_for(ns), tmp_path / "consume-fixed.log").wait_consuming()
        result = replay_batch([letter.pk for letter in letters], replayed_by="tests")
        assert len(result.replayed) == 6, result.refused
        wait_until(
            lambda: (
                DeadLetter.objects.filter(
                    consumer="tests.gamma", status=DeadLetterStatus.RESOLVED
                ).count()
                == 6
            ),
            timeout=60,
            message="the six dead letters resolved",
        )
        assert order_of_effects()["c"] == list(range(10))
        for message_id in ids["c"]:
            assert Effect.objects.filter(consumer="gamma", message_id=message_id).count() == 1
    finally:
        for proc in (consume, fixed, relay):
            if proc is not None:
                proc.close()
