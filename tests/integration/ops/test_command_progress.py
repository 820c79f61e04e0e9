"""Progress output of the long-running commands (``replay_dead_letters``, ``purge_messages``):
one line rewritten in place on a terminal, plain periodic lines anywhere else."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.core.management import call_command
from django.core.management.base import OutputWrapper
from django.utils import timezone

from reliable_messaging.management import progress
from reliable_messaging.management.progress import Progress
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage, SuspectDelivery
from reliable_messaging.storage import partitions


class Terminal(io.StringIO):
    """Captured output that says it is a terminal, as a person's shell would."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_a_log_a_line_every_interval_and_none_for_a_short_job() -> None:
    clock, out = Clock(), io.StringIO()
    bar = Progress(OutputWrapper(out), "replaying", 12_000, interval=5.0, clock=clock)
    for done in range(1_000, 12_001, 1_000):
        clock.now += 2.0
        bar.update(done)
    bar.finish()
    assert out.getvalue().splitlines() == [
        "  replaying 3,000/12,000 (25%)",
        "  replaying 6,000/12,000 (50%)",
        "  replaying 9,000/12,000 (75%)",
        "  replaying 12,000/12,000 (100%)",
    ]

    out = io.StringIO()
    bar = Progress(OutputWrapper(out), "replaying", 10, interval=5.0, clock=clock)
    bar.update(10)
    bar.finish()
    assert out.getvalue() == ""  # the command's summary says it all


def test_on_a_terminal_one_line_is_rewritten() -> None:
    clock, out = Clock(), Terminal()
    bar = Progress(OutputWrapper(out), "replaying", 12_000, clock=clock)
    clock.now += 1
    bar.update(1_500)
    bar.interrupt()  # something else is about to be written
    OutputWrapper(out).write("not replayed #7: ...")
    clock.now += 1
    bar.update(12_000)
    bar.finish()
    bar.finish()  # a second call changes nothing
    assert out.getvalue() == (
        "\r  replaying 1,500/12,000 (12%)\n"
        "not replayed #7: ...\n"
        "\r  replaying 12,000/12,000 (100%)\n"
    )


def dead_letters(count: int) -> list[int]:
    return [
        DeadLetter.objects.create(
            message_id=f"m-{n}",
            consumer="tests.alpha",
            queue="q.alpha",
            reason="permanent",
            body=b'{"n": 1}',
        ).pk
        for n in range(count)
    ]


@pytest.mark.django_db
def test_replay_shows_progress_on_a_terminal() -> None:
    dead_letters(5)
    out = Terminal()
    call_command("replay_dead_letters", "--all", "--batch-size", "2", stdout=out)
    assert out.getvalue().startswith("\r  replaying ")
    assert "\r  replaying 5/5 (100%)\nreplayed 5 dead letter(s), refused 0" in out.getvalue()


@pytest.mark.django_db
def test_replay_writes_plain_lines_into_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)  # a line per batch
    dead_letters(5)
    out = io.StringIO()
    call_command("replay_dead_letters", "--all", "--batch-size", "2", stdout=out)
    assert out.getvalue().splitlines() == [
        "  replaying 2/5 (40%)",
        "  replaying 4/5 (80%)",
        "  replaying 5/5 (100%)",
        "replayed 5 dead letter(s), refused 0; the relay sends them to their consumers' queues",
    ]
    assert OutboxMessage.objects.count() == 5


@pytest.mark.django_db
def test_purge_shows_progress_per_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows deleted in batches show their progress (crash-guard rows here: on PostgreSQL the
    inbox's and the outbox's expired days are dropped whole, with no batch to show)."""
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    old = timezone.now() - dt.timedelta(days=30)
    partitions.ensure_partitions("default", now=old, ahead=0)
    partitions.ensure_partitions("default", now=old, ahead=0, spec=partitions.OUTBOX)
    for n in range(5):
        row = ProcessedMessage.objects.create(consumer="tests.c", message_id=f"m-{n}")
        ProcessedMessage.objects.filter(pk=row.pk).update(processed_at=old)
        OutboxMessage.objects.create(
            message_id=f"o-{n}", routing_key="r", body="{}", status="sent", sent_at=old
        )
        SuspectDelivery.objects.create(
            consumer="tests.c", message_id=f"s-{n}", first_seen_at=old, updated_at=old
        )
    out = io.StringIO()
    call_command("purge_messages", "--batch-size", "2", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "  suspects: deleted 2/5 (40%)",
        "  suspects: deleted 4/5 (80%)",
        "  suspects: deleted 5/5 (100%)",
    ], lines
    assert lines[3].startswith("deleted 5 inbox row(s)"), lines
    assert "5 sent outbox row(s)" in lines[3] and "5 crash-guard row(s)" in lines[3]

    terminal = Terminal()
    call_command("purge_messages", stdout=terminal)  # nothing left: no progress line at all
    assert terminal.getvalue().startswith("deleted 0 inbox row(s)")
