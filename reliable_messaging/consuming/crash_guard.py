"""The crash guard: a message that kills its process is dead-lettered, not retried forever
(``docs/design.md#the-crash-guard``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from django.db import router, transaction
from django.utils import timezone

from ..choices import DeadLetterReason, DeadLetterStatus
from ..core.envelope import DecodeError, Delivery
from ..core.outcomes import Outcome, Release, RetryInPlace
from ..models import DeadLetter, SuspectDelivery
from .last_resort import dead_letter_delivery
from .stage import Processor

logger = logging.getLogger(__name__)

CRASHED = "crashed"
TIMEOUT = "timeout"
# The dead letters of a message that killed its process.
KILLED_ITS_PROCESS = (DeadLetterReason.WORKER_CRASHED, DeadLetterReason.TIMEOUT)


@dataclass(frozen=True)
class Suspicion:
    """What the guard knows of a redelivered message before its handler runs again."""

    deaths: int
    cause: str  # how the last death happened: CRASHED or TIMEOUT
    last_process: str  # host:pid of the process that died on it last ("" when not known)

    def exceeds(self, limit: int) -> bool:
        return self.deaths >= limit

    def describe(self) -> str:
        how = (
            "ran past its time limit and could not be interrupted"
            if self.cause == TIMEOUT
            else "died (killed, out of memory or crashed)"
        )
        last = f"; last: {self.last_process}" if self.last_process else ""
        return f"the process handling it {how} {self.deaths} time(s){last}"


class CrashGuard:
    """Counts the deaths of processes during one delivery, in the database."""

    def __init__(self, limit: int, using: str | None = None) -> None:
        self.limit = max(1, limit)
        self.using = using or router.db_for_write(SuspectDelivery)

    def begin(self, consumer: str, message_id: str) -> Suspicion:
        """Mark (consumer, message_id) running and commit that, before the handler runs.
        Returns the deaths counted so far, this delivery's own redelivery included, and those
        of an earlier copy dead-lettered for killing its process (not replayed)."""
        with transaction.atomic(using=self.using):
            row, new = self._locked_row(consumer, message_id)
            died_in = row.last_process
            if new or row.running:  # never watched, or never finished: one more death
                row.deaths += 1
                row.last_cause = CRASHED
            suspicion = Suspicion(row.deaths, row.last_cause or CRASHED, died_in)
            self._save(row, running=True)
            return suspicion

    def finish(self, keys: Iterable[tuple[str, str]]) -> None:
        """The deliveries reached an outcome (committed): forget them."""
        for consumer, message_id in keys:
            SuspectDelivery.objects.using(self.using).forget(consumer, message_id)

    def interrupted(self, keys: Iterable[tuple[str, str]]) -> None:
        """The deliveries were given back without an outcome; the process lives on."""
        for consumer, message_id in keys:
            SuspectDelivery.objects.using(self.using).mark_interrupted(
                consumer, message_id, at=timezone.now()
            )

    def record_death(self, consumer: str, message_id: str, cause: str) -> None:
        """Count a death now, with its cause: the process is about to exit because of it."""
        with transaction.atomic(using=self.using):
            row, _ = self._locked_row(consumer, message_id)
            row.deaths += 1
            row.last_cause = cause
            self._save(row, running=False)

    def _count_earlier_copy(self, row: SuspectDelivery) -> None:
        """A second copy of a message already dead-lettered for killing its process (sent
        again by a relay that died before recording it sent): its deaths count for this one."""
        earlier = (
            DeadLetter.objects.using(router.db_for_write(DeadLetter))
            .filter(status=DeadLetterStatus.DEAD)  # a replayed copy has its deaths afresh
            .of(row.consumer, row.message_id)
            # The guard's own (no exception: the process died), not a handler's HandlerTimeout.
            .filter(reason__in=KILLED_ITS_PROCESS, exception_type="")
            .values_list("attempts", "reason")
            .first()
        )
        if earlier is not None:
            row.deaths += earlier[0]
            row.last_cause = TIMEOUT if earlier[1] == DeadLetterReason.TIMEOUT else CRASHED

    def _locked_row(self, consumer: str, message_id: str) -> tuple[SuspectDelivery, bool]:
        row, new = SuspectDelivery.objects.using(self.using).locked_or_created(consumer, message_id)
        if new:
            self._count_earlier_copy(row)
        return row, new

    def _save(self, row: SuspectDelivery, *, running: bool) -> None:
        row.running = running
        row.last_process = f"{socket.gethostname()}:{os.getpid()}"
        row.updated_at = timezone.now()
        row.save(using=self.using)


def decide_suspect(
    guard: CrashGuard,
    processor: Processor,
    delivery: Delivery,
    run: Callable[[], Outcome | None],
) -> Outcome | None:
    """Decide a redelivered ``delivery``: a dead letter past ``guard.limit`` deaths, else
    ``run()`` watched by the guard, alone in the process (:class:`SuspectGate`)."""
    decoded = processor.decode(delivery)
    if isinstance(decoded, DecodeError) and not decoded.message_id:
        return run()  # nothing to count deaths against; it is dead-lettered without a handler
    key = (processor.spec.name, decoded.message_id)
    suspicion = guard.begin(*key)
    outcome: Outcome | None
    if suspicion.exceeds(guard.limit):
        outcome = dead_letter_delivery(
            processor,
            delivery,
            reason=(
                DeadLetterReason.TIMEOUT
                if suspicion.cause == TIMEOUT
                else DeadLetterReason.WORKER_CRASHED
            ),
            attempts=suspicion.deaths,
            detail=f"{suspicion.describe()} (CRASH_LIMIT={guard.limit})",
        )
    else:
        if suspicion.deaths > 1:
            logger.warning(
                "message_id=%s consumer=%s: %s; handling it alone (CRASH_LIMIT=%d)",
                decoded.message_id,
                processor.spec.name,
                suspicion.describe(),
                guard.limit,
            )
        try:
            outcome = run()
        except BaseException:
            # Nothing was decided and this process lives on: no death to count.
            guard.interrupted([key])
            raise
    if outcome is None or isinstance(outcome, Release | RetryInPlace):
        guard.interrupted([key])  # given back, or run again in place: still watched
    else:
        guard.finish([key])
    return outcome


class SuspectGate:
    """Lets a suspect run alone in its process: ordinary batches share the gate, a suspect
    takes it exclusively, so nothing else is blamed when it kills the process."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not (self._exclusive or self._waiting_exclusive))
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting_exclusive += 1
            self._cond.wait_for(lambda: not (self._exclusive or self._shared))
            self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
