"""The one place health is judged (``reliable_messaging.ops.status``): the outbox-lag limits are
declared once and every endpoint uses them, and the answers of ``/healthz`` are built there.

Pure logic: no broker, no database."""

from __future__ import annotations

import datetime as dt
import inspect

import pytest

from reliable_messaging.core.liveness import HealthGroup, HealthState
from reliable_messaging.ops import views
from reliable_messaging.ops.status import (
    OUTBOX_LAG_LIMIT,
    OUTBOX_LAG_STRICT_LIMIT,
    CheckResult,
    HealthReport,
    Thresholds,
    outbox_lag_check,
    outbox_lag_problem,
    process_health,
    system_health,
)


def test_the_outbox_lag_limits_are_the_documented_ones_and_shared() -> None:
    # docs/operations.md: messaging/healthz/ and messaging_status judge "under 5 minutes";
    # docs/reference/commands.md: --strict judges "outbox lag over 60 s".
    assert OUTBOX_LAG_LIMIT == 300.0
    assert OUTBOX_LAG_STRICT_LIMIT == 60.0
    assert Thresholds().max_outbox_lag == OUTBOX_LAG_LIMIT
    assert Thresholds.strict().max_outbox_lag == OUTBOX_LAG_STRICT_LIMIT
    assert inspect.signature(views.healthz).parameters["max_outbox_lag"].default == OUTBOX_LAG_LIMIT


def test_the_health_check_default_is_the_strict_limit() -> None:
    pytest.importorskip("health_check")
    from reliable_messaging.contrib.health_check import MessagingHealthCheck

    assert MessagingHealthCheck().max_outbox_lag == dt.timedelta(seconds=OUTBOX_LAG_STRICT_LIMIT)


@pytest.mark.parametrize(
    ("lag", "limit", "lagging"),
    [(None, 60.0, False), (0.0, 60.0, False), (60.0, 60.0, False), (61.0, 60.0, True)],
)
def test_outbox_lag_is_judged_past_its_limit_only(
    lag: float | None, limit: float, lagging: bool
) -> None:
    problem = outbox_lag_problem(lag, limit)
    assert (problem is not None) is lagging
    assert outbox_lag_check(lag or 0.0, limit).ok is not lagging
    if problem is not None:
        assert problem.threshold == "max_outbox_lag"
        assert problem.message.startswith("the oldest pending outbox row is 61 s old (limit 60 s)")


def test_an_unset_limit_judges_nothing() -> None:
    assert outbox_lag_problem(10**6, None) is None


def test_a_system_report_names_the_failed_checks_as_reasons() -> None:
    report = system_health(
        {"database": CheckResult(True, "the database answers"), "broker": CheckResult(False, "x")}
    )
    assert not report.ok
    assert report.http_status == 503
    assert report.as_dict() == {
        "status": "unhealthy",
        "checks": {
            "database": {"ok": True, "detail": "the database answers"},
            "broker": {"ok": False, "detail": "x"},
        },
        "reasons": ["x"],
    }


def test_a_healthy_report_is_200_with_no_reasons() -> None:
    report = HealthReport()
    assert report.ok and report.http_status == 200
    assert report.as_dict() == {"status": "ok"}


def test_a_process_report_carries_its_reasons_and_notes() -> None:
    health = HealthState(stall_after=30.0, clock=lambda: 0.0)
    health.note("blocked", "publishing blocked by a resource alarm")
    report = process_health(health)
    assert report.as_dict() == {
        "status": "unhealthy",
        "reasons": ["broker not connected"],
        "notes": ["publishing blocked by a resource alarm"],
    }

    health.set_broker(True)
    health.note("blocked", None)
    assert process_health(HealthGroup({"lane-0": health})).as_dict() == {"status": "ok"}
