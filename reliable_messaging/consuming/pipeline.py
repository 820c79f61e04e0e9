"""The consumer's pipeline: the stages every batch of deliveries passes, in order.

:mod:`.processing` runs one path (claim, handler, decision) and calls each feature only
through the hooks of :class:`Stage`; a feature is a stage in a module of its own, listed in
:func:`default_pipeline`. The order of the stages and what each hook may change are written
here and nowhere else; ``docs/design.md#the-consumers-pipeline`` draws them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from ..core.envelope import DecodeError, Message
from .bindings import UnexpectedRoutingKey
from .decoding import Undecodable
from .expiry import Expiry
from .fastpath import FastPath
from .outcome_log import OutcomeLog
from .outcome_metrics import OutcomeMetrics
from .parking import ParkedKeys
from .payloads import DeclaredPayload
from .replays import ReplayLedger
from .retry_rows import RetryRows
from .spans import Spans
from .stage import Batch, DeliveryOutcome, Job, Stage
from .task_runs import TaskRuns
from .time_limit import TimeLimit

logger = logging.getLogger(__name__)


class Pipeline:
    """The stages in order; runs each hook of every stage that overrides it.

    ========== ============================================ ==================================
    hook       when                                         may change
    ========== ============================================ ==================================
    open       before the batch's transaction               settle a job (``batch.decided``),
                                                            write what an earlier stage
                                                            settled; returns the stage's state
    screen     in the transaction, before the inbox claim   decide the job: return an outcome;
                                                            or set ``job.for_handler``
    handling   around the handler, in its savepoint         nothing (a context around it)
    decided    in the transaction, after the decision       write in the transaction
    close      after the commit (``error`` None) or not     nothing (report, remember)
    ========== ============================================ ==================================

    Every hook after ``open`` is given, as its last argument, the state that stage's ``open``
    returned for the batch (None when it does not override ``open``): a stage keeps a batch's
    state there, never in a thread-local. The first screen, :class:`~.decoding.Undecodable`,
    decides every delivery that could not be decoded, so the other screens and the later hooks
    are given a decoded :class:`Message`.
    """

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        self._screens = self._overriding("screen")
        self._handlings = self._overriding("handling")
        self._decideds = self._overriding("decided")

    def _overriding(self, hook: str) -> tuple[tuple[int, Any], ...]:
        """The stages' ``hook`` methods that do something, each with its stage's index."""
        return tuple(
            (index, getattr(stage, hook))
            for index, stage in enumerate(self.stages)
            if getattr(type(stage), hook) is not getattr(Stage, hook)
        )

    @contextmanager
    def around(self, batch: Batch) -> Iterator[BatchStages]:
        """Around the deciding of ``batch``: each stage's ``open`` before, ``close`` after (in
        reverse order); in between, the hooks of the stages given their states. A stage's
        failure in ``close`` is logged, never a delivery's outcome."""
        states = [stage.open(batch) for stage in self.stages]
        error: BaseException | None = None
        try:
            yield BatchStages(self, states)
        except BaseException as exc:
            error = exc
            raise
        finally:
            for stage, state in zip(reversed(self.stages), reversed(states), strict=True):
                try:
                    stage.close(batch, state, error)
                except Exception:
                    logger.exception("the consumer stage %s failed after a batch", stage)


class BatchStages:
    """The pipeline's hooks for one batch, between its ``open`` and its ``close``: each
    stage's ``screen``, ``handling`` and ``decided``, given the state its ``open`` returned."""

    __slots__ = ("_decideds", "_handlings", "_screens")

    def __init__(self, pipeline: Pipeline, states: Sequence[Any]) -> None:
        self._screens = tuple((hook, states[i]) for i, hook in pipeline._screens)
        self._handlings = tuple((hook, states[i]) for i, hook in pipeline._handlings)
        self._decideds = tuple((hook, states[i]) for i, hook in pipeline._decideds)

    def screen(self, job: Job, message: Message | DecodeError) -> DeliveryOutcome | None:
        for screen, state in self._screens:
            done = screen(job, message, state)
            if done is not None:
                return done
        return None

    def handling(self, job: Job, message: Message) -> ExitStack:
        stack = ExitStack()
        for handling, state in self._handlings:
            context = handling(job, message, state)
            if context is not None:
                stack.enter_context(context)
        return stack

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        for decided, state in self._decideds:
            decided(job, message, done, state)


@functools.cache
def default_pipeline() -> Pipeline:
    """The consumer's stages, in their order: the screens in the order a delivery is judged, the
    handler's contexts outermost first, the reports in reverse (the span ends last)."""
    return Pipeline(
        [
            Spans(),
            FastPath(),
            Undecodable(),
            UnexpectedRoutingKey(),
            Expiry(),
            ParkedKeys(),
            DeclaredPayload(),
            TimeLimit(),
            RetryRows(),
            ReplayLedger(),
            TaskRuns(),
            OutcomeMetrics(),
            OutcomeLog(),
        ]
    )
