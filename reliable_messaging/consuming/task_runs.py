"""The consumer's stage of ``django.tasks`` tasks (:mod:`reliable_messaging.task_runs`): RUNNING
before a batch's transaction, each attempt's outcome in it, ``task_finished`` after the commit
(``docs/tasks.md``). The task framework is imported only for a batch that holds tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from ..core.registry import ConsumerSpec
from ..task_runs.naming import is_task_consumer, task_id_of
from .stage import Batch, DeliveryOutcome, Job, Stage

if TYPE_CHECKING:
    from ..task_runs.worker import Attempts


def _task_id(job: Job) -> str | None:
    """The task of ``job``'s message, if it is that task's (published under its id)."""
    if not is_task_consumer(job.name) or not isinstance(job.message, Message):
        return None
    task_id = task_id_of(job.message)
    return task_id if task_id == job.message.message_id else None


@dataclass(eq=False)
class _Tasks:
    """A batch's tasks: its attempts, and which of its jobs the current transaction screened
    (``screened``) and has not decided yet (``awaiting``)."""

    attempts: Attempts
    ids: dict[Job, str]  # the task of each job this stage looked at in ``open``
    screened: set[Job] = field(default_factory=set)
    awaiting: set[Job] = field(default_factory=set)

    def id_of(self, job: Job) -> str | None:
        return self.ids[job] if job in self.ids else _task_id(job)


class TaskRuns(Stage):
    def applies_to(self, spec: ConsumerSpec) -> bool:
        return is_task_consumer(spec.name)

    def open(self, batch: Batch) -> Any:
        ids = {
            job: task_id
            for job, done in zip(batch.jobs, batch.decided, strict=True)
            if done is None and (task_id := _task_id(job)) is not None
        }
        if not ids:
            return None
        from ..task_runs.worker import start_attempts

        # Once per task: two copies of its message in one batch are one attempt (the inbox
        # lets one of them run). Only for a message that names the row's task (run_task refuses
        # the others, which the row is not charged for).
        paths: dict[str, set[str]] = {}
        for job, task_id in ids.items():
            named = paths.setdefault(task_id, set())
            path = job.message.payload.get("task")  # type: ignore[union-attr]  # see _task_id
            # Text a statement can carry (no NUL, no lone surrogate): no row's path is other.
            if isinstance(path, str) and path.isprintable():
                named.add(path)
        attempts = start_attempts(batch.jobs[0].processor.using, paths)
        return _Tasks(attempts, ids)

    def screen(self, job: Job, message: Message, state: _Tasks | None) -> DeliveryOutcome | None:
        if state is None or state.id_of(job) is None:
            return None
        from ..task_runs.worker import TaskMessage

        if job in state.screened:
            # Screened again: the batch is decided anew in a new transaction (the last one
            # rolled back, or each delivery now alone), so what that one ran is gone.
            state.screened.clear()
            state.awaiting.clear()
            state.attempts.forget()
        state.screened.add(job)
        state.awaiting.add(job)
        # The handler (run_task) takes the task's row from the batch's attempts.
        job.for_handler = TaskMessage.of(job.for_handler or message, state.attempts)
        return None

    def decided(
        self, job: Job, message: Message, done: DeliveryOutcome, state: _Tasks | None
    ) -> None:
        task_id = _task_id(job) if state is None else state.id_of(job)
        if task_id is None:
            return
        if done.label is OutcomeLabel.PROCESSED:
            if state is not None:
                state.attempts.processed(task_id)
        elif done.label is OutcomeLabel.RETRIED:
            from ..task_runs.worker import record_retry

            record_retry(job.processor.using, task_id, done.error)
        elif done.label is OutcomeLabel.DEFERRED:
            # Counted in open, before the inbox claim could tell that another worker holds
            # the delivery: counting after the claim instead would lose the attempts that kill
            # their process, so the put-aside one is taken back here.
            from ..task_runs.worker import take_back_attempt

            take_back_attempt(job.processor.using, task_id)
        if state is not None:
            state.awaiting.discard(job)
            if not state.awaiting:
                # Every task this transaction screened is decided: its handlers have all run.
                state.attempts.write_successes()

    def close(self, batch: Batch, state: _Tasks | None, error: BaseException | None) -> None:
        if state is None:
            return
        from ..task_runs.worker import end_attempts, send_finished

        processed: dict[str, None] = {}
        if error is None:
            for job, done in batch.outcomes():
                task_id = state.id_of(job)
                if task_id is not None and done.label is OutcomeLabel.PROCESSED:
                    processed[task_id] = None
        end_attempts(state.attempts, processed=list(processed))
        if processed:
            # A dead-lettered task's task_finished follows its dead letter's commit
            # (task_runs.failures), on this path as on the crash guard's and the .dead queue's.
            send_finished(state.attempts, list(processed))
