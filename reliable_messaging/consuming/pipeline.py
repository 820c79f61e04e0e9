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
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.envelope import DecodeError, Delivery, Message
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel

if TYPE_CHECKING:
    from .processing import DeliveryProcessor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeliveryOutcome:
    """What became of a delivery: the ``outcome`` the connection's thread carries out, and
    what the stages report of it once the transaction committed."""

    outcome: Outcome
    label: OutcomeLabel
    duration: float | None = None  # the handler's run time, when it ran
    processed: bool = False  # the inbox holds the message now
    detail: str = ""  # why, in words (the log line's and the span's)
    error: BaseException | None = None  # the handler's exception
    # A dead letter of the message may be open (the claim says; True when it could not tell).
    copies_open: bool = True
    from_cache: bool = False  # settled by the fast path, before the transaction


# The inbox holds the message already: acked without running the handler.
DUPLICATE = DeliveryOutcome(
    Acknowledge(OutcomeLabel.DUPLICATE), OutcomeLabel.DUPLICATE, processed=True
)


@dataclass(eq=False)
class Job:
    """One delivery for one consumer, as a worker hands it to the pipeline."""

    processor: DeliveryProcessor
    delivery: Delivery
    message: Message | DecodeError = field(init=False)

    def __post_init__(self) -> None:
        self.message = self.processor.decode(self.delivery)

    @property
    def name(self) -> str:
        return self.processor.spec.name


class Stage:
    """A feature of the consumer. Every hook is optional (the base does nothing); a stage
    keeps what a batch needs in the state :meth:`open` returns, never in a delivery.

    ========== ============================================ ==================================
    hook       when                                         may change
    ========== ============================================ ==================================
    open       before the batch's transaction               settle a job (``decided[i]``)
    screen     in the transaction, before the inbox claim   decide the job: return an outcome
    handling   around the handler, in its savepoint         nothing (a context around it)
    decided    in the transaction, after the decision       write in the transaction
    close      after the commit (``error`` None) or not     nothing (report, remember)
    ========== ============================================ ==================================
    """

    def open(self, jobs: Sequence[Job], decided: list[DeliveryOutcome | None]) -> Any:
        return None

    def screen(self, job: Job, message: Message) -> DeliveryOutcome | None:
        return None

    def handling(self, job: Job, message: Message) -> AbstractContextManager[Any] | None:
        return None

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        return None

    def close(
        self,
        jobs: Sequence[Job],
        decided: Sequence[DeliveryOutcome | None],
        state: Any,
        error: BaseException | None,
    ) -> None:
        return None


class Pipeline:
    """The stages in order; runs each hook of every stage that overrides it."""

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
    def batch(self, jobs: Sequence[Job], decided: list[DeliveryOutcome | None]) -> Iterator[None]:
        """Around the deciding of ``jobs``: each stage's ``open`` before, ``close`` after (in
        reverse order). A stage's failure in ``close`` is logged, never a delivery's outcome."""
        states = [stage.open(jobs, decided) for stage in self.stages]
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            for stage, state in zip(reversed(self.stages), reversed(states), strict=True):
                try:
                    stage.close(jobs, decided, state, error)
                except Exception:
                    logger.exception("the consumer stage %s failed after a batch", stage)

    def screen(self, job: Job, message: Message) -> DeliveryOutcome | None:
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
    from .bindings import UnexpectedRoutingKey
    from .expiry import Expiry
    from .fastpath import FastPath
    from .outcome_log import OutcomeLog
    from .outcome_metrics import OutcomeMetrics
    from .parking import ParkedKeys
    from .replays import ReplayLedger
    from .spans import Spans
    from .time_limit import TimeLimit

    return Pipeline(
        [
            Spans(),
            FastPath(),
            UnexpectedRoutingKey(),
            Expiry(),
            ParkedKeys(),
            TimeLimit(),
            ReplayLedger(),
            OutcomeMetrics(),
            OutcomeLog(),
        ]
    )
