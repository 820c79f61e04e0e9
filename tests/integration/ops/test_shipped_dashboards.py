"""The shipped Prometheus alert rules and Grafana dashboard: well-formed, and naming only
metrics the app really exports (read from live registries), so they cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

import reliable_messaging
from reliable_messaging import metrics
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.metrics import HealthCollector
from reliable_messaging.models import DeadLetter
from reliable_messaging.ops.collectors import BrokerCollector, DatabaseCollector
from reliable_messaging.ops.status import OUTBOX_LAG_LIMIT
from tests.support import broker_connection

# Shipped in the package (reliable_messaging/monitoring/), so users of the wheel have them too.
MONITORING = Path(reliable_messaging.__file__).resolve().parent / "monitoring"
ALERTS = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"\breliable_messaging_[a-z0-9_]+\b")
DURATION = re.compile(r"^\d+[smhd]$")


@pytest.fixture
def exported(db: None, ns: str, rm_settings: dict[str, Any]) -> set[str]:
    """Every sample name the app exports, after each helper has run once (with a dead letter
    in the database, so the labelled database gauge has a sample too)."""
    metrics.consumer_received("tests.ops.names", redelivered=True)
    for outcome in metrics.CONSUMER_OUTCOMES:
        metrics.consumer_outcome("tests.ops.names", outcome, duration=0.01)
    for result in metrics.DEDUP_RESULTS:
        metrics.dedup_cache("tests.ops.names", result)
    metrics.handler_timeout("tests.ops.names")
    metrics.breaker_state("tests.ops.names", 2)
    metrics.breaker_opened("tests.ops.names")
    metrics.relay_claimed(1)
    metrics.relay_published(1)
    metrics.relay_confirm_latency(0.01)
    metrics.relay_blocked(True)
    metrics.relay_blocked(False)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    registry.register(HealthCollector(HealthState()))
    spec = ConsumerSpec(name="tests.ops.names", queue=f"rmtest.{ns}.names", handler=print)
    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [spec])
    finally:
        connection.close()
    registry.register(BrokerCollector([spec]))
    DeadLetter.objects.create(
        consumer="tests.ops.names", queue="q", body=b"", reason=DeadLetterReason.PERMANENT
    )
    names = {s.name for r in (REGISTRY, registry) for f in r.collect() for s in f.samples}
    assert "reliable_messaging_database_up" in names  # the database was read
    assert "reliable_messaging_queue_messages_ready" in names  # and the broker
    return names


def referenced(expression: str) -> set[str]:
    return set(METRIC_NAME.findall(expression))


# -- alert rules ---------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    rules: list[dict[str, Any]] = []
    for group in document["groups"]:
        assert isinstance(group["name"], str) and group["rules"]
        rules.extend(group["rules"])
    return rules


def test_alert_rules_are_well_formed() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["alert"].startswith("ReliableMessaging")
        assert DURATION.match(rule["for"]), rule
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert set(rule["annotations"]) == {"summary", "description"}
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]


def test_alert_rules_cover_the_operational_risks() -> None:
    expressions = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    text = " ".join(expressions.values())
    assert "reliable_messaging_consumer_redelivered_total" in text  # redelivery rate
    assert "> 0.10" in expressions["ReliableMessagingHighRedeliveryRate"]
    assert "reliable_messaging_outbox_oldest_pending_age_seconds" in text  # outbox lag
    assert "reliable_messaging_failure_group_dead_letters" in text  # new or regressed groups
    assert 'up{job="reliable-messaging-consume"} == 0' in text  # consumer down
    assert "reliable_messaging_healthy == 0" in text  # a process failing its health check
    assert "reliable_messaging_relay_blocked" in text  # relay blocked for long
    # Messages waiting while nothing consumes them (a consumer down though its pod looks fine).
    not_consumed = expressions["ReliableMessagingQueueNotConsumed"]
    assert "reliable_messaging_queue_messages_ready" in not_consumed
    assert "reliable_messaging_queue_consumers" in not_consumed and "== 0" in not_consumed
    assert 'kind="leftover"' in expressions["ReliableMessagingLeftoverQueueHoldsMessages"]


def test_the_outbox_lag_alert_uses_the_limit_the_probes_judge() -> None:
    """The alert fires past the lag ``messaging_status`` and ``messaging/healthz/`` fail at
    (declared once, in reliable_messaging.ops.status): an operator sees one number."""
    expr = {rule["alert"]: rule["expr"] for rule in alert_rules()}["ReliableMessagingOutboxLag"]
    assert expr == (
        f"max(reliable_messaging_outbox_oldest_pending_age_seconds) > {OUTBOX_LAG_LIMIT:g}"
    )


def test_alert_rules_name_only_exported_metrics(exported: set[str]) -> None:
    for rule in alert_rules():
        names = referenced(rule["expr"])
        assert names or "up{" in rule["expr"], f"{rule['alert']} names no metric"
        assert names <= exported, f"{rule['alert']}: not exported: {names - exported}"


# -- the dashboard -------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def graph_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
    for panel in graph_panels():
        assert panel["title"] and panel["description"]
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), panel["title"]


def test_dashboard_shows_what_operators_need() -> None:
    titles = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in graph_panels()}
    expectations = {
        "Throughput by outcome": "reliable_messaging_consumer_messages_total",
        "Handler duration p50 / p99": "reliable_messaging_handler_duration_seconds_bucket",
        "Redelivery rate": "reliable_messaging_consumer_redelivered_total",
        "Outbox pending": "reliable_messaging_outbox_pending_messages",
        "Outbox lag": "reliable_messaging_outbox_oldest_pending_age_seconds",
        "Dead letters waiting, by consumer and reason": "reliable_messaging_dead_letters",
        "Relay confirm latency p50 / p99": "reliable_messaging_relay_confirm_latency_seconds",
        "Relay blocked by the broker": "reliable_messaging_relay_blocked",
        "Messages ready, by queue": "reliable_messaging_queue_messages_ready",
        "Consumers attached, by queue": "reliable_messaging_queue_consumers",
    }
    for title, metric in expectations.items():
        assert metric in titles[title], title
    assert "histogram_quantile(0.99" in titles["Handler duration p50 / p99"]
    assert "histogram_quantile(0.5" in titles["Handler duration p50 / p99"]


def test_dashboard_names_only_exported_metrics(exported: set[str]) -> None:
    board = dashboard()
    expressions = [t["expr"] for p in graph_panels() for t in p["targets"]]
    expressions += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    for expression in expressions:
        names = referenced(expression)
        assert names, f"names no metric: {expression}"
        assert names <= exported, f"not exported: {names - exported} in {expression}"
