"""Traces across real processes: a view's transaction, the relay, consume, retries, a dead letter
and its replay, a foreign producer's context, batched deliveries and the metrics' exemplars.

Only the processes a test starts export spans, each to the test's own trace file
(``RM_TRACE_FILE`` in their environment: tests/settings.py configures demo_project/tracing.py);
this process sets no tracer provider. A "view" is ``manage.py shell`` running a span named
``POST /orders`` as a web framework's instrumentation would, with ``publish()`` in a transaction.
The handlers are tests/testapp/consumers.py's (``fail_while``: failing until the test deletes
its switch row; ``publish``: a handler that publishes).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.models import DeadLetter, OutboxMessage
from tests import trace_file
from tests.conftest import database_url, subprocess_env
from tests.faults.test_foreign_producers import ensure_amqplib, publish_with_amqplib
from tests.support import (
    MANAGE,
    ROOT,
    ConsumeProcess,
    ManageProcess,
    Publisher,
    RelayProcess,
    queue_counts,
    wait_until,
)
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

TRACE_FILE = "RM_TRACE_FILE"
OUTCOME = "reliable_messaging.outcome"
ATTEMPT = "reliable_messaging.attempt"
MESSAGE_ID = "messaging.message.id"

# A view: one root span per order, publish() inside the transaction that writes its row.
VIEW = """
import json, os
from django.db import transaction
from opentelemetry import trace
from reliable_messaging import publish
from tests.testapp.models import Effect

tracer = trace.get_tracer("tests.view")
for order in json.loads(os.environ["RM_TEST_ORDERS"]):
    with tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER) as span:
        with transaction.atomic():
            Effect.objects.create(consumer="view", message_id=order["id"], attempt=1)
            publish(order["routing_key"], order["payload"], message_id=order["id"])
    print("trace", order["id"], format(span.get_span_context().trace_id, "032x"))

# The relay's wake-up goes from a daemon thread: let it out before this process exits.
from reliable_messaging.publishing.wake_after_commit import sender
sender.flush(timeout=5)
"""


read_spans: Callable[[Path], list[dict[str, Any]]] = trace_file.read_spans
render_tree: Callable[[Iterable[dict[str, Any]], str], str] = trace_file.render_tree


def traced_env(ns: str, trace_file: Path | None, **extra: str) -> dict[str, str]:
    """A subprocess's environment: exporting to ``trace_file`` (None: tracing off)."""
    if trace_file is not None:
        extra[TRACE_FILE] = str(trace_file)
    return subprocess_env(ns, unset=(TRACE_FILE,), **extra)


def manage(env: dict[str, str], *args: str) -> str:
    """Run ``manage.py ARGS`` to its end; its stdout."""
    done = subprocess.run(
        [sys.executable, str(MANAGE), *args, "--settings", "tests.settings"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def run_view(env: dict[str, str], orders: list[dict[str, Any]]) -> dict[str, str]:
    """{order id: its trace id} of orders placed by the view process."""
    out = manage({**env, "RM_TEST_ORDERS": json.dumps(orders)}, "shell", "-c", VIEW)
    return {
        fields[1]: fields[2]
        for fields in (line.split() for line in out.splitlines())
        if fields[:1] == ["trace"]
    }


def matching(spans: Iterable[dict[str, Any]], name: str, **attributes: Any) -> list[dict[str, Any]]:
    """Spans called ``name`` whose attributes include ``attributes`` (``__`` stands for ``.``
    in the keys: ``messaging__message__id``)."""
    wanted = {key.replace("__", "."): value for key, value in attributes.items()}
    return [
        span
        for span in spans
        if span["name"] == name
        and all(span["attributes"].get(key) == value for key, value in wanted.items())
    ]


def only(
    spans: list[dict[str, Any]], what: str, everything: list[dict[str, Any]]
) -> dict[str, Any]:
    trees = "\n".join(render_tree(everything, t) for t in {s["trace_id"] for s in everything})
    assert len(spans) == 1, f"expected one {what}, found {len(spans)}:\n{trees}"
    return spans[0]


def spans_when(path: Path, predicate: Any, what: str, timeout: float = 20) -> list[dict[str, Any]]:
    """The spans of ``path`` once ``predicate(spans)`` holds (they are written as they end)."""
    seen: list[dict[str, Any]] = []

    def ready() -> bool:
        seen[:] = read_spans(path)
        return bool(predicate(seen))

    wait_until(ready, timeout=timeout, interval=0.1, message=lambda: f"{what}; spans: {seen}")
    return seen


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def random_ids() -> tuple[str, str]:
    return uuid.uuid4().hex, uuid.uuid4().hex[:16]


@pytest.fixture
def processes() -> Iterator[list[ManageProcess]]:
    """Processes a test starts: killed in teardown, even when it failed."""
    started: list[ManageProcess] = []
    yield started
    for proc in started:
        proc.close()


# --------------------------------------------------------------------------- the whole story


def test_one_trace_from_the_view_through_retries_to_the_dead_letter_and_a_linked_replay(
    ns: str, tmp_path: Path, processes: list[ManageProcess]
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    env = traced_env(ns, trace_file)
    alpha, beta = f"{ns}.alpha", f"{ns}.beta"
    # The bug of this deploy: alpha fails every attempt while the switch row exists.
    Effect.objects.create(consumer="switch", message_id="alpha-bug", attempt=1)
    # The relay process sends (consume's own relay off), so its spans are the relay's.
    consume = ConsumeProcess(
        ["--queue", alpha, "--queue", beta, "--no-relay"], env, tmp_path / "consume.log"
    )
    processes.append(consume)
    processes.append(RelayProcess([], env, tmp_path / "relay.log"))
    consume.wait_consuming()

    traces = run_view(
        env,
        [
            {
                "id": "order-1",
                "routing_key": "order.placed",
                # Beta publishes from its handler; alpha fails until the fix.
                "payload": {
                    "fail_while": {"alpha": "alpha-bug"},
                    "publish": {"beta": "order.shipped"},
                },
            }
        ],
    )
    trace_id = traces["order-1"]
    wait_until(
        lambda: (
            DeadLetter.objects.filter(consumer="tests.alpha", message_id="order-1").exists()
            and Effect.objects.filter(message_id="order-1.beta").count() == 2
        ),
        timeout=30,
        message=lambda: (
            f"alpha's dead letter and the shipped message handled; log:\n{consume.log()}"
        ),
    )

    letter = DeadLetter.objects.get(consumer="tests.alpha", message_id="order-1")
    first_failure = (letter.trace_id, letter.span_id)

    def failures() -> list[dict[str, Any]]:
        letter.refresh_from_db()
        return [event for event in letter.history if event["event"] == "dead_lettered"]

    # Replayed (from a traced process) before the fix: it fails again, in the replay's trace.
    out = manage(env, "replay_dead_letters", "--consumer", "tests.alpha")
    assert "replayed 1 dead letter(s), refused 0" in out, out
    wait_until(
        lambda: len(failures()) == 2 and letter.status == DeadLetterStatus.DEAD,
        timeout=30,
        message=lambda: f"the replay dead-lettered again; log:\n{consume.log()}",
    )
    second_failure = (letter.trace_id, letter.span_id)

    # The fix is deployed; the dead letter is replayed again.
    Effect.objects.filter(consumer="switch").delete()
    out = manage(env, "replay_dead_letters", "--consumer", "tests.alpha")
    assert "replayed 1 dead letter(s), refused 0" in out, out
    wait_until(
        lambda: DeadLetter.objects.filter(status=DeadLetterStatus.RESOLVED).count() == 1,
        timeout=30,
        message=lambda: f"the dead letter resolved by its replay; log:\n{consume.log()}",
    )
    # A send span ends once its outcome is recorded, which may be after the consumer's.
    spans = spans_when(
        trace_file,
        lambda found: (
            matching(
                found,
                f"process {alpha}",
                messaging__message__id="order-1",
                reliable_messaging__outcome="processed",
            )
            and len(matching(found, f"send {alpha}")) == 2
            and matching(found, "send order.shipped")
        ),
        "the replayed copy's process span and every send span",
    )
    everything = spans
    assert Effect.objects.filter(consumer="view", message_id="order-1").exists()
    mine = [span for span in spans if span["trace_id"] == trace_id]

    # The view's transaction is the root; publish() is its child.
    view = only(matching(mine, "POST /orders"), "view span", everything)
    assert view["parent_span_id"] is None and view["service"] == "shop shell"
    published = only(matching(mine, "publish order.placed"), "publish span", everything)
    assert published["parent_span_id"] == view["span_id"]
    assert published["kind"] == "PRODUCER" and published["service"] == "shop shell"
    assert published["attributes"][MESSAGE_ID] == "order-1"
    # The relay's send, a child of publish (not of the relay's loop), with the row's wait.
    send = only(matching(mine, "send order.placed"), "send span", everything)
    assert send["parent_span_id"] == published["span_id"] and send["service"] == "shop relay"
    assert send["attributes"]["reliable_messaging.outbox.wait_ms"] >= 0
    assert send["attributes"][OUTCOME] == "sent"

    # Every attempt of alpha is a sibling under the send span, in the same trace.
    runs = sorted(
        matching(mine, f"process {alpha}", messaging__message__id="order-1"),
        key=lambda span: span["attributes"][ATTEMPT],
    )
    assert [run["attributes"][ATTEMPT] for run in runs] == [1, 2, 3], render_tree(spans, trace_id)
    assert [run["attributes"][OUTCOME] for run in runs] == [
        "retried",
        "retried",
        "dead_lettered",
    ]
    assert {run["parent_span_id"] for run in runs} == {send["span_id"]}
    assert all(run["status"] == "ERROR" and "exception" in run["events"] for run in runs)
    assert all(run["service"] == "shop consume" and run["kind"] == "CONSUMER" for run in runs)
    failed = runs[-1]
    assert failed["attributes"]["messaging.destination.name"] == f"rmtest.{ns}"
    assert failed["attributes"]["messaging.destination.subscription.name"] == alpha
    assert failed["attributes"]["messaging.rabbitmq.destination.routing_key"] == "order.placed"
    assert failed["attributes"]["reliable_messaging.consumer"] == "tests.alpha"

    # Beta processed it, and the message its handler published continues the trace.
    beta_run = only(
        matching(mine, f"process {beta}", messaging__message__id="order-1"), "beta", everything
    )
    assert beta_run["parent_span_id"] == send["span_id"]
    assert beta_run["attributes"][OUTCOME] == "processed" and beta_run["status"] != "ERROR"
    # Alpha's failure in the same batch had the batch run again (beta's first run rolled back
    # with it), so beta's handler may have called publish() twice: one row was sent.
    shipped_send = only(
        matching(mine, "send order.shipped"), "the shipped message's send", everything
    )
    publishes = matching(mine, "publish order.shipped")
    assert {s["parent_span_id"] for s in publishes} == {beta_run["span_id"]}
    assert shipped_send["parent_span_id"] in {s["span_id"] for s in publishes}
    for queue in (alpha, beta):
        second = only(
            matching(mine, f"process {queue}", messaging__message__id="order-1.beta"),
            f"{queue} of the shipped message",
            everything,
        )
        assert second["parent_span_id"] == shipped_send["span_id"]
        assert second["attributes"][OUTCOME] == "processed"

    # The dead letter kept the failed attempt's span; its history names the trace.
    assert first_failure == (trace_id, failed["span_id"])
    assert failures()[0]["trace_id"] == trace_id

    # Each replay is a new trace, linked to the failure it replays.
    replays = sorted(matching(spans, f"replay {alpha}"), key=lambda span: span["start"])
    assert len(replays) == 2, render_tree(spans, trace_id)
    outcomes = []
    for replay, replayed_failure in zip(replays, (first_failure, second_failure), strict=True):
        assert replay["parent_span_id"] is None and replay["trace_id"] != trace_id
        assert replay["service"] == "shop replay_dead_letters"
        assert [(link["trace_id"], link["span_id"]) for link in replay["links"]] == [
            replayed_failure
        ]
        again = [span for span in spans if span["trace_id"] == replay["trace_id"]]
        replay_send = only(matching(again, f"send {alpha}"), "replay's send", everything)
        assert replay_send["parent_span_id"] == replay["span_id"]
        assert replay_send["attributes"][OUTCOME] == "sent"
        copies = sorted(
            matching(again, f"process {alpha}"), key=lambda span: span["attributes"][ATTEMPT]
        )
        assert {copy["parent_span_id"] for copy in copies} == {replay_send["span_id"]}
        assert {span["name"] for span in again} == {
            f"replay {alpha}",
            f"send {alpha}",
            f"process {alpha}",
        }
        outcomes.append([(c["attributes"][ATTEMPT], c["attributes"][OUTCOME]) for c in copies])
        if replay is replays[0]:
            # Failed again: the dead letter now holds this trace's failed attempt.
            assert second_failure == (replay["trace_id"], copies[-1]["span_id"])
            assert failures()[1]["trace_id"] == replay["trace_id"]
    assert outcomes == [
        [(1, "retried"), (2, "retried"), (3, "dead_lettered")],
        [(1, "processed")],
    ]
    resolved = letter.history[-1]
    assert resolved["event"] == "resolved" and resolved["trace_id"] == replays[1]["trace_id"]
    # Nothing of the story leaked into another trace.
    assert {span["trace_id"] for span in spans} == {trace_id} | {r["trace_id"] for r in replays}


# --------------------------------------------------------------------------- batches, metrics


def exemplar_trace_ids(text: str, metric: str, consumer: str) -> set[str]:
    """Trace ids of the exemplars of ``metric``'s buckets for ``consumer`` (OpenMetrics)."""
    found = set()
    for line in text.splitlines():
        if (
            line.startswith(f"{metric}_bucket{{")
            and f'consumer="{consumer}"' in line
            and " # {" in line
        ):
            exemplar = line.split(" # {", 1)[1].split("}", 1)[0]
            assert exemplar.startswith('trace_id="'), line
            found.add(exemplar.split('"')[1])
    return found


def waiting_on_locks() -> int:
    """Sessions of the test database waiting for a lock now."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


def test_batched_deliveries_each_have_a_span_in_their_own_trace_and_metrics_exemplars(
    ns: str, tmp_path: Path, processes: list[ManageProcess], publisher: Publisher
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha", "--metrics-port", "0"],
        traced_env(ns, trace_file, RM_TEST_CONSUMER_BATCH_SIZE="20"),
        tmp_path / "consume.log",
    )
    processes.append(consume)
    processes.append(RelayProcess([], traced_env(ns, trace_file), tmp_path / "relay.log"))
    consume.wait_consuming()
    port = consume.ops_port()
    exchange = f"rmtest.{ns}"
    ids = {f"batch-{n}": random_ids() for n in range(5)}
    # The first message's handler waits for a row this test holds locked; the others arrive
    # meanwhile and wait for the worker together: one batch once the lock is let go.
    hot = Effect.objects.create(consumer="hot", message_id="hot-batch", attempt=0)
    with psycopg.connect(database_url()) as holder:
        holder.execute(f"SELECT 1 FROM {Effect._meta.db_table} WHERE id = %s FOR UPDATE", [hot.pk])
        publisher.publish(
            exchange, "order.placed", {"lock": {"alpha": ["hot-batch"]}}, message_id="sleeper"
        )
        wait_until(lambda: waiting_on_locks() == 1, timeout=20, message="the handler to wait")
        for message_id, (trace_id, span_id) in ids.items():
            publisher.publish(
                exchange,
                "order.placed",
                {"publish": {"alpha": "batch.done"}},  # the handler publishes, in its trace
                message_id=message_id,
                headers={"traceparent": traceparent(trace_id, span_id)},
            )
        wait_until(
            lambda: queue_counts(f"{ns}.alpha") == (0, 6),
            timeout=20,
            message="all six delivered to the consumer",
        )
        holder.rollback()
    spans = spans_when(
        trace_file,
        lambda found: (
            len(matching(found, f"process {ns}.alpha")) == 6
            and len(matching(found, "send batch.done")) == 5
        ),
        "six process spans and five sends",
    )
    sends = matching(spans, "send batch.done")
    runs = {
        message_id: only(
            matching(spans, f"process {ns}.alpha", messaging__message__id=message_id),
            message_id,
            spans,
        )
        for message_id in ids
    }
    for message_id, (trace_id, span_id) in ids.items():
        run = runs[message_id]
        assert (run["trace_id"], run["parent_span_id"]) == (trace_id, span_id)
        assert run["attributes"][OUTCOME] == "processed"
        # The handler's publish() nests in its own delivery's span, not in a batch sibling's.
        published = only(
            [s for s in matching(spans, "publish batch.done") if s["trace_id"] == trace_id],
            f"{message_id}'s publish",
            spans,
        )
        assert published["parent_span_id"] == run["span_id"]
        row = OutboxMessage.objects.get(message_id=f"{message_id}.alpha")
        assert row.headers["traceparent"] == traceparent(trace_id, published["span_id"])
        # The relay sent it in that trace too; nobody is bound to batch.done.
        send = only([s for s in sends if s["trace_id"] == trace_id], f"{message_id}'s send", spans)
        assert send["parent_span_id"] == published["span_id"]
        assert send["attributes"][OUTCOME] == "unrouted"
    # They were decided in one batch: every span covers the batch's transaction.
    assert max(r["start"] for r in runs.values()) < min(r["end"] for r in runs.values()), (
        "the five deliveries were not decided in one batch"
    )

    # The metrics, with exemplars pointing at the traced deliveries.
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    traced = {run["trace_id"] for run in runs.values()} | {
        s["trace_id"]
        for s in matching(spans, f"process {ns}.alpha", messaging__message__id="sleeper")
    }
    for metric in (
        "reliable_messaging_processing_time_seconds",
        "reliable_messaging_critical_time_seconds",
    ):
        assert f'{metric}_count{{consumer="tests.alpha"}} 6.0' in text, text
        exemplars = exemplar_trace_ids(text, metric, "tests.alpha")
        assert exemplars and exemplars <= traced, (metric, exemplars, traced)
    consume.send(signal.SIGTERM)
    assert consume.wait(30) == 0, consume.log()


# --------------------------------------------------------------------------- foreign producers


def test_a_foreign_producers_traceparent_is_the_parent_and_a_malformed_one_is_ignored(
    ns: str, tmp_path: Path, processes: list[ManageProcess], publisher: Publisher
) -> None:
    ensure_amqplib()
    trace_file = tmp_path / "spans.jsonl"
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha"], traced_env(ns, trace_file), tmp_path / "consume.log"
    )
    processes.append(consume)
    consume.wait_consuming()
    exchange = f"rmtest.{ns}"
    node, node_dead, not_json, as_bytes = random_ids(), random_ids(), random_ids(), random_ids()
    malformed = {
        "node-garbage": "00-not-a-trace-context",
        "node-uppercase": traceparent(uuid.uuid4().hex.upper(), "AB" * 8),
        "node-zero-trace": traceparent("0" * 32, "ab" * 8),
    }
    publish_with_amqplib(
        exchange,
        [
            {
                "routingKey": "order.placed",
                "messageId": "node-traced",
                "body": "{}",
                "headers": {"traceparent": traceparent(*node), "tracestate": "vendor=1"},
            },
            {
                "routingKey": "order.placed",
                "messageId": "node-dead",
                "body": json.dumps({"permanent": {"alpha": True}}),
                "headers": {"traceparent": traceparent(*node_dead)},
            },
            {
                "routingKey": "order.placed",
                "messageId": "node-not-json",
                "body": "{not json",
                "headers": {"traceparent": traceparent(*not_json)},
            },
            *(
                {
                    "routingKey": "order.placed",
                    "messageId": message_id,
                    "body": "{}",
                    "headers": {"traceparent": value},
                }
                for message_id, value in malformed.items()
            ),
        ],
    )
    # pika writes bytes as an AMQP byte array: the consumer gets bytes, not text.
    publisher.publish(
        exchange,
        "order.placed",
        {},
        message_id="pika-bytes",
        headers={"traceparent": traceparent(*as_bytes).encode()},
    )
    wait_until(
        lambda: (
            Effect.objects.filter(consumer="alpha").count() == 5  # one dead
            and DeadLetter.objects.count() == 2
        ),
        timeout=30,
        message=lambda: f"every foreign message handled; log:\n{consume.log()}",
    )
    spans = spans_when(
        trace_file,
        lambda found: len(matching(found, f"process {ns}.alpha")) == 7,
        "seven process spans",
    )

    def run_of(message_id: str) -> dict[str, Any]:
        return only(
            matching(spans, f"process {ns}.alpha", messaging__message__id=message_id),
            message_id,
            spans,
        )

    for message_id, (trace_id, span_id) in (("node-traced", node), ("pika-bytes", as_bytes)):
        run = run_of(message_id)
        assert (run["trace_id"], run["parent_span_id"]) == (trace_id, span_id), message_id
        assert run["attributes"][OUTCOME] == "processed"
    # Dead letters, one refused by the handler and one that is not JSON, keep their spans.
    for message_id, ids, reason in (
        ("node-dead", node_dead, "permanent"),
        ("node-not-json", not_json, "invalid_json"),
    ):
        dead_run = run_of(message_id)
        assert (dead_run["trace_id"], dead_run["parent_span_id"]) == ids
        assert dead_run["attributes"][OUTCOME] == "dead_lettered"
        assert dead_run["status"] == "ERROR"
        letter = DeadLetter.objects.get(message_id=message_id)
        assert letter.reason == reason
        assert (letter.trace_id, letter.span_id) == (ids[0], dead_run["span_id"])
    known = {node[0], node_dead[0], not_json[0], as_bytes[0]}
    for message_id in malformed:
        run = run_of(message_id)
        assert run["parent_span_id"] is None, message_id  # a new root
        assert run["trace_id"] not in known and run["trace_id"] != "0" * 32
        assert run["attributes"][OUTCOME] == "processed" and run["status"] != "ERROR"
    assert consume.returncode is None and "Traceback" not in consume.log()


# --------------------------------------------------------------------------- tracing off


def test_without_a_tracer_provider_nothing_is_traced_and_dead_letters_keep_the_header_ids(
    ns: str, tmp_path: Path, processes: list[ManageProcess], publisher: Publisher
) -> None:
    consume = ConsumeProcess(
        ["--queue", f"{ns}.alpha"], traced_env(ns, None), tmp_path / "consume.log"
    )
    processes.append(consume)
    consume.wait_consuming()
    exchange = f"rmtest.{ns}"
    dead, alive = random_ids(), random_ids()
    publisher.publish(
        exchange,
        "order.placed",
        {"permanent": {"alpha": True}},
        message_id="off-dead",
        headers={"traceparent": traceparent(*dead)},
    )
    publisher.publish(
        exchange,
        "order.placed",
        {},
        message_id="off-alive",
        headers={"traceparent": traceparent(*alive).encode()},
    )
    publisher.publish(exchange, "order.placed", {}, message_id="off-plain")
    wait_until(
        lambda: (
            Effect.objects.filter(consumer="alpha", message_id__startswith="off-").count() == 2
            and DeadLetter.objects.filter(message_id="off-dead").exists()
        ),
        timeout=30,
        message=lambda: f"the messages handled; log:\n{consume.log()}",
    )
    letter = DeadLetter.objects.get(message_id="off-dead")
    # The ids of the traceparent it came with: no span of this process took the span's place.
    assert (letter.trace_id, letter.span_id) == dead
    assert letter.history[0]["trace_id"] == dead[0]
    assert consume.returncode is None and "Traceback" not in consume.log()
