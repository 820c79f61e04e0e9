"""The shipped alert rules and dashboard watch failure groups by state (new and regressed), not
the raw count of dead letters, and name the metrics the scrape exports for them."""

from __future__ import annotations

import json
import re

import yaml

from reliable_messaging.ops.collectors import FAILURE_GROUP_SERIES

from .test_shipped_dashboards import ALERTS, DASHBOARD, alert_rules, exported, referenced

__all__ = ["exported"]  # the fixture, for the test below


def rules_by_name() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in alert_rules()}


def test_the_failure_group_rules_fire_on_new_and_regressed_groups_only() -> None:
    rules = rules_by_name()
    new = rules["ReliableMessagingNewFailureGroup"]["expr"]
    regressed = rules["ReliableMessagingFailureGroupRegressed"]["expr"]
    assert 'reliable_messaging_failure_group_dead_letters{state="new"}' in new
    assert 'reliable_messaging_failure_group_dead_letters{state="regressed"}' in regressed
    for expr in (new, regressed):
        assert "by (consumer, reason, fingerprint)" in expr and expr.endswith("> 0")
    many = rules["ReliableMessagingManyFailureGroups"]["expr"]
    assert 'reliable_messaging_failure_groups{state=~"new|regressed"}' in many
    # It fires where the per-group series stop: every group needing attention is alerted on.
    assert many.endswith(f"> {FAILURE_GROUP_SERIES}")
    for name in ("ReliableMessagingNewFailureGroup", "ReliableMessagingFailureGroupRegressed"):
        description = rules[name]["annotations"]["description"]
        assert "reliable_messaging/deadletter/groups/?state=" in description  # the admin page
        assert "acknowledge" in description


def test_no_rule_alerts_on_the_raw_dead_letter_count() -> None:
    for rule in alert_rules():
        assert "reliable_messaging_dead_letters" not in referenced(rule["expr"]), rule["alert"]
        assert "acknowledged" not in rule["expr"], rule["alert"]  # muted groups never alert
    # The file says why (a YAML comment, read as text).
    assert "alert by failure group, not by count" in ALERTS.read_text()
    assert yaml.safe_load(ALERTS.read_text())["groups"]


def test_the_new_metrics_are_exported(exported: set[str]) -> None:
    assert "reliable_messaging_failure_groups" in exported
    assert "reliable_messaging_failure_group_dead_letters" in exported  # the new group


def test_the_dashboard_shows_the_groups_by_state() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (panel,) = [p for p in panels if p["title"] == "Failure groups by state"]
    (target,) = panel["targets"]
    assert re.fullmatch(r"max by \(state\) \(reliable_messaging_failure_groups\)", target["expr"])
