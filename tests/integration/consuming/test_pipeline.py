"""The consumer's pipeline: a stage registered beside the others sees every delivery through
each hook, may decide a delivery before its inbox claim, and cannot break a batch by failing
after it; and the decision code names no feature.

What the stages do together is tested feature by feature (``test_features_meet.py`` and the
e2e suite); this file holds the contract a new stage relies on.
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import reliable_messaging.consuming.processing as processing
from reliable_messaging.consuming.pipeline import Pipeline, default_pipeline
from reliable_messaging.consuming.processing import DeliveryProcessor, process_batch
from reliable_messaging.consuming.stage import SITS_OUT, Batch, DeliveryOutcome, Job, Stage
from reliable_messaging.core.envelope import Delivery, Message, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, OutcomeLabel
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.testing import find_consumer
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


class Watcher(Stage):
    """Writes down each hook it sees; refuses message ids starting with ``refuse-``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def open(self, batch: Batch) -> Any:
        self.seen += [("open", job.delivery.message_id or "") for job in batch.jobs]
        return "state"

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        assert state == "state"
        self.seen.append(("screen", message.message_id))
        if message.message_id.startswith("refuse-"):
            return job.processor.failures.dead_letter(
                job.delivery, message, "unexpected_routing_key", "refused by the watcher"
            )
        return None

    @contextmanager
    def _around(self, message_id: str) -> Iterator[None]:
        self.seen.append(("before handler", message_id))
        yield
        self.seen.append(("after handler", message_id))

    def handling(self, job: Job, message: Message, state: Any) -> Any:
        assert state == "state"
        return self._around(message.message_id)

    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        assert state == "state"
        self.seen.append((f"decided {done.label}", message.message_id))

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        assert state == "state"
        self.seen += [(f"close {d.label if d else None}", "") for d in batch.decided]
        if any(job.delivery.message_id == "explode-after" for job in batch.jobs):
            raise RuntimeError("a stage's own bug after the commit")


def processor_with(*extra: Stage) -> DeliveryProcessor:
    pipeline = Pipeline([*default_pipeline().stages, *extra])
    return DeliveryProcessor(find_consumer("tests.alpha"), pipeline=pipeline)


def job(processor: DeliveryProcessor, message_id: str, payload: Any = None) -> Job:
    delivery = Delivery(
        body=encode_payload(payload or {}),
        queue=processor.spec.queue,
        exchange="rmtest",
        routing_key="order.placed",
        message_id=message_id,
        content_type="application/json",
    )
    return Job(processor, delivery)


def test_a_registered_stage_sees_each_delivery_through_every_hook_in_order() -> None:
    watcher = Watcher()
    processor = processor_with(watcher)
    outcomes = process_batch([job(processor, "m-1"), job(processor, "m-1")])
    assert outcomes == [Acknowledge("processed"), Acknowledge("duplicate")]
    assert watcher.seen == [
        ("open", "m-1"),
        ("open", "m-1"),
        ("screen", "m-1"),
        ("screen", "m-1"),
        ("before handler", "m-1"),
        ("after handler", "m-1"),
        ("decided processed", "m-1"),
        ("decided duplicate", "m-1"),
        ("close processed", ""),
        ("close duplicate", ""),
    ]


class Counter(Stage):
    """Keeps what it counts of a batch in the state its ``open`` returns: a new list per batch,
    which every later hook is given."""

    def __init__(self) -> None:
        self.closed: list[list[tuple[str, str]]] = []

    def open(self, batch: Batch) -> Any:
        return [("open", job.delivery.message_id or "") for job in batch.jobs]

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        state.append(("screen", message.message_id))
        return None

    @contextmanager
    def _around(self, state: list[tuple[str, str]], message_id: str) -> Iterator[None]:
        state.append(("handling", message_id))
        yield

    def handling(self, job: Job, message: Message, state: Any) -> Any:
        return self._around(state, message.message_id)

    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        state.append((f"decided {done.label}", message.message_id))

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        self.closed.append(state)


class Stateless(Stage):
    """Overrides every hook but ``open``: it is given None."""

    def __init__(self) -> None:
        self.states: list[Any] = []

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        self.states.append(state)
        return None

    def handling(self, job: Job, message: Message, state: Any) -> Any:
        self.states.append(state)
        return None

    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        self.states.append(state)


def test_each_stage_is_given_the_state_its_open_returned_in_every_hook() -> None:
    """Two batches, each with its own state; a stage beside it without ``open`` gets None."""
    counter, stateless = Counter(), Stateless()
    processor = processor_with(counter, stateless)
    assert process_batch([job(processor, "s-1"), job(processor, "s-1")]) == [
        Acknowledge("processed"),
        Acknowledge("duplicate"),
    ]
    assert process_batch([job(processor, "s-2")]) == [Acknowledge("processed")]
    assert counter.closed == [
        [
            ("open", "s-1"),
            ("open", "s-1"),
            ("screen", "s-1"),
            ("screen", "s-1"),
            ("handling", "s-1"),
            ("decided processed", "s-1"),
            ("decided duplicate", "s-1"),
        ],
        [("open", "s-2"), ("screen", "s-2"), ("handling", "s-2"), ("decided processed", "s-2")],
    ]
    assert stateless.states == [None] * 8


class AlphaOnly(Watcher):
    """A watcher that applies to tests.alpha's consumer alone."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def applies_to(self, spec: ConsumerSpec) -> bool:
        self.asked.append(spec.name)
        return spec.name == "tests.alpha"


def test_a_stage_that_does_not_apply_to_a_consumer_sees_none_of_its_deliveries() -> None:
    """Asked once per consumer; not opened for a batch of the other consumer's alone, and in a
    batch of both given the hooks of its own consumer's deliveries only."""
    only = AlphaOnly()
    pipeline = Pipeline([*default_pipeline().stages, only])
    alpha = DeliveryProcessor(find_consumer("tests.alpha"), pipeline=pipeline)
    beta = DeliveryProcessor(find_consumer("tests.beta"), pipeline=pipeline)
    assert process_batch([job(beta, "b-1")]) == [Acknowledge("processed")]
    assert only.seen == []
    outcomes = process_batch([job(beta, "b-2"), job(alpha, "a-1"), job(beta, "b-3")])
    assert outcomes == [Acknowledge("processed")] * 3
    assert [seen for seen in only.seen if not seen[0].startswith(("open", "close"))] == [
        ("screen", "a-1"),
        ("before handler", "a-1"),
        ("after handler", "a-1"),
        ("decided processed", "a-1"),
    ]
    assert Effect.objects.filter(message_id__in=["b-1", "b-2", "a-1", "b-3"]).count() == 4
    assert process_batch([job(alpha, "a-2")]) == [Acknowledge("processed")]
    assert sorted(only.asked) == ["tests.alpha", "tests.beta"]


class SitsOutOfRefusals(Watcher):
    """Has nothing to do for a batch holding a message id starting ``quiet-``."""

    def open(self, batch: Batch) -> Any:
        if any((job.delivery.message_id or "").startswith("quiet-") for job in batch.jobs):
            self.seen.append(("sits out", ""))
            return SITS_OUT
        return super().open(batch)


def test_a_stage_sitting_out_a_batch_has_none_of_its_hooks_run_for_it() -> None:
    stage = SitsOutOfRefusals()
    processor = processor_with(stage)
    assert process_batch([job(processor, "quiet-1"), job(processor, "refuse-2")]) == [
        Acknowledge("processed"),
        Acknowledge("processed"),  # its screen would have refused it
    ]
    assert stage.seen == [("sits out", "")]
    assert process_batch([job(processor, "refuse-3")]) == [
        Acknowledge(OutcomeLabel.DEAD_LETTERED, "unexpected_routing_key")
    ]


def test_a_screen_decides_before_the_claim_and_the_handler() -> None:
    watcher = Watcher()
    processor = processor_with(watcher)
    outcomes = process_batch([job(processor, "refuse-1"), job(processor, "ok-1")])
    assert outcomes == [
        Acknowledge(OutcomeLabel.DEAD_LETTERED, "unexpected_routing_key"),
        Acknowledge("processed"),
    ]
    assert ("before handler", "refuse-1") not in watcher.seen
    assert not ProcessedMessage.objects.filter(message_id="refuse-1").exists()
    assert DeadLetter.objects.get(message_id="refuse-1").exception_message == (
        "refused by the watcher"
    )
    assert Effect.objects.filter(message_id="refuse-1").count() == 0


def test_an_undecodable_delivery_is_a_dead_letter_that_no_later_screen_sees() -> None:
    """The decoding stage screens first: a stage's screen and ``decided`` are given decoded
    messages only, and what could not be decoded is a dead letter before any claim."""
    watcher = Watcher()
    processor = processor_with(watcher)
    broken = Job(
        processor,
        Delivery(
            body=b"{not json",
            queue=processor.spec.queue,
            exchange="rmtest",
            routing_key="order.placed",
            message_id="broken-1",
            content_type="application/json",
        ),
    )
    outcomes = process_batch([broken, job(processor, "ok-2")])
    assert outcomes == [
        Acknowledge(OutcomeLabel.DEAD_LETTERED, "invalid_json"),
        Acknowledge("processed"),
    ]
    assert [seen for seen in watcher.seen if seen[1] == "broken-1"] == [("open", "broken-1")]
    assert DeadLetter.objects.get(message_id="broken-1").reason == "invalid_json"
    assert not ProcessedMessage.objects.filter(message_id="broken-1").exists()


def test_a_stage_failing_after_the_commit_changes_no_outcome(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watcher = Watcher()
    processor = processor_with(watcher)
    with caplog.at_level(logging.ERROR, logger="reliable_messaging.consuming.pipeline"):
        outcomes = process_batch([job(processor, "explode-after")])
    assert outcomes == [Acknowledge("processed")]
    assert Effect.objects.filter(message_id="explode-after").count() == 1
    assert "failed after a batch" in caplog.text


def test_the_decision_code_names_no_feature() -> None:
    """processing.py imports the pipeline, the policy and the storage it claims with; every
    feature reaches it only as a stage."""
    tree = ast.parse(Path(processing.__file__).read_text())
    imported = {
        node.module
        for node in tree.body  # not those under TYPE_CHECKING: types only
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    stage_modules = {
        type(stage).__module__.rsplit(".", 1)[-1] for stage in default_pipeline().stages
    }
    assert not {module.lstrip(".") for module in imported} & stage_modules, imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"tracing", "metrics", "ledger", "expiry_of", "time_limits"}
