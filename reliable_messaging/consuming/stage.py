"""What a stage of the consumer's pipeline is given and returns: a :class:`Job`, a
:class:`DeliveryOutcome`, and the :class:`Stage` base every feature subclasses (see
:mod:`.pipeline`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..conf import MessagingSettings
from ..core.envelope import DecodeError, Delivery, Message
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel
from ..core.registry import ConsumerSpec


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


class Processor(Protocol):
    """The consumer a job is for, as the stages see it (:class:`~.processing.DeliveryProcessor`)."""

    spec: ConsumerSpec
    settings: MessagingSettings
    using: str
    cache: Any  # the fast path's DuplicateCache, or None
    failures: Any  # its DeliveryFailures: what a delivery that did not take effect becomes
    pipeline: Any  # its Pipeline
    guarded_batches: int

    def decode(self, delivery: Delivery) -> Message | DecodeError: ...

    def charge(self, job: Job, exc: Exception) -> DeliveryOutcome: ...

    def connection_usable(self) -> bool: ...


@dataclass(eq=False)
class Job:
    """One delivery for one consumer, as a worker hands it to the pipeline."""

    processor: Processor
    delivery: Delivery
    message: Message | DecodeError = field(init=False)
    # What the handler is given when a screen made it (the declared-payload stage: the message
    # with its payload as the declared type's object; the stage of tasks: the message with its
    # batch's attempts); None: ``message`` as decoded.
    for_handler: Message | None = field(default=None, init=False)
    name: str = field(init=False)  # the consumer's (its spec's name)

    def __post_init__(self) -> None:
        self.message = self.processor.decode(self.delivery)
        self.name = self.processor.spec.name


@dataclass(eq=False)
class Batch:
    """The jobs a pipeline decides together and, index for index, what became of each (None:
    not decided yet, or held behind an earlier delivery of its queue)."""

    jobs: Sequence[Job]
    decided: list[DeliveryOutcome | None]

    def outcomes(self) -> Iterator[tuple[Job, DeliveryOutcome]]:
        """The jobs decided, each with its outcome."""
        for job, done in zip(self.jobs, self.decided, strict=True):
            if done is not None:
                yield job, done


# What a stage's ``open`` returns when it has nothing to do for the batch: none of its other
# hooks runs for it, ``close`` included.
SITS_OUT: Any = object()


class Stage:
    """A feature of the consumer. Every hook is optional (the base does nothing); a stage
    keeps what a batch needs in the state :meth:`open` returns, never in a delivery or a
    thread-local: every later hook is given that state (``state``, None when the stage does not
    override :meth:`open`). A stage that cannot apply to a consumer says so in
    :meth:`applies_to`, and none of its hooks runs for that consumer's deliveries; one with
    nothing to do for a batch returns :data:`SITS_OUT` from :meth:`open`. When each hook runs
    and what it may change: :class:`~.pipeline.Pipeline`."""

    def applies_to(self, spec: ConsumerSpec) -> bool:
        """Whether the stage can do anything for ``spec``'s deliveries (asked once per
        consumer, so only of what the consumer's declaration fixes)."""
        return True

    def open(self, batch: Batch) -> Any:
        return None

    def screen(self, job: Job, message: Message, state: Any) -> DeliveryOutcome | None:
        return None

    def handling(
        self, job: Job, message: Message, state: Any
    ) -> AbstractContextManager[Any] | None:
        return None

    def decided(self, job: Job, message: Message, done: DeliveryOutcome, state: Any) -> None:
        return None

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        return None
