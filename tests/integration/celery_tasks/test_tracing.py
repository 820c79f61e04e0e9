"""``@idempotent_task`` traced through a real Celery worker.

A sender process sends the task inside a span of its own (as a view would) and the worker runs
it; both export their spans to the test's trace file (``RM_TRACE_FILE`` in their environment
only, as in tests/e2e/test_tracing.py). The task's ``process`` span must be a child of the
sender's span, carried in the task message by the ``before_task_publish`` handler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.models import ProcessedMessage
from tests.conftest import database_url
from tests.e2e.test_tracing import read_spans, render_tree
from tests.support import ROOT, wait_until

from .tasks import email_receipt
from .worker import CeleryWorker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

RECEIPTS = email_receipt.name

# Sends each order's receipt task inside a span of its own; prints the span's ids.
SENDER = """
import json, os, sys
import django

django.setup()
from opentelemetry import trace

import tests.integration.celery_tasks.tasks  # the task is known here, as in a project
from tests.integration.celery_tasks.celery_app import app

tracer = trace.get_tracer("tests.checkout")
for order_id in json.loads(sys.argv[1]):
    with tracer.start_as_current_span("POST /checkout") as span:
        app.send_task(%(task)r, args=[order_id], queue=os.environ["RM_CELERY_QUEUE"])
    context = span.get_span_context()
    print("sent", format(context.trace_id, "032x"), format(context.span_id, "016x"))
"""


@pytest.fixture
def traced_worker(ns: str, tmp_path: Path) -> Iterator[CeleryWorker]:
    running = CeleryWorker(
        f"rmtest.{ns}.celery",
        tmp_path / "celery-worker.log",
        env={"RM_TRACE_FILE": str(tmp_path / "spans.jsonl")},
    )
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def send_traced(worker: CeleryWorker, trace_file: Path, orders: list[int]) -> list[tuple[str, str]]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "RM_CELERY_QUEUE": worker.queue,
        "RM_TRACE_FILE": str(trace_file),
    }
    done = subprocess.run(
        [sys.executable, "-c", SENDER % {"task": RECEIPTS}, json.dumps(orders)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sent = [line.split() for line in done.stdout.splitlines() if line.startswith("sent ")]
    return [(trace_id, span_id) for _, trace_id, span_id in sent]


def task_spans(trace_file: Path) -> list[dict[str, Any]]:
    return [span for span in read_spans(trace_file) if span["name"] == f"process {RECEIPTS}"]


def test_the_task_span_is_a_child_of_the_senders_span_and_a_duplicate_says_so(
    traced_worker: CeleryWorker, tmp_path: Path
) -> None:
    trace_file = tmp_path / "spans.jsonl"
    # The same order twice, each sent in a trace of its own: the second is a duplicate.
    (first, second) = send_traced(traced_worker, trace_file, [71, 71])
    wait_until(
        lambda: len(task_spans(trace_file)) == 2,
        timeout=60,
        message=lambda: f"two task spans; worker log:\n{traced_worker.log()}",
    )
    spans = read_spans(trace_file)
    runs = {span["trace_id"]: span for span in task_spans(trace_file)}
    assert sorted(runs) == sorted([first[0], second[0]]), "\n".join(
        render_tree(spans, t) for t in {s["trace_id"] for s in spans}
    )
    for (trace_id, span_id), outcome in ((first, "processed"), (second, "duplicate")):
        run = runs[trace_id]
        assert run["parent_span_id"] == span_id
        assert run["kind"] == "CONSUMER" and run["status"] != "ERROR"
        assert run["attributes"]["reliable_messaging.outcome"] == outcome
        assert run["attributes"]["messaging.system"] == "celery"
        assert run["attributes"]["reliable_messaging.idempotency_key"] == "receipt:71"
    senders = {s["span_id"] for s in spans if s["name"] == "POST /checkout"}
    assert senders == {first[1], second[1]}
    assert "Traceback" not in traced_worker.log()
    assert list(
        ProcessedMessage.objects.filter(consumer=RECEIPTS).values_list("message_id", flat=True)
    ) == ["receipt:71"]
