"""The consumer's stage of ``django.tasks`` tasks (:mod:`reliable_messaging.task_runs`).

Around the deliveries of the task queues' consumers: RUNNING and one more attempt committed
before the batch's transaction, in one statement that also reads the rows the handler runs
(so a caller's ``get_result()`` sees RUNNING while the task runs, and an attempt that kills its
process still counts) with ``task_started``; in the transaction, a failed attempt's error with
READY again (a retry), or the attempt taken back when the delivery was put aside because
another worker holds it, and SUCCESSFUL with the return values of the processed ones in one
statement once the last task screened in the transaction is decided; after the commit,
``task_finished``. FAILED is written with the dead letter
(``dead_letters.record.record_dead_letter``), so a dead letter recorded without this stage (the
crash guard's, the ``.dead`` queue's) fails its task too. The task framework is an optional
extra on Django 5.2: it is imported only for a batch that holds tasks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from ..task_runs.naming import is_task_consumer, task_id_of
from .stage import Batch, DeliveryOutcome, Job, Stage

if TYPE_CHECKING:
    from ..task_runs.worker import Attempts


def _task_id(job: Job) -> str | None:
    if not is_task_consumer(job.name) or not isinstance(job.message, Message):
        return None
    return task_id_of(job.message)


@dataclass(eq=False)
class _Tasks:
    """A batch's tasks: its attempts, and which of its jobs the current transaction screened
    (``screened``) and has not decided yet (``awaiting``)."""

    attempts: Attempts
    screened: set[Job] = field(default_factory=set)
    awaiting: set[Job] = field(default_factory=set)


class TaskRuns(Stage):
    """RUNNING before, the attempts' outcomes in, ``task_finished`` after each batch of tasks."""

    def __init__(self) -> None:
        # The batch this worker thread decides: screen and decided are not given open's state.
        self._local = threading.local()

    def open(self, batch: Batch) -> Any:
        # Once per task: two copies of its message in one batch are one attempt (the inbox
        # lets one of them run).
        ids = list(
            dict.fromkeys(
                task_id
                for job, done in zip(batch.jobs, batch.decided, strict=True)
                if done is None and (task_id := _task_id(job)) is not None
            )
        )
        if not ids:
            return None
        from ..task_runs.worker import start_attempts

        state = _Tasks(start_attempts(batch.jobs[0].processor.using, ids))
        self._local.tasks = state
        return state

    def screen(self, job: Job, message: Message) -> DeliveryOutcome | None:
        state: _Tasks | None = getattr(self._local, "tasks", None)
        if state is None or _task_id(job) is None:
            return None
        if job in state.screened:
            # Screened again: the batch is decided anew in a new transaction (the last one
            # rolled back, or each delivery now alone), so what that one ran is gone.
            state.screened.clear()
            state.awaiting.clear()
            state.attempts.forget()
        state.screened.add(job)
        state.awaiting.add(job)
        return None

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        task_id = _task_id(job)
        if task_id is None:
            return
        state: _Tasks | None = getattr(self._local, "tasks", None)
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

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if state is None:
            return
        from ..task_runs.worker import end_attempts, send_finished

        if getattr(self._local, "tasks", None) is state:
            del self._local.tasks
        ended: dict[str, OutcomeLabel] = {}
        if error is None:
            for job, done in batch.outcomes():
                task_id = _task_id(job)
                if task_id is not None and done.label in _ENDED:
                    ended[task_id] = done.label
        end_attempts(
            state.attempts,
            processed=[t for t, label in ended.items() if label is OutcomeLabel.PROCESSED],
        )
        if ended:
            send_finished(state.attempts, list(ended))


_ENDED = (OutcomeLabel.PROCESSED, OutcomeLabel.DEAD_LETTERED)
