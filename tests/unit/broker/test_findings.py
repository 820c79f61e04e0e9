"""The broker check's judgement (:mod:`reliable_messaging.broker.findings`) on in-memory facts."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_messaging.broker.findings import (
    BrokerFacts,
    DeprecatedFeature,
    Expectations,
    Finding,
    OurQueue,
    QueueFacts,
    delivery_limit,
    effective,
    find_findings,
    summary,
)

URL = "amqp://rabbitmq:5672/%2F"
MIB = 1024 * 1024
CLASSIC = Expectations()
QUORUM = Expectations(queue_type="quorum")
ORDERS = OurQueue(
    "orders", "consumer", "shop.orders", handler_timeout=600, dead_letter_to="orders.dead"
)
DEAD = OurQueue("orders.dead", "dead", "shop.orders", handler_timeout=600)
QUORUM_ARGUMENTS = {
    "x-queue-type": "quorum",
    "x-delivery-limit": 50,
    "x-dead-letter-exchange": "",
    "x-dead-letter-routing-key": "orders.dead",
}


def facts(*queues: QueueFacts, version: str = "4.0.5", **changes: Any) -> BrokerFacts:
    base: dict[str, Any] = {
        "url": URL,
        "vhost": "/",
        "server_version": version,
        "management_url": "http://rabbitmq:15672",
        "management_version": version,
        "deprecated_features": (),
        "queues": queues,
    }
    return BrokerFacts(**{**base, **changes})


def quorum(queue: OurQueue = ORDERS, **changes: Any) -> QueueFacts:
    return QueueFacts(
        queue, exists=True, **{"type": "quorum", "arguments": QUORUM_ARGUMENTS, **changes}
    )


def serious(found: list[Finding]) -> list[tuple[str, str, str]]:
    """(severity, code, subject) of the warnings and errors."""
    return [(f.severity, f.code, f.subject) for f in found if f.severity != "info"]


def only(found: list[Finding], code: str) -> Finding:
    (finding,) = [f for f in found if f.code == code]
    return finding


def test_a_quorum_setup_as_the_app_declares_it_has_nothing_to_report() -> None:
    dead = QueueFacts(DEAD, exists=True, type="quorum", arguments={"x-queue-type": "quorum"})
    found = find_findings(facts(quorum(delivery_limit=50), dead), QUORUM)
    assert serious(found) == []
    assert [f.code for f in found] == ["server-version"]


def test_the_argument_wins_for_the_dead_letter_target_and_the_lower_limit_otherwise() -> None:
    queue = quorum(
        effective_policy={
            "dead-letter-routing-key": "elsewhere",
            "max-length": 10,
            "delivery-limit": 80,
        }
    )
    assert effective(queue, "dead-letter-routing-key") == "orders.dead"
    assert effective(queue, "max-length") == 10
    assert effective(queue, "delivery-limit") == 50
    assert effective(queue, "expires") is None


@pytest.mark.parametrize(
    ("version", "arguments", "policy", "reported", "expected"),
    [
        ("4.0.5", {"x-delivery-limit": 50}, {"delivery-limit": -1}, None, 50),
        ("4.0.5", {}, {}, None, 20),  # 4.0's default
        ("4.0.5", {}, {"delivery-limit": -1}, None, None),
        ("4.0.5", {}, {}, 7, 7),  # the broker's own figure wins
        ("4.0.5", {}, {}, -1, None),
        ("3.10.8", {}, {}, None, None),  # unlimited before 4.0
        ("3.10.8", {"x-delivery-limit": 50}, {"delivery-limit": 5}, None, 5),
    ],
)
def test_the_delivery_limit_as_each_version_resolves_it(
    version: str,
    arguments: dict[str, Any],
    policy: dict[str, Any],
    reported: int | None,
    expected: int | None,
) -> None:
    queue = QueueFacts(
        ORDERS,
        exists=True,
        type="quorum",
        arguments=arguments,
        effective_policy=policy,
        delivery_limit=reported,
    )
    version_tuple = tuple(int(p) for p in version.split("."))
    assert delivery_limit(queue, version_tuple) == expected


def test_a_broker_that_refuses_max_body_bytes_is_an_error_naming_both_sizes() -> None:
    found = find_findings(
        facts(max_message_size=16 * MIB),
        Expectations(max_body_bytes=20 * MIB),
    )
    finding = only(found, "max-message-size")
    assert finding.severity == "error"
    assert "16,777,216 bytes (16 MiB)" in finding.message
    assert "20,971,520 bytes (20 MiB)" in finding.message
    assert "MAX_BODY_BYTES'] to 16777216 or less" in finding.fix
    assert "max_message_size = 20971520" in finding.fix
    assert found[0] is finding  # errors first


def test_without_the_management_api_one_note_says_what_was_not_checked() -> None:
    found = find_findings(
        facts(quorum(effective_policy={"expires": 1000}), management_error="HTTP 401"), QUORUM
    )
    assert serious(found) == []
    assert "were not checked: HTTP 401" in only(found, "management-api").message


def test_a_broker_without_the_deprecated_features_api_is_a_note_not_an_error() -> None:
    found = find_findings(facts(version="3.10.8", deprecated_features=None), CLASSIC)
    finding = only(found, "deprecated-features")
    assert finding.severity == "info"
    assert "3.10.8 does not report deprecated features" in finding.message


def test_deprecated_features_in_use_are_warnings_and_denied_ones_a_note() -> None:
    features = (
        DeprecatedFeature("transient_nonexcl_queues", "permitted_by_default", used=True),
        DeprecatedFeature("classic_queue_mirroring", "removed"),
        DeprecatedFeature("global_qos", "permitted_by_default"),
    )
    found = find_findings(facts(deprecated_features=features), CLASSIC)
    assert serious(found) == [("warning", "deprecated-feature-used", "transient_nonexcl_queues")]
    assert "classic_queue_mirroring (removed)" in only(found, "deprecated-features-denied").message


def test_a_classic_queue_that_a_quorum_vhost_default_made_quorum_drops_past_20_deliveries() -> None:
    # A queue declared without x-queue-type (by hand, by another tool) on a vhost whose default
    # is quorum: 4.0's default limit of 20 and no dead-letter target.
    queue = QueueFacts(ORDERS, exists=True, type="quorum", arguments={}, delivery_limit=20)
    found = find_findings(facts(queue, vhost_default_queue_type="quorum"), CLASSIC)
    assert serious(found) == [
        ("error", "dead-letter-target", "orders"),
        ("warning", "queue-type", "orders"),
    ]
    error = found[0]
    assert "drops a message after 20 deliveries" in error.message
    assert '"dead-letter-routing-key":"orders.dead"' in error.fix
    # consume states the type of what it declares: the vhost's default is a note, not a fault.
    note = only(found, "vhost-default-queue-type")
    assert note.severity == "info" and "not affected" in note.message


def test_a_vhost_default_does_not_matter_when_the_app_declares_quorum_queues() -> None:
    found = find_findings(facts(vhost_default_queue_type="quorum"), QUORUM)
    assert serious(found) == []


def test_a_policy_that_lowers_the_delivery_limit_to_the_crash_limit_is_a_warning() -> None:
    queue = quorum(policy="cap", effective_policy={"delivery-limit": 2}, delivery_limit=2)
    finding = only(find_findings(facts(queue), QUORUM), "delivery-limit")
    assert finding.severity == "warning"
    assert "after 2 deliveries (policy cap)" in finding.message
    assert "not more than CRASH_LIMIT (3)" in finding.message
    assert "clear_policy -p / cap" in finding.fix


def test_an_unlimited_quorum_queue_is_a_warning_when_the_app_expects_a_limit() -> None:
    queue = QueueFacts(ORDERS, exists=True, type="quorum", arguments={"x-queue-type": "quorum"})
    found = find_findings(facts(queue, version="3.10.8"), QUORUM)
    assert ("warning", "delivery-limit", "orders") in serious(found)
    # Without a limit nothing is ever dead-lettered: a missing target does not matter.
    assert "dead-letter-target" not in [f.code for f in found]


def test_a_dead_letter_target_that_does_not_exist_is_an_error() -> None:
    missing = QueueFacts(DEAD, exists=False)
    found = find_findings(facts(quorum(delivery_limit=50), missing), QUORUM)
    assert ("error", "dead-letter-target", "orders") in serious(found)
    assert "orders.dead, which does not exist" in only(found, "dead-letter-target").message


def test_a_dead_letter_target_elsewhere_is_a_warning() -> None:
    arguments = {**QUORUM_ARGUMENTS, "x-dead-letter-routing-key": "audit"}
    found = find_findings(facts(quorum(arguments=arguments, delivery_limit=50)), QUORUM)
    finding = only(found, "dead-letter-target")
    assert finding.severity == "warning"
    assert "routing key 'audit'" in finding.message
    assert "delete_queue -p / orders" in finding.fix


@pytest.mark.parametrize(
    ("policy", "severity", "happens"),
    [
        ({"max-length": 10}, "error", "drops the oldest messages"),
        ({"max-length-bytes": 1000, "overflow": "drop-head"}, "error", "drops the oldest"),
        (
            {"max-length": 10, "dead-letter-exchange": "dlx"},
            "warning",
            "dead-letters the oldest messages to exchange 'dlx'",
        ),
        ({"max-length": 10, "overflow": "reject-publish"}, "warning", "refuses new messages"),
    ],
)
def test_a_length_limit_on_a_classic_queue(
    policy: dict[str, Any], severity: str, happens: str
) -> None:
    queue = QueueFacts(ORDERS, exists=True, policy="cap", effective_policy=policy)
    finding = only(find_findings(facts(queue), CLASSIC), "queue-overflow")
    assert finding.severity == severity
    assert happens in finding.message
    assert "(policy cap)" in finding.message


def test_an_operator_policy_is_named_in_the_fix() -> None:
    queue = QueueFacts(
        ORDERS, exists=True, operator_policy="ops", effective_policy={"message-ttl": 60_000}
    )
    finding = only(find_findings(facts(queue), CLASSIC), "queue-message-ttl")
    assert finding.severity == "error"
    assert "expire in queue orders after 60 s (operator policy ops)" in finding.message
    assert "clear_operator_policy -p / ops" in finding.fix


def test_a_queue_that_expires_loses_its_messages() -> None:
    queue = QueueFacts(ORDERS, exists=True, policy="tidy", effective_policy={"expires": 3_600_000})
    finding = only(find_findings(facts(queue), CLASSIC), "queue-expires")
    assert finding.severity == "error"
    assert "expires after 1 h unused (policy tidy)" in finding.message
    assert "deletes it with every message" in finding.message


@pytest.mark.parametrize(
    ("timeout_ms", "severity"),
    [(60_000, "error"), (610_000, "error"), (700_000, "warning"), (900_000, None)],
)
def test_a_consumer_timeout_below_the_handler_limit_or_half_the_broker_setting(
    timeout_ms: int, severity: str | None
) -> None:
    queue = QueueFacts(
        ORDERS, exists=True, policy="short", effective_policy={"consumer-timeout": timeout_ms}
    )
    found = [f for f in find_findings(facts(queue), CLASSIC) if f.code == "consumer-timeout"]
    assert [f.severity for f in found] == ([severity] if severity else [])


def test_a_consumer_timeout_argument_means_nothing_to_rabbitmq_3_10() -> None:
    queue = QueueFacts(ORDERS, exists=True, arguments={"x-consumer-timeout": 1000})
    assert serious(find_findings(facts(queue, version="3.10.8"), CLASSIC)) == []


def test_from_4_3_a_consumer_timeout_concerns_quorum_queues_only() -> None:
    """4.3 evaluates the consumer timeout in the queue: classic queues never time a consumer
    out, and a quorum queue takes the late delivery back with a basic.cancel."""
    policy: dict[str, Any] = {"policy": "short", "effective_policy": {"consumer-timeout": 60_000}}
    classic = QueueFacts(ORDERS, exists=True, **policy)
    assert serious(find_findings(facts(classic, version="4.3.6"), CLASSIC)) == []
    assert serious(find_findings(facts(classic, version="4.2.9"), CLASSIC)) == [
        ("error", "consumer-timeout", "orders")
    ]
    late = only(find_findings(facts(quorum(**policy), version="4.3.6"), QUORUM), "consumer-timeout")
    assert late.severity == "error"
    assert "takes a slow handler's delivery back while it runs and cancels the consumer" in (
        late.message
    )


def test_a_stream_is_an_error() -> None:
    queue = QueueFacts(ORDERS, exists=True, type="stream")
    assert serious(find_findings(facts(queue), CLASSIC)) == [("error", "queue-type", "orders")]


def test_queues_not_declared_or_not_sampled_yet_are_notes() -> None:
    found = find_findings(
        facts(QueueFacts(ORDERS, exists=False), QueueFacts(DEAD, exists=True, sampled=False)),
        CLASSIC,
    )
    assert serious(found) == []
    assert only(found, "queue-missing").subject == "orders"
    assert only(found, "queue-not-sampled").subject == DEAD.name


def test_summary() -> None:
    found = [
        Finding("error", "a", "x", "m"),
        Finding("info", "b", "x", "m"),
        Finding("info", "c", "x", "m"),
    ]
    assert summary(found) == "1 error, 2 notes"
    assert summary([]) == "nothing found"


TASKS_QUEUE = OurQueue(
    "tasks.default",
    "consumer",
    "django.tasks:default:default",
    handler_timeout=600,
    priorities=True,
)


@pytest.mark.parametrize(
    ("queue_type", "arguments", "version", "expected"),
    [
        ("classic", {"x-max-priority": 9}, "3.10.8", None),
        ("classic", {}, "4.3.6", ("error", "task-priorities-ignored")),
        ("classic", {"x-max-priority": 3}, "4.0.5", ("warning", "task-priorities-capped")),
        ("quorum", {}, "3.10.8", ("warning", "task-priorities-ignored")),
        ("quorum", {}, "4.0.5", ("info", "task-priorities-two-levels")),
        ("quorum", {}, "4.3.6", None),
    ],
)
def test_a_task_queue_whose_priorities_the_broker_ignores_is_named(
    queue_type: str, arguments: dict[str, Any], version: str, expected: tuple[str, str] | None
) -> None:
    queue = QueueFacts(
        TASKS_QUEUE,
        exists=True,
        type=queue_type,
        arguments={"x-queue-type": queue_type, **arguments},
        delivery_limit=50 if queue_type == "quorum" else None,
    )
    found = [
        (f.severity, f.code)
        for f in find_findings(facts(queue, version=version), Expectations(queue_type=queue_type))
        if f.code.startswith("task-priorities")
    ]
    assert found == ([] if expected is None else [expected])


def test_a_handler_queue_without_priorities_is_not_a_task_queue_finding() -> None:
    queue = QueueFacts(ORDERS, exists=True, type="classic", arguments={"x-queue-type": "classic"})
    found = find_findings(facts(queue, version="3.10.8"), CLASSIC)
    assert not [f for f in found if f.code.startswith("task-priorities")]
