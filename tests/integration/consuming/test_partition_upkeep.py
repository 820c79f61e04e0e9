"""An inbox partition upkeep that keeps failing is seen days before the partitions made ahead
run out: in the log, in the process's metrics and ``/healthz``, and in ``messaging_status
--strict``. Days pass on the upkeep's clock, not the test's."""

from __future__ import annotations

import datetime as dt
import io
import logging
from collections.abc import Iterator
from unittest import mock

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from reliable_messaging.core.liveness import HealthState
from reliable_messaging.ops.http import start_ops_server
from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import INBOX_TABLE
from tests.conftest import database_url
from tests.integration.ops.conftest import http_get, http_json, parse_samples
from tests.markers import postgresql_only

pytestmark = [pytest.mark.django_db(transaction=True), postgresql_only]

DAY = dt.timedelta(days=1)


class TableHolder:
    """Another session that takes SHARE UPDATE EXCLUSIVE on the inbox (what a manual VACUUM,
    an ANALYZE or another tool's DDL holds) from :meth:`hold` to :meth:`release`: attaching a
    day waits for it, claims do not."""

    def __init__(self) -> None:
        self.conn = psycopg.connect(database_url())

    def hold(self) -> None:
        self.conn.execute(f'LOCK TABLE "{INBOX_TABLE}" IN SHARE UPDATE EXCLUSIVE MODE')

    def release(self) -> None:
        self.conn.rollback()


@pytest.fixture
def table_held() -> Iterator[TableHolder]:
    holder = TableHolder()
    try:
        yield holder
    finally:
        holder.release()
        holder.conn.close()


def strict_status(at: dt.datetime) -> tuple[int, str]:
    """``messaging_status --strict --json`` as seen at ``at``; its exit code and output."""
    out = io.StringIO()
    with mock.patch("reliable_messaging.ops.collectors.timezone.now", return_value=at):
        try:
            call_command("messaging_status", "--strict", "--json", stdout=out)
        except CommandError as exc:
            return exc.returncode, out.getvalue() + str(exc)
    return 0, out.getvalue()


def test_an_upkeep_that_keeps_failing_is_seen_days_before_the_partitions_run_out(
    table_held: TableHolder, caplog: pytest.LogCaptureFixture
) -> None:
    partitions.ensure_partitions("default")
    start = timezone.now()
    # Days made further ahead by a test whose clock ran ahead: each day passing below must
    # leave the upkeep a day to make, or its failure would only be the expired day's drop.
    beyond = partitions.day_start(start.date()) + (partitions.AHEAD_DAYS + 1) * DAY
    with connection.cursor() as cursor:
        for ahead in partitions.partitions("default"):
            if ahead.start >= beyond:
                cursor.execute(f'DROP TABLE "{ahead.name}"')
    partitions.forget_coverage()
    days = [0]
    health = HealthState()
    health.set_broker(True)
    upkeep = partitions.PartitionUpkeep(
        "default", retention=DAY, health=health, clock=lambda: start + days[0] * DAY
    )
    server = start_ops_server(0, health, host="127.0.0.1")
    base = f"http://127.0.0.1:{server.port}"

    def failures() -> float:
        samples = parse_samples(http_get(f"{base}/metrics")[2].decode())
        key = (
            "reliable_messaging_partition_upkeep_failures_total",
            frozenset({("table", "inbox")}),
        )
        return samples.get(key, 0.0)

    try:
        assert upkeep.run_once()
        assert http_json(f"{base}/healthz") == (200, {"status": "ok"})
        before = failures()
        assert "--min-partition-days-ahead" not in strict_status(start)[1]

        table_held.hold()
        caplog.set_level(logging.WARNING, "reliable_messaging.partitions")
        # A day passes with every upkeep run failing; then a second.
        for day in (1, 2):
            days[0] = day
            assert not upkeep.run_once()
            now = start + day * DAY
            left = partitions.days_ahead("default", now)
            assert left is not None and left > partitions.AHEAD_DAYS - day - 1
            # The process says so on /healthz (a note: restarting it would not help) and in
            # its metrics, from the first failed run on.
            status, body = http_json(f"{base}/healthz")
            assert status == 200 and any("inbox partitions" in n for n in body["notes"]), body
            assert failures() == before + day
            assert f"only {left:.1f} day(s) of inbox partitions are made ahead" in caplog.text
        # After about a day of failures, with days of partitions still made: an ERROR, and
        # messaging_status --strict fails on it.
        assert left is not None and left >= partitions.AHEAD_DAYS - 2
        assert any(
            r.levelno == logging.ERROR and "inbox partitions" in r.getMessage()
            for r in caplog.records
        )
        code, output = strict_status(start + 2 * DAY)
        assert code == 1 and "--min-partition-days-ahead" in output, output
        assert "only" in output and "inbox partitions are made ahead" in output
    finally:
        table_held.release()
    # The lock gone, the next run makes the days it missed and clears the note.
    try:
        partitions_made = [p.name for p in partitions.partitions("default")]
        assert upkeep.run_once(), upkeep.problem
        made = [p.name for p in partitions.partitions("default")]
        assert partitions.day_name((start + (2 + partitions.AHEAD_DAYS) * DAY).date()) in made
        assert set(made) - set(partitions_made)
        assert http_json(f"{base}/healthz") == (200, {"status": "ok"})
    finally:
        server.close()
        # Its clock two days ahead dropped today's partition: back for the tests after this.
        partitions.ensure_partitions("default")


def test_strict_status_judges_the_days_made_ahead_as_they_are_not_as_shown() -> None:
    # Seconds past midnight, the partitions made ahead are seconds short of a whole number of
    # days: shown rounded, 5.99997 days would pass a minimum of 6.
    partitions.ensure_partitions("default")
    today = partitions.day_start(timezone.now().date())
    beyond = today + (partitions.AHEAD_DAYS + 1) * DAY
    with connection.cursor() as cursor:
        for ahead in partitions.partitions("default"):
            if ahead.start >= beyond:
                cursor.execute(f'DROP TABLE "{ahead.name}"')
    partitions.forget_coverage()
    at = today + 2 * DAY + dt.timedelta(seconds=3)
    assert partitions.days_ahead("default", at) == pytest.approx(
        partitions.UPKEEP_WARN_DAYS - 3 / 86400
    )
    code, output = strict_status(at)
    assert code == 1 and "--min-partition-days-ahead" in output, output
    assert "only 5.9 day(s) of inbox partitions are made ahead" in output, output
