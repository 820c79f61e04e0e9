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
    open       before the batch's transaction               settle a job (``batch.decided``)
    screen     in the transaction, before the inbox claim   decide the job: return an outcome;
                                                            or set ``job.for_handler``
    handling   around the handler, in its savepoint         nothing (a context around it)
    decided    in the transaction, after the decision       write in the transaction
    close      after the commit (``error`` None) or not     nothing (report, remember)
    ========== ============================================ ==================================

    The first screen, :class:`~.decoding.Undecodable`, decides every delivery that could not be
    decoded, so the other screens and the later hooks are given a decoded :class:`Message`.
    """

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        self._screens = self._overriding("screen")
        self._handlings = self._overriding("handling")
        self._decideds = self._overriding("decided")

    def _overriding(self, hook: str) -> tuple[Any, ...]:
        return tuple(
            getattr(stage, hook)
            for stage in self.stages
            if getattr(type(stage), hook) is not getattr(Stage, hook)
        )

    @contextmanager
    def around(self, batch: Batch) -> Iterator[None]:
        """Around the deciding of ``batch``: each stage's ``open`` before, ``close`` after (in
        reverse order). A stage's failure in ``close`` is logged, never a delivery's outcome."""
        states = [stage.open(batch) for stage in self.stages]
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            for stage, state in zip(reversed(self.stages), reversed(states), strict=True):
                try:
                    stage.close(batch, state, error)
                except Exception:
                    logger.exception("the consumer stage %s failed after a batch", stage)

    def screen(self, job: Job, message: Message | DecodeError) -> DeliveryOutcome | None:
        for screen in self._screens:
            done = screen(job, message)
            if done is not None:
                return done
        return None

    def handling(self, job: Job, message: Message) -> ExitStack:
        stack = ExitStack()
        for handling in self._handlings:
            context = handling(job, message)
            if context is not None:
                stack.enter_context(context)
        return stack

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        for decided in self._decideds:
            decided(job, message, done)


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
            ReplayLedger(),
            TaskRuns(),
            OutcomeMetrics(),
            OutcomeLog(),
        ]
    )
