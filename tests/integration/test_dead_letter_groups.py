"""The failure groups' table follows every way dead letters change, and the purge of old ones.

After each change what readers see (the groups plus the deltas PostgreSQL's triggers appended),
with or without a fold in between, and the groups table after a fold, must equal a ``GROUP BY``
over the dead letters themselves: new failures and repeated ones, the status moves, bulk
updates, a fingerprint that changes, deletes and the purge. Writers of one group do not wait
for each other, and folds neither wait for each other nor lose or double a delta.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count, Q
from django.test import override_settings
from django.utils import timezone

from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.dead_letters.operations import OperationRunner
from reliable_messaging.dead_letters.replay import discard, replay_batch
from reliable_messaging.managers import FOLD
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterGroup,
    DeadLetterGroupDelta,
    LiveDeadLetterGroup,
    Replay,
)
from tests.markers import postgresql_only
from tests.support import MANAGE

# The table is kept by PostgreSQL's triggers (the SQLite test below runs in a subprocess).
pytestmark = pytest.mark.django_db

Key = tuple[str, str, str]


def fail(
    message_id: str,
    *,
    consumer: str = "tests.alpha",
    fingerprint: str = "f1",
    reason: str = "retries_exhausted",
    at: dt.datetime | None = None,
) -> DeadLetter:
    """A failure recorded as the consumer records it (a new row, or its row updated)."""
    at = at or timezone.now()
    return DeadLetter.objects.record_failure(
        consumer,
        message_id,
        fields={
            "queue": f"q.{consumer}",
            "body": b"{}",
            "payload": {},
            "reason": reason,
            "exception_type": f"app.Error{fingerprint}",
            "last_failed_at": at,
            "status": DeadLetterStatus.DEAD,
            "fingerprint": fingerprint,
        },
        event={"event": "dead_lettered", "at": at.isoformat()},
        first_failed_at=at,
    )


def counted() -> dict[Key, tuple[int, ...]]:
    """Per group, (dead, replayed, resolved, discarded, total) by a GROUP BY over every row."""
    statuses = [status.value for status in DeadLetterStatus]
    rows = DeadLetter.objects.values("consumer", "fingerprint", "reason").annotate(
        total=Count("pk"), **{s: Count("pk", filter=Q(status=s)) for s in statuses}
    )
    return {
        (r["consumer"], r["fingerprint"], r["reason"]): (*(r[s] for s in statuses), r["total"])
        for r in rows
    }


def figures(groups: Any) -> dict[Key, tuple[int, ...]]:
    """Per group with dead letters, (dead, replayed, resolved, discarded, total) of ``groups``
    (groups left empty are not shown anywhere)."""
    return {
        (g.consumer, g.fingerprint, g.reason): (
            g.dead,
            g.replayed,
            g.resolved,
            g.discarded,
            g.total,
        )
        for g in groups.filter(total__gt=0)
    }


def kept() -> dict[Key, tuple[int, ...]]:
    """The groups as readers see them: the table plus the deltas not folded yet."""
    return figures(LiveDeadLetterGroup.objects.all())


def folded() -> dict[Key, tuple[int, ...]]:
    """Fold every delta, and the groups table alone."""
    DeadLetterGroup.objects.fold(batches=None)
    assert not DeadLetterGroupDelta.objects.exists()
    return figures(DeadLetterGroup.objects.all())


def assert_kept(*, fold: bool = True) -> dict[Key, tuple[int, ...]]:
    """What readers see equals the dead letters' GROUP BY; after a fold (``fold``) too, and
    then the groups table alone as well."""
    expected = counted()
    assert kept() == expected
    if fold:
        assert folded() == expected
        assert kept() == expected
    return expected


@pytest.fixture(params=[True, False], ids=["folding", "never folding"])
def folding(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Fold after each step, or let the deltas pile up until the test's end (then folded)."""
    yield request.param
    assert folded() == counted()


def live(consumer: str, fingerprint: str) -> LiveDeadLetterGroup:
    return LiveDeadLetterGroup.objects.get(consumer=consumer, fingerprint=fingerprint)


@postgresql_only
def test_new_and_repeated_failures(folding: bool) -> None:
    early = timezone.now() - dt.timedelta(hours=2)
    first = fail("m-1", at=early)
    fail("m-2")
    fail("m-3", consumer="tests.beta")
    assert assert_kept(fold=folding) == {
        ("tests.alpha", "f1", "retries_exhausted"): (2, 0, 0, 0, 2),
        ("tests.beta", "f1", "retries_exhausted"): (1, 0, 0, 0, 1),
    }

    again = fail("m-1")  # the same message fails again: its row, not a new one
    assert again.pk == first.pk
    group = live("tests.alpha", "f1")
    assert group.total == 2
    assert group.first_seen == early
    assert group.last_seen == again.last_failed_at  # no count changed, but it is news
    assert group.example_id == DeadLetter.objects.get(message_id="m-2").pk
    assert group.exception_type == "app.Errorf1" and group.queue == "q.tests.alpha"
    if folding:
        DeadLetterGroup.objects.fold()
        row = DeadLetterGroup.objects.get(consumer="tests.alpha", fingerprint="f1")
        assert (row.total, row.first_seen, row.last_seen, row.example_id) == (
            2,
            early,
            again.last_failed_at,
            group.example_id,
        )
        assert (row.exception_type, row.queue) == ("app.Errorf1", "q.tests.alpha")

    fail("m-1", fingerprint="f2")  # ... now another way: it moves to that group
    assert assert_kept(fold=folding) == {
        ("tests.alpha", "f1", "retries_exhausted"): (1, 0, 0, 0, 1),
        ("tests.alpha", "f2", "retries_exhausted"): (1, 0, 0, 0, 1),
        ("tests.beta", "f1", "retries_exhausted"): (1, 0, 0, 0, 1),
    }


@postgresql_only
def test_replay_resolve_and_discard(folding: bool) -> None:
    letters = [fail(f"m-{n}") for n in range(5)]

    replay_batch([letters[0].pk, letters[1].pk], replayed_by="tests")
    assert assert_kept(fold=folding)[("tests.alpha", "f1", "retries_exhausted")] == (3, 2, 0, 0, 5)

    DeadLetter.objects.filter(pk=letters[0].pk).resolve(at=timezone.now())
    discard(DeadLetter.objects.filter(pk__in=[letters[2].pk, letters[3].pk]), discarded_by="t")
    assert assert_kept(fold=folding)[("tests.alpha", "f1", "retries_exhausted")] == (1, 1, 1, 2, 5)

    fail("m-3")  # a discarded one that comes back dead
    assert assert_kept(fold=folding)[("tests.alpha", "f1", "retries_exhausted")] == (2, 1, 1, 1, 5)


@postgresql_only
def test_bulk_updates_and_deletes(folding: bool) -> None:
    for n in range(30):
        fail(f"m-{n}", consumer=f"tests.c{n % 3}", fingerprint=f"f{n % 2}")

    # One statement over many rows and groups: the triggers add up each group's share.
    DeadLetter.objects.filter(consumer="tests.c0").update(status=DeadLetterStatus.REPLAYED)
    assert_kept(fold=folding)
    DeadLetter.objects.filter(fingerprint="f1").update(fingerprint="f9", reason="permanent")
    assert_kept(fold=folding)
    DeadLetter.objects.filter(consumer="tests.c1").delete()
    expected = assert_kept(fold=folding)
    assert sum(total for *_, total in expected.values()) == 20

    DeadLetter.objects.all().delete()
    assert kept() == {}
    assert DeadLetterGroup.objects.listing(with_open=False).count() == 0


@postgresql_only
def test_a_statement_that_changes_nothing_a_group_shows_adds_no_delta() -> None:
    letter = fail("m-1")
    DeadLetterGroup.objects.fold()

    DeadLetter.objects.filter(pk=letter.pk).update(history=[], attempts=9)
    assert not DeadLetterGroupDelta.objects.exists()

    fail("m-1")  # a repeated failure changes no count but moves last_seen
    (delta,) = DeadLetterGroupDelta.objects.all()
    assert (delta.dead, delta.total) == (0, 0)
    assert delta.last_seen == DeadLetter.objects.get(pk=letter.pk).last_failed_at
    assert_kept()


@postgresql_only
def test_the_listing_adds_up_the_reasons_of_a_fingerprint() -> None:
    fail("m-1", reason="retries_exhausted")
    fail("m-2", reason="permanent")
    DeadLetter.objects.filter(message_id="m-2").resolve(at=timezone.now())

    (group,) = DeadLetterGroup.objects.listing(with_open=False)

    assert (group["consumer"], group["fingerprint"]) == ("tests.alpha", "f1")
    assert (group["dead"], group["resolved"], group["total"]) == (1, 1, 2)
    assert DeadLetterGroup.objects.of_fingerprint("f1")["total"] == 2
    assert DeadLetterGroup.objects.dead_counts() == [("tests.alpha", "retries_exhausted", 1)]


# -- the purge ---------------------------------------------------------------------------------


def aged(message_id: str, status: str, days: float) -> DeadLetter:
    letter = fail(message_id)
    DeadLetter.objects.filter(pk=letter.pk).update(
        status=status, updated_at=timezone.now() - dt.timedelta(days=days)
    )
    return letter


def purge(*args: str, retention: Any = dt.timedelta(days=30)) -> str:
    values = {**settings.RELIABLE_MESSAGING, "DEAD_LETTER_RETENTION": retention}
    out = io.StringIO()
    with override_settings(RELIABLE_MESSAGING=values):
        call_command("purge_messages", *args, "--batch-size", "2", stdout=out)
    return out.getvalue()


@pytest.fixture
def old_and_new() -> None:
    aged("old-resolved", DeadLetterStatus.RESOLVED, 40)
    aged("old-discarded", DeadLetterStatus.DISCARDED, 31)
    aged("old-resolved-2", DeadLetterStatus.RESOLVED, 90)
    aged("old-dead", DeadLetterStatus.DEAD, 400)  # waits for a person, however old
    aged("old-replayed", DeadLetterStatus.REPLAYED, 400)
    aged("new-resolved", DeadLetterStatus.RESOLVED, 2)
    fail("other", consumer="tests.beta", fingerprint="f7")
    DeadLetter.objects.filter(message_id="other").update(
        status=DeadLetterStatus.DISCARDED, updated_at=timezone.now() - dt.timedelta(days=60)
    )


def left() -> set[str]:
    return set(DeadLetter.objects.values_list("message_id", flat=True))


@postgresql_only
def test_purge_removes_old_resolved_and_discarded_dead_letters(old_and_new: None) -> None:
    dry = purge("--dry-run")
    assert "would delete 4 resolved or discarded dead letter(s)" in dry
    assert len(left()) == 7

    output = purge()

    assert "deleted 4 resolved or discarded dead letter(s) older than 30 days" in output
    assert left() == {"old-dead", "old-replayed", "new-resolved"}
    assert_kept()
    # The group left without a dead letter is gone from the table, not only hidden.
    assert not DeadLetterGroup.objects.filter(consumer="tests.beta").exists()


def test_purge_counts_dead_letters_not_the_replays_deleted_with_them(old_and_new: None) -> None:
    """A dead letter's replay ledger goes with it: the count says dead letters, as the dry
    run's does, not every row deleted."""
    for message_id in ("old-resolved", "old-resolved", "old-discarded"):
        letter = DeadLetter.objects.get(message_id=message_id)
        Replay.objects.create(
            dead_letter=letter, consumer=letter.consumer, message_id=message_id, replayed_by="ops"
        )
    assert "would delete 4 resolved or discarded dead letter(s)" in purge("--dry-run")

    output = purge()

    assert "deleted 4 resolved or discarded dead letter(s) older than 30 days" in output
    assert not Replay.objects.exists()
    assert left() == {"old-dead", "old-replayed", "new-resolved"}


def test_purge_keeps_every_dead_letter_when_the_retention_is_none(old_and_new: None) -> None:
    output = purge(retention=None)

    assert "dead letter" not in output
    assert len(left()) == 7
    assert not DeadLetterGroupDelta.objects.exists()  # folded all the same


# -- SQLite ----------------------------------------------------------------------------------------


def test_groups_come_from_the_dead_letters_on_sqlite(tmp_path: Path) -> None:
    database = tmp_path / "groups.sqlite3"
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{database}",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    env.pop("RM_TEST_DB_NAME", None)
    script = (
        "from reliable_messaging.models import DeadLetter, DeadLetterGroup\n"
        "for n in range(3):\n"
        "    DeadLetter.objects.create(consumer='c', message_id=f'm{n}', queue='q', body=b'',\n"
        "        reason='permanent', fingerprint='f', exception_type='app.Error',\n"
        "        status='dead' if n else 'resolved')\n"
        "groups = DeadLetterGroup.objects\n"
        "(row,) = groups.listing()\n"
        "assert (row['dead'], row['total']) == (2, 3), row\n"
        "assert groups.dead_counts() == [('c', 'permanent', 2)], groups.dead_counts()\n"
        "assert groups.values_of('exception_type') == ['app.Error']\n"
        "assert groups.of_fingerprint('f')['total'] == 3\n"
        "assert not groups.exists()\n"
        "print('ok')\n"
    )
    for command in (["migrate", "--verbosity", "0"], ["shell", "-c", script]):
        result = subprocess.run(
            [sys.executable, str(MANAGE), *command],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


# -- writers and folds at the same time ------------------------------------------------------


def in_thread(work: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    """Run ``work`` on a database connection of its own; what it raises goes to ``errors``."""

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def resolve(message_id: str) -> None:
    with transaction.atomic():
        DeadLetter.objects.filter(message_id=message_id).resolve(at=timezone.now())


def lock_timeout(value: str) -> None:
    """Give up on any lock not granted within ``value`` (the rest of this transaction)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{value}'")


@postgresql_only
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("held", ["a new failure", "a status move"])
def test_writers_of_one_group_do_not_wait_for_each_other(held: str) -> None:
    fail("m-0")
    fail("m-1")
    DeadLetterGroup.objects.fold()  # the group has its row
    wrote, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def write_and_hold() -> None:
        with transaction.atomic():
            if held == "a new failure":
                fail("m-a")
            else:
                resolve("m-0")
            wrote.set()
            release.wait(30)

    holder = in_thread(write_and_hold, errors)
    try:
        assert wrote.wait(10), errors
        # Another transaction writes dead letters of the same group and commits while the
        # first is still open: it must not wait for it (a lock on the group's row would
        # make this fail after 2 seconds).
        with transaction.atomic():
            lock_timeout("2s")
            fail("m-b")
            resolve("m-1")
        assert holder.is_alive() and not release.is_set()
        assert kept() == counted()
    finally:
        release.set()
        holder.join(30)
    assert not errors
    assert_kept()


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_a_fold_waits_for_no_other_fold() -> None:
    for n in range(6):
        fail(f"m-{n}", fingerprint=f"f{n % 2}")
    folding, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def fold_and_hold() -> None:
        with transaction.atomic():
            assert DeadLetterGroup.objects.fold(batch_size=3) == 3
            folding.set()
            release.wait(30)

    holder = in_thread(fold_and_hold, errors)
    try:
        assert folding.wait(10), errors
        with transaction.atomic():
            lock_timeout("2s")
            assert DeadLetterGroup.objects.fold(batches=None) == 0  # the other one's turn
        fail("m-9")  # nor does a writer wait for a fold
        assert kept() == counted()
    finally:
        release.set()
        holder.join(30)
    assert not errors
    assert_kept()


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_concurrent_folds_neither_lose_nor_double_count_a_delta() -> None:
    """Writers and folders at once; half of the folders run the fold's statement without its
    lock, so two of them do fold side by side (``SKIP LOCKED``)."""
    done = threading.Event()
    errors: list[BaseException] = []
    moved: list[int] = []  # by the folders while the writers write

    def write(part: int) -> Callable[[], None]:
        def run() -> None:
            for n in range(60):
                message_id = f"w{part}-{n}"
                fail(message_id, consumer=f"tests.c{n % 3}", fingerprint=f"f{(n + part) % 2}")
                if n % 3 == 0:
                    resolve(message_id)
                if n % 7 == 0:
                    DeadLetter.objects.filter(message_id=message_id).delete()

        return run

    def fold() -> None:
        while not done.is_set():
            moved.append(DeadLetterGroup.objects.fold(batch_size=4))

    def fold_without_the_lock() -> None:
        sql = FOLD.format(
            deltas=DeadLetterGroupDelta._meta.db_table, groups=DeadLetterGroup._meta.db_table
        )
        while not done.is_set():
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql, [3])
                moved.append(cursor.fetchone()[0])

    folders = [in_thread(fold, errors) for _ in range(2)]
    folders += [in_thread(fold_without_the_lock, errors) for _ in range(2)]
    writers = [in_thread(write(part), errors) for part in range(3)]
    try:
        for writer in writers:
            writer.join(120)
        assert kept() == counted()
    finally:
        done.set()
        for folder in folders:
            folder.join(30)
    assert not errors
    assert DeadLetter.objects.count() > 100
    assert sum(moved) > 0
    assert_kept()


@postgresql_only
def test_a_fold_is_bounded() -> None:
    for n in range(7):
        fail(f"m-{n}")  # one statement each: seven deltas
    assert DeadLetterGroupDelta.objects.count() == 7

    assert DeadLetterGroup.objects.fold(batch_size=3) == 3
    assert DeadLetterGroupDelta.objects.count() == 4
    assert kept() == counted()
    assert DeadLetterGroup.objects.fold(batch_size=3, batches=None) == 4
    assert_kept()


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_readers_never_fold_and_read_exact_figures() -> None:
    """A page that shows the groups writes nothing (a GET): the deltas stay for the relay's
    fold, and the figures read are exact all the same."""
    fail("m-1")
    fail("m-2", fingerprint="f2")

    assert DeadLetterGroup.objects.of_fingerprint("f1")["total"] == 1
    assert len(DeadLetterGroup.objects.listing()) == 2
    assert DeadLetterGroupDelta.objects.count() == 2
    DeadLetterGroup.objects.fold()
    assert not DeadLetterGroupDelta.objects.exists()
    assert folded() == counted()


@postgresql_only
@pytest.mark.django_db(transaction=True)
def test_the_relays_operation_runner_folds_every_few_seconds() -> None:
    fail("m-1")
    fail("m-2", fingerprint="f2")
    runner = OperationRunner(interval=0.01, fold_interval=0.05)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while DeadLetterGroupDelta.objects.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        fail("m-3")
        while DeadLetterGroupDelta.objects.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        runner.stop()
    assert figures(DeadLetterGroup.objects.all()) == counted()
