"""The consumer's pipeline: the stages every batch of deliveries passes, in order.

:mod:`.processing` runs one path (claim, handler, decision) and calls each feature only
through the hooks of :class:`Stage`; a feature is a stage in a module of its own, listed in
:func:`default_pipeline`. The order of the stages and what each hook may change are written
here and nowhere else; ``docs/design.md#the-consumers-pipeline`` draws them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from ..core.envelope import DecodeError, Message
from ..core.registry import ConsumerSpec
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
from .stage import SITS_OUT, Batch, DeliveryOutcome, Job, Stage
from .task_runs import TaskRuns
from .time_limit import TimeLimit

logger = logging.getLogger(__name__)


class Pipeline:
    """The stages in order; runs each hook of every stage that overrides it and applies to the
    job's consumer (:meth:`Stage.applies_to`).

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
    are given a decoded :class:`Message`. A stage that applies to none of a batch's consumers
    is neither opened nor closed for it; what a stage costs a consumer it cannot apply to is
    one look-up when the consumer's first batch runs. One whose ``open`` returns ``SITS_OUT``
    has no other hook run for that batch.
    """

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        # By consumer name: its spec and what applies to it (made again for a new spec).
        self._applying: dict[str, tuple[ConsumerSpec, _Applying]] = {}

    def _applying_to(self, spec: ConsumerSpec) -> _Applying:
        """The stages that apply to ``spec``'s consumer, and their hooks that do something."""
        known = self._applying.get(spec.name)
        if known is not None and known[0] is spec:
            return known[1]
        indexes = [i for i, stage in enumerate(self.stages) if stage.applies_to(spec)]
        applying = _Applying(
            frozenset(indexes),
            self._overriding(indexes, "screen"),
            self._overriding(indexes, "handling"),
            self._overriding(indexes, "decided"),
        )
        self._applying[spec.name] = (spec, applying)
        return applying

    def _overriding(self, indexes: Sequence[int], hook: str) -> tuple[tuple[int, Any], ...]:
        """The ``hook`` methods that do something of the stages at ``indexes``, each with its
        stage's index."""
        return tuple(
            (index, getattr(self.stages[index], hook))
            for index in indexes
            if getattr(type(self.stages[index]), hook) is not getattr(Stage, hook)
        )

    @contextmanager
    def around(self, batch: Batch) -> Iterator[BatchStages]:
        """Around the deciding of ``batch``: each stage's ``open`` before, ``close`` after (in
        reverse order), of the stages that apply to one of its consumers at least; in between,
        the hooks of the stages given their states. A stage's failure in ``close`` is logged,
        never a delivery's outcome."""
        applying: dict[str, _Applying] = {}
        for job in batch.jobs:
            if job.name not in applying:
                applying[job.name] = self._applying_to(job.processor.spec)
        opened = frozenset().union(*(each.stages for each in applying.values()))
        stages = [(i, stage) for i, stage in enumerate(self.stages) if i in opened]
        states: list[Any] = [None] * len(self.stages)
        for index, stage in stages:
            states[index] = stage.open(batch)
        stages = [(i, stage) for i, stage in stages if states[i] is not SITS_OUT]
        error: BaseException | None = None
        try:
            yield BatchStages(applying, states)
        except BaseException as exc:
            error = exc
            raise
        finally:
            for index, stage in reversed(stages):
                try:
                    stage.close(batch, states[index], error)
                except Exception:
                    logger.exception("the consumer stage %s failed after a batch", stage)


@dataclass(frozen=True)
class _Applying:
    """What of a pipeline applies to one consumer: its stages' indexes, and the hooks that
    do something, each with its stage's index."""

    stages: frozenset[int]
    screens: tuple[tuple[int, Any], ...]
    handlings: tuple[tuple[int, Any], ...]
    decideds: tuple[tuple[int, Any], ...]


class BatchStages:
    """The pipeline's hooks for one batch, between its ``open`` and its ``close``: each
    stage's ``screen``, ``handling`` and ``decided`` that applies to the job's consumer, given
    the state its ``open`` returned."""

    __slots__ = ("_hooks",)

    def __init__(self, applying: Mapping[str, _Applying], states: Sequence[Any]) -> None:
        # By consumer: its screens, its handlings and its decideds, each bound to its state.
        self._hooks = {
            name: tuple(
                tuple((hook, states[i]) for i, hook in hooks if states[i] is not SITS_OUT)
                for hooks in (each.screens, each.handlings, each.decideds)
            )
            for name, each in applying.items()
        }

    def screen(self, job: Job, message: Message | DecodeError) -> DeliveryOutcome | None:
        """The outcome the first of ``job``'s screens decided, already reported to its
        ``decided`` hooks; None when every screen let it through to the inbox claim."""
        for screen, state in self._hooks[job.name][0]:
            done = screen(job, message, state)
            if done is not None:
                if isinstance(message, Message):
                    self.decided(job, message, done)
                return done
        return None

    def handling(self, job: Job, message: Message) -> AbstractContextManager[Any]:
        """The context around ``job``'s handler: its stages' contexts, outermost first."""
        contexts = []
        for handling, state in self._hooks[job.name][1]:
            context = handling(job, message, state)
            if context is not None:
                contexts.append(context)
        if len(contexts) == 1:
            return contexts[0]
        with ExitStack() as stack:  # a context that fails to enter exits those before it
            for context in contexts:
                stack.enter_context(context)
            return stack.pop_all()

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        for decided, state in self._hooks[job.name][2]:
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
