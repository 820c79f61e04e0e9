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

- A quorum queue's delivery limit and tracing: a message another client gave back until the
  broker moved it to ``<queue>.dead`` reached no handler, so it has no ``process`` span; its
  dead letter ``delivery_limit`` keeps the trace of its publish (the ids of the relay's ``send``
  span it carried), and its replay's span links back to that span.

- Scheduled rows and tracing: a message published with ``delay`` inside a view's span is sent
  when it is due, by a ``send`` span that starts then, a child of its ``publish`` span in the
  view's trace, its ``outbox.wait_ms`` counted from the due time, not from the publish.

- Replays and the crash guard: a message that killed its process ``CRASH_LIMIT`` times is a
  dead letter ``worker_crashed`` and leaves no suspicion behind; replayed after the fix (the
  copy keeps its message_id), a copy whose process dies once more is a suspect counted from
  zero: handled once, not a dead letter again.

The provider is the payment provider of ``test_breaker.py`` (tests/e2e/conftest.py), and
``tests.payments`` its consumer (tests/testapp/consumers.py): window 10, 4 failures, a pause of
1 s, 2 probes.
"""

from __future__ import annotations

import collections
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, OutboxStatus
from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, OutboxMessage, Replay
from tests.conftest import subprocess_env
from tests.integration.consuming.test_features_meet import return_until_dropped
from tests.support import (
    ConsumeProcess,
    Publisher,
    drained,
    no_suspect_left,
    queue_counts,
    wait_until,
)
from tests.testapp.models import Effect
from tests.trace_file import read_spans, render_tree

from .conftest import Provider
from .test_breaker import CONSUMER, metric, payments_done
from .test_breaker_meets import opened
from .test_replay_routing import relay_once
from .test_tracing import RelayProcess, manage, matching, only, run_view, spans_when, traced_env

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
    try:
        first.wait_consuming()
        provider.stop()
        for message_id in payments:
            publisher.publish(exchange, "payment.due", {"id": message_id}, message_id=message_id)
        wait_until(lambda: opened(first) >= 1, timeout=30, message="the first breaker opening")
        first.kill()  # what it held goes back to the queue, redelivered to the next process

        second = ConsumeProcess(
            ["--queue", queue, "--metrics-port", "0"],
            {**env, "RM_TRACE_FILE": str(spans)},
            tmp_path / "consume-2.log",
        ).wait_consuming()
        metrics_port = second.ops_port()
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
        no_suspect_left()
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
            # A payment the killed process had failed may come twice: its retry copy, and its
            # original when the kill came between the copy's confirm and the original's ack.
            # The second is a duplicate: its handler does not run, and its span says so.
            runs = [outcome for outcome in outcomes if outcome != "duplicate"]
            assert runs[-1] == "processed" and runs.count("processed") == 1, (
                message_id,
                outcomes,
            )
            assert set(runs) <= {"retried", "processed"}, (message_id, outcomes)
        assert sum(outcomes.count("retried") for outcomes in traced.values()) == retries
        # Most came redelivered from the killed process: suspects (the rest were retry copies
        # still waiting in the outbox at the kill).
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


# --------------------------------------------------------------------------- quorum limit x tracing


def test_a_message_past_the_quorum_delivery_limit_keeps_its_trace_without_a_process_span(
    ns: str, transactional_db: None, tmp_path: Path
) -> None:
    """A view publishes order-1 (quorum queues, delivery limit 2); before any ``consume`` runs,
    another client gives alpha's copy back until the broker moves it to ``alpha.dead``. The
    traced ``consume`` stores it as a dead letter ``delivery_limit`` and processes beta's copy.
    No handler ever ran alpha's: the view's trace has no ``process`` span of alpha (nor of its
    ``.dead`` queue), and the dead letter holds the ids of the ``send`` span the message
    carried. Its replay starts a trace of its own linked to that span; the copy is processed
    there once, on attempt 1."""
    spans_file = tmp_path / "spans.jsonl"
    env = traced_env(ns, spans_file, RM_TEST_QUEUE_TYPE="quorum", RM_TEST_QUORUM_DELIVERY_LIMIT="2")
    alpha, beta = f"{ns}.alpha", f"{ns}.beta"
    relay = RelayProcess([], env, tmp_path / "relay.log")  # declares the quorum queues
    consume: ConsumeProcess | None = None
    try:
        trace_id = run_view(env, [{"id": "order-1", "routing_key": "order.placed", "payload": {}}])[
            "order-1"
        ]
        wait_until(
            lambda: OutboxMessage.objects.filter(
                message_id="order-1", status=OutboxStatus.SENT
            ).exists(),
            timeout=20,
            message=lambda: f"order-1 sent; relay log:\n{relay.log()[-3000:]}",
        )
        returned = return_until_dropped(alpha, most=10)
        assert 2 <= returned <= 4, returned
        consume = ConsumeProcess(
            ["--queue", alpha, "--queue", beta], env, tmp_path / "consume.log"
        ).wait_consuming()
        letters = DeadLetter.objects.filter(consumer="tests.alpha", message_id="order-1")
        wait_until(
            lambda: letters.exists() and Effect.objects.filter(consumer="beta").exists(),
            timeout=20,
            message=lambda: f"alpha's dead letter, beta's effect; log:\n{consume.log()[-3000:]}",
        )
        letter = letters.get()
        assert letter.reason == DeadLetterReason.DELIVERY_LIMIT, letter.exception_message
        assert not Effect.objects.filter(consumer="alpha").exists()

        out = manage(env, "replay_dead_letters", "--consumer", "tests.alpha")
        assert "replayed 1 dead letter(s), refused 0" in out, out
        wait_until(
            lambda: letters.filter(status=DeadLetterStatus.RESOLVED).exists(),
            timeout=20,
            message=lambda: f"the dead letter resolved by its replay; log:\n{consume.log()}",
        )
        spans = spans_when(
            spans_file,
            lambda found: (
                matching(found, f"process {alpha}", reliable_messaging__outcome="processed")
                and len(matching(found, f"send {alpha}")) == 1
                and matching(found, f"process {beta}")
            ),
            "the replayed copy's process span and every send span",
        )
        mine = [span for span in spans if span["trace_id"] == trace_id]
        tree = render_tree(spans, trace_id)
        send = only(matching(mine, "send order.placed"), "send span", spans)
        # Beta's handler ran in the view's trace; alpha's never did, and what the broker moved
        # to alpha.dead was stored without a span.
        assert {span["name"] for span in mine} == {
            "POST /orders",
            "publish order.placed",
            "send order.placed",
            f"process {beta}",
        }, tree
        assert not [span for span in spans if span["name"].startswith(f"process {alpha}.dead")]
        beta_run = only(matching(mine, f"process {beta}"), "beta's span", spans)
        assert beta_run["parent_span_id"] == send["span_id"]
        assert beta_run["attributes"]["reliable_messaging.outcome"] == "processed"

        # The dead letter keeps the trace of its publish: the span the message carried.
        letter.refresh_from_db()
        failures = [event for event in letter.history if event["event"] == "dead_lettered"]
        assert failures[0].get("trace_id") == trace_id
        assert (letter.trace_id, letter.span_id) == (trace_id, send["span_id"]), tree

        # Its replay: a trace of its own, linked to that span, where the copy is processed.
        replay_span = only(matching(spans, f"replay {alpha}"), "replay span", spans)
        assert replay_span["parent_span_id"] is None and replay_span["trace_id"] != trace_id
        assert [(link["trace_id"], link["span_id"]) for link in replay_span["links"]] == [
            (trace_id, send["span_id"])
        ]
        again = [span for span in spans if span["trace_id"] == replay_span["trace_id"]]
        replay_send = only(matching(again, f"send {alpha}"), "the replay's send", spans)
        assert replay_send["parent_span_id"] == replay_span["span_id"]
        copy = only(matching(again, f"process {alpha}"), "the copy's process span", spans)
        assert copy["parent_span_id"] == replay_send["span_id"]
        assert copy["attributes"]["reliable_messaging.outcome"] == "processed"
        assert copy["attributes"]["reliable_messaging.attempt"] == 1
        assert list(
            Effect.objects.filter(consumer__in=["alpha", "beta"])
            .order_by("consumer")
            .values_list("consumer", "message_id", "attempt")
        ) == [("alpha", "order-1", 1), ("beta", "order-1", 1)]
    finally:
        relay.close()
        if consume is not None:
            consume.close()


# --------------------------------------------------------------------------- scheduled x tracing

DELAY = 4.0

# A view that schedules its message: publish(..., delay=...) inside its span and transaction.
SCHEDULING_VIEW = """
import os, time
from django.db import transaction
from opentelemetry import trace
from reliable_messaging import publish

tracer = trace.get_tracer("tests.view")
with tracer.start_as_current_span("POST /reminders", kind=trace.SpanKind.SERVER) as span:
    with transaction.atomic():
        publish("order.placed", {}, message_id="later-1", delay=float(os.environ["RM_TEST_DELAY"]))
print("trace", format(span.get_span_context().trace_id, "032x"))

from reliable_messaging.publishing.wake_after_commit import sender
sender.flush(timeout=5)
"""


def test_a_scheduled_messages_send_span_starts_when_due_in_the_trace_of_its_publish(
    ns: str, transactional_db: None, tmp_path: Path
) -> None:
    """publish(delay=4 s) in a view's span: the relay's ``send`` span starts at the due time
    (not at the publish), a child of the ``publish`` span in the view's trace, and its
    ``outbox.wait_ms`` counts from the due time (well under the 4 s the row was scheduled
    for). Alpha's ``process`` span follows in the same trace."""
    spans_file = tmp_path / "spans.jsonl"
    env = traced_env(ns, spans_file)
    alpha = f"{ns}.alpha"
    # The relay process sends (consume's own relay off), so the send span is the relay's.
    consume = ConsumeProcess(["--queue", alpha, "--no-relay"], env, tmp_path / "consume.log")
    relay = RelayProcess([], env, tmp_path / "relay.log")
    try:
        consume.wait_consuming()
        out = manage({**env, "RM_TEST_DELAY": str(DELAY)}, "shell", "-c", SCHEDULING_VIEW)
        trace_id = next(line.split()[1] for line in out.splitlines() if line.startswith("trace "))
        spans = spans_when(
            spans_file,
            lambda found: (
                matching(found, f"process {alpha}", reliable_messaging__outcome="processed")
                and matching(found, "send order.placed", reliable_messaging__outcome="sent")
            ),
            "alpha's process span and the relay's send span",
            timeout=DELAY + 20,
        )
        row = OutboxMessage.objects.get(message_id="later-1")
        assert row.deliver_at is not None
        due_ns = int(row.deliver_at.timestamp() * 1e9)
        mine = [span for span in spans if span["trace_id"] == trace_id]
        tree = render_tree(spans, trace_id)
        view = only(matching(mine, "POST /reminders"), "view span", spans)
        published = only(matching(mine, "publish order.placed"), "publish span", spans)
        send = only(matching(mine, "send order.placed"), "send span", spans)
        run = only(matching(mine, f"process {alpha}"), "alpha's span", spans)
        assert published["parent_span_id"] == view["span_id"], tree
        assert send["parent_span_id"] == published["span_id"], tree
        assert send["service"] == "shop relay"
        assert run["parent_span_id"] == send["span_id"], tree
        # Published at once, sent when due: the send span starts at the due time.
        assert published["end"] < due_ns, tree
        assert send["start"] >= due_ns - 1_000_000, (send["start"] - due_ns) / 1e6
        assert send["start"] - published["start"] >= (DELAY - 0.5) * 1e9, tree
        # Its wait counts from the due time, not from the publish 4 s before.
        wait_ms = send["attributes"]["reliable_messaging.outbox.wait_ms"]
        assert 0 <= wait_ms <= (send["start"] - due_ns) / 1e6 + 1, (wait_ms, tree)
        assert wait_ms < DELAY * 1000 / 2, (wait_ms, tree)
        assert list(
            Effect.objects.filter(consumer="alpha").values_list("message_id", "attempt")
        ) == [("later-1", 1)]
    finally:
        relay.close()
        consume.close()


# --------------------------------------------------------------------------- replay x crash guard


def test_a_replay_of_a_message_that_killed_its_process_is_blamed_for_none_of_its_deaths(
    ns: str, transactional_db: None, tmp_path: Path, publisher: Publisher
) -> None:
    """With ``CRASH_LIMIT`` 2, a pill kills its first two processes (``kill_while`` its bug's
    switch is on); the third makes it a dead letter ``worker_crashed`` (2 deaths). The fix is
    deployed and the dead letter replayed: the copy (same message_id) still takes its process
    down once (``kill_once``: its first delivery), so it comes back redelivered, a suspect. The
    guard counts that one death only: the copy is handled once, on the next process, the dead
    letter resolved and no suspicion left."""
    queue = f"{ns}.alpha"
    env = subprocess_env(ns, RM_TEST_CRASH_LIMIT="2")
    started: list[ConsumeProcess] = []

    def start() -> ConsumeProcess:
        proc = ConsumeProcess(["--queue", queue], env, tmp_path / f"consume-{len(started) + 1}.log")
        started.append(proc)
        return proc

    def logs() -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-2000:]}" for p in started)

    Effect.objects.create(consumer="switch", message_id="pill-bug", attempt=1)  # the bug
    letters = DeadLetter.objects.filter(consumer="tests.alpha", message_id="pill")
    try:
        start().wait_consuming()
        payload: dict[str, Any] = {
            "kill_while": {"alpha": "pill-bug"},
            "kill_once": {"alpha": True},
        }
        publisher.publish(f"rmtest.{ns}", "order.placed", payload, message_id="pill")
        assert started[0].wait(30) == -signal.SIGKILL, logs()
        # Redelivered to the second process: a suspect of one death, run again, fatal again.
        assert start().wait(45) == -signal.SIGKILL, logs()
        survivor = start().wait_consuming()
        wait_until(letters.exists, timeout=30, message=lambda: f"the pill's dead letter\n{logs()}")
        letter = letters.get()
        assert (letter.reason, letter.attempts) == (DeadLetterReason.WORKER_CRASHED, 2), (
            letter.exception_message
        )
        assert not Effect.objects.filter(consumer="alpha").exists()

        Effect.objects.filter(consumer="switch").delete()  # the fix is deployed
        result = replay(letters, replayed_by="operator")
        assert result.replayed == [letter.pk], result
        relay_once(ns)
        # The copy's first delivery still took its process down (a crash of its own).
        assert survivor.wait(30) == -signal.SIGKILL, logs()
        last = start().wait_consuming()
        wait_until(
            lambda: letters.exclude(status=DeadLetterStatus.REPLAYED).exists(),
            timeout=30,
            message=lambda: f"the replay's outcome\n{logs()}",
        )
        letter.refresh_from_db()
        assert letter.status == DeadLetterStatus.RESOLVED, (
            letter.status,
            letter.reason,
            letter.attempts,
            letter.exception_message,
            logs(),
        )
        assert list(
            Effect.objects.filter(consumer="alpha").values_list("message_id", "attempt")
        ) == [("pill", 1)]
        assert list(Replay.objects.values_list("outcome", flat=True)) == ["processed"]
        assert letters.count() == 1
        no_suspect_left(logs)
        wait_until(lambda: drained(queue), timeout=20, message="alpha's queue drained")
        assert last.returncode is None, logs()
    finally:
        for proc in started:
            proc.close()
