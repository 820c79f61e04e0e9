"""Features where they meet across real ``consume`` processes (issue 45).

- The circuit breaker, the crash guard and tracing: a process whose breaker is open holds its
  deliveries unstarted; killed with ``SIGKILL``, it hands them back, and the next process gets
  them redelivered, as crash suspects. Each suspect waits for that process's breaker like any
  delivery (the outage is still on), none is blamed for the death it did not cause (no
  ``worker_crashed``), and with the provider back each payment takes effect once. The wait
  makes no span: the new process's trace has one ``process`` span per run of a handler, each
  ending ``retried`` or ``processed``.

- Ordered consumers and tracing: a key's head retried in place has a span per run (``retried``,
  then ``processed``); a message of its key caught behind it ends a span ``held`` at most, and
  is handled after it, on its first attempt.

The provider is the payment provider of ``test_breaker.py`` (tests/e2e/conftest.py), and
``tests.payments`` its consumer (tests/testapp/consumers.py): window 10, 4 failures, a pause of
1 s, 2 probes.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.models import DeadLetter, SuspectDelivery
from tests.conftest import subprocess_env
from tests.integration.ops.conftest import free_port
from tests.support import ConsumeProcess, Publisher, queue_counts, wait_until
from tests.testapp.models import Effect
from tests.trace_file import read_spans

from .conftest import Provider
from .test_breaker import CONSUMER, metric, payments_done
from .test_breaker_meets import opened

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def test_suspects_redelivered_from_a_killed_process_wait_for_the_breaker_blamed_for_nothing(
    ns: str, transactional_db: None, tmp_path: Path, provider: Provider, publisher: Publisher
) -> None:
    exchange = f"rmtest.{ns}"
    queue = f"{ns}.payments"
    payments = [f"pay-{n}" for n in range(12)]
    env = subprocess_env(ns, RM_TEST_DOWNSTREAM_URL=provider.url)
    first = ConsumeProcess(["--queue", queue], env, tmp_path / "consume-1.log")
    second: ConsumeProcess | None = None
    spans = tmp_path / "spans-2.jsonl"
    metrics_port = free_port()
    try:
        first.wait_consuming()
        provider.stop()
        for message_id in payments:
            publisher.publish(exchange, "payment.due", {"id": message_id}, message_id=message_id)
        wait_until(lambda: opened(first) >= 1, timeout=30, message="the first breaker opening")
        first.kill()  # what it held goes back to the queue, redelivered to the next process

        second = ConsumeProcess(
            ["--queue", queue, "--metrics-port", str(metrics_port)],
            {**env, "RM_TRACE_FILE": str(spans)},
            tmp_path / "consume-2.log",
        ).wait_consuming()
        wait_until(
            lambda: opened(second) >= 1,
            timeout=45,
            message=lambda: f"the second breaker opening; log:\n{second.log()[-3000:]}",
        )
        provider.start()
        wait_until(
            lambda: payments_done() >= len(payments),
            timeout=90,
            message=lambda: f"every payment handled; log:\n{second.log()[-3000:]}",
        )
        wait_until(lambda: queue_counts(queue) == (0, 0), timeout=30, message="queue drained")

        assert not DeadLetter.objects.exists(), list(DeadLetter.objects.values("reason"))
        assert not SuspectDelivery.objects.exists()
        handled = collections.Counter(
            Effect.objects.filter(consumer="payments").values_list("message_id", flat=True)
        )
        assert handled == collections.Counter(payments)
        assert provider.calls == len(payments)
        log = second.log()
        retries = len(re.findall(rf"retrying message_id=\S+ consumer={CONSUMER} ", log))
        opens = opened(second)
        # The suspects ran one by one, each asking the breaker first: 4 failures open it, and
        # each later opening is one half-open round of 2 probes. Without the breaker each of
        # the 12 would have spent an attempt on the outage.
        assert retries <= 4 + 2 * (opens - 1), (retries, opens)
        received = metric(metrics_port, "reliable_messaging_consumer_received_total")
        assert received is not None and received <= 2 * len(payments) + retries, received

        # One span per run of the handler in the second process, none for the wait.
        redelivered: set[str] = set()

        def outcomes_by_id() -> dict[str, list[str]]:
            found: dict[str, list[str]] = collections.defaultdict(list)
            for span in read_spans(spans):
                if span["name"] == f"process {queue}":
                    attributes = span["attributes"]
                    message_id = attributes["messaging.message.id"]
                    found[message_id].append(attributes["reliable_messaging.outcome"])
                    if attributes.get("reliable_messaging.redelivered"):
                        redelivered.add(message_id)
            return found

        wait_until(
            lambda: sum(len(v) for v in outcomes_by_id().values()) >= len(payments) + retries,
            timeout=20,
            message="the second process's spans",
        )
        traced = outcomes_by_id()
        assert sorted(traced) == sorted(payments)
        for message_id, outcomes in traced.items():
            assert outcomes[-1] == "processed" and outcomes.count("processed") == 1, (
                message_id,
                outcomes,
            )
            assert set(outcomes) <= {"retried", "processed"}, (message_id, outcomes)
        assert sum(outcomes.count("retried") for outcomes in traced.values()) == retries
        # Most came redelivered from the killed process: suspects (the rest were retry copies
        # still in their delay queue at the kill).
        assert len(redelivered) >= len(payments) - 4, sorted(redelivered)
    finally:
        first.close()
        if second is not None:
            second.close()


def test_an_ordered_keys_spans_show_the_retry_in_place_and_the_messages_held_behind_it(
    ns: str, transactional_db: None, tmp_path: Path, publisher: Publisher
) -> None:
    spans = tmp_path / "spans.jsonl"
    proc = ConsumeProcess(
        ["--queue", f"{ns}.gamma"],
        subprocess_env(ns, RM_TRACE_FILE=str(spans)),
        tmp_path / "consume.log",
    )
    ids = [f"k-{seq}" for seq in range(4)]
    try:
        proc.wait_consuming()
        for seq, message_id in enumerate(ids):
            payload = {"key": "k", "seq": seq, **({"fail": {"gamma": 1}} if seq == 0 else {})}
            publisher.publish(
                f"rmtest.{ns}",
                "seq.next",
                payload,
                message_id=message_id,
                headers={ORDERING_KEY_HEADER: "k"},
            )

        def by_id() -> dict[str, list[tuple[int, str]]]:
            found: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
            for span in read_spans(spans):
                if span["name"].startswith(f"process {ns}.gamma.p"):
                    attributes = span["attributes"]
                    found[attributes["messaging.message.id"]].append(
                        (int(span["end"]), attributes["reliable_messaging.outcome"])
                    )
            return found

        wait_until(
            lambda: all(
                any(outcome == "processed" for _, outcome in by_id().get(m, [])) for m in ids
            ),
            timeout=45,
            message=lambda: f"every message's processed span; so far {dict(by_id())}",
        )
        traced = by_id()
        assert [o for _, o in sorted(traced["k-0"])] == ["retried", "processed"], traced
        for message_id in ids[1:]:
            outcomes = [o for _, o in sorted(traced[message_id])]
            assert outcomes in (["processed"], ["held", "processed"]), (message_id, outcomes)
        ends = [max(end for end, o in traced[m] if o == "processed") for m in ids]
        assert ends == sorted(ends), traced  # in the key's order
        effects = list(
            Effect.objects.filter(consumer="gamma")
            .order_by("id")
            .values_list("message_id", "attempt")
        )
        assert effects == [("k-0", 2), ("k-1", 1), ("k-2", 1), ("k-3", 1)]
        assert not DeadLetter.objects.exists()
    finally:
        proc.close()
