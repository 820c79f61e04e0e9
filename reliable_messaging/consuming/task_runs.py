"""The consumer's stage of ``django.tasks`` tasks (:mod:`reliable_messaging.task_runs`).

Around the deliveries of the task queues' consumers: RUNNING and one more attempt committed
before the batch's transaction (so a caller's ``get_result()`` sees it while the task runs, and
an attempt that kills its process still counts) with ``task_started``; in the transaction, a
failed attempt's error with READY again (a retry), or the attempt taken back when the delivery
was put aside because another worker holds it; after the commit, ``task_finished``.
SUCCESSFUL is the handler's own write (:func:`~reliable_messaging.task_runs.worker.run_task`);
FAILED is written with the dead letter (``dead_letters.record.record_dead_letter``), so a
dead letter recorded without this stage (the crash guard's, the ``.dead`` queue's) fails its
task too. The task framework is an optional extra on Django 5.2: it is imported only for a
batch that holds tasks.
"""

from __future__ import annotations

from typing import Any

from ..core.envelope import Message
from ..core.outcomes import OutcomeLabel
from ..task_runs.naming import is_task_consumer, task_id_of
from .stage import Batch, DeliveryOutcome, Job, Stage


def _task_id(job: Job) -> str | None:
    if not is_task_consumer(job.name) or not isinstance(job.message, Message):
        return None
    return task_id_of(job.message)


class TaskRuns(Stage):
    """RUNNING before, the attempt's failure in, ``task_finished`` after each batch of tasks."""

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

        start_attempts(batch.jobs[0].processor.using, ids)
        return ids

    def decided(self, job: Job, message: Message, done: DeliveryOutcome) -> None:
        task_id = _task_id(job)
        if task_id is None:
            return
        if done.label is OutcomeLabel.RETRIED:
            from ..task_runs.worker import record_retry

            record_retry(job.processor.using, task_id, done.error)
        elif done.label is OutcomeLabel.DEFERRED:
            # Counted in open, before the inbox claim could tell that another worker holds
            # the delivery: counting after the claim instead would lose the attempts that kill
            # their process, so the put-aside one is taken back here.
            from ..task_runs.worker import take_back_attempt

            take_back_attempt(job.processor.using, task_id)

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if state is None or error is not None:
            return
        ended = (OutcomeLabel.PROCESSED, OutcomeLabel.DEAD_LETTERED)
        ids = [
            task_id
            for job, done in batch.outcomes()
            if done.label in ended and (task_id := _task_id(job)) is not None
        ]
        if ids:
            from ..task_runs.worker import send_finished

            send_finished(batch.jobs[0].processor.using, ids)
