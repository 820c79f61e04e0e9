"""The broker check (:mod:`reliable_messaging.broker.inspection`) against both real brokers.

On the system's 3.10 node, a policy on one uniquely named queue of the default vhost (removed
afterwards); on the 4.0 and the 4.3 node, a vhost of the test's own whose default queue type is
quorum (deleted afterwards). The management API publishes a queue's policies only with its next
statistics, seconds after a change: the tests wait for the findings, they do not sleep.
"""

from __future__ import annotations

import io
import json
import logging
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from reliable_messaging.broker.inspection import (
    BrokerCheck,
    check_broker,
    log_body_limit_in_background,
    log_findings_in_background,
)
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.core.registry import ConsumerSpec, registry
from tests.support import ConsumeProcess, rabbitmqctl, wait_until

MIB = 1024 * 1024
SAMPLED = 45.0  # seconds: quorum queues publish their statistics every few seconds


def spec_of(queue: str) -> ConsumerSpec:
    return ConsumerSpec(name=queue, queue=queue, handler=lambda m: None, bindings=("x.#",))


def declare(url: str, *specs: ConsumerSpec) -> None:
    """What ``consume`` declares for ``specs`` at its start."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        declare_topology(connection.channel(), specs)
    finally:
        connection.close()


def serious(check: BrokerCheck) -> set[tuple[str, str, str]]:
    return {(f.severity, f.code, f.subject) for f in check.findings if f.severity != "info"}


def check_until(specs: list[ConsumerSpec], *wanted: tuple[str, str, str]) -> BrokerCheck:
    """The first check that finds all of ``wanted`` (severity, code, subject)."""
    last: list[BrokerCheck] = []

    def found() -> BrokerCheck | None:
        check = check_broker(specs)
        last[:] = [check]
        return check if set(wanted) <= serious(check) else None

    return wait_until(
        found,
        timeout=SAMPLED,
        interval=0.5,
        message=lambda: f"findings {wanted}; found {last[0].findings if last else None}",
    )


# --------------------------------------------------------------------------- RabbitMQ 3.10


@pytest.fixture
def on_3_10(ns: str) -> Iterator[dict[str, Any]]:
    values = {
        **settings.RELIABLE_MESSAGING,
        # The system's node, whichever broker the session tests (RM_TEST_BROKER).
        "BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
        "MANAGEMENT_URL": "http://127.0.0.1:15672",
        "EXCHANGE": f"rmtest.{ns}",
        "MAX_BODY_BYTES": 20 * MIB,
    }
    with override_settings(RELIABLE_MESSAGING=values):
        yield values


def test_3_10_a_policy_that_drops_and_expires_one_consumer_queue(ns: str, on_3_10: Any) -> None:
    spec = spec_of(f"rmtest.{ns}.orders")
    declare(on_3_10["BROKER_URL"], spec)
    policy = f"rmtest-{ns}"
    definition = {"max-length": 10, "overflow": "drop-head", "expires": 3_600_000}
    rabbitmqctl(
        "set_policy", "-p", "/", "--apply-to", "queues", policy,
        f"^{re.escape(spec.queue)}$", json.dumps(definition),
    )  # fmt: skip
    try:
        check = check_until(
            [spec],
            ("error", "queue-overflow", spec.queue),
            ("error", "queue-expires", spec.queue),
        )
    finally:
        rabbitmqctl("clear_policy", "-p", "/", policy)
    findings = {f.code: f for f in check.findings}
    assert "drops the oldest messages" in findings["queue-overflow"].message
    assert f"clear_policy -p / {policy}" in findings["queue-overflow"].fix
    assert "expires after 1 h unused" in findings["queue-expires"].message
    # 128 MiB by default: 20 MiB bodies pass.
    assert "max-message-size" not in findings
    assert "RabbitMQ 3.10" in findings["server-version"].message
    assert "not an error" in findings["deprecated-features"].message
    assert {subject for _, _, subject in serious(check)} == {spec.queue}


def test_3_10_nothing_to_report_on_queues_as_consume_declares_them(ns: str, on_3_10: Any) -> None:
    spec = spec_of(f"rmtest.{ns}.clean")
    declare(on_3_10["BROKER_URL"], spec)

    def sampled() -> BrokerCheck | None:
        check = check_broker([spec])
        return None if any(f.code == "queue-not-sampled" for f in check.findings) else check

    check = wait_until(sampled, timeout=SAMPLED, interval=0.5)
    assert serious(check) == set()
    assert not [f for f in check.findings if f.code == "queue-missing"]


def test_3_10_without_the_management_api_one_note_and_no_error(ns: str, on_3_10: Any) -> None:
    spec = spec_of(f"rmtest.{ns}.noapi")
    with override_settings(
        RELIABLE_MESSAGING={**on_3_10, "MANAGEMENT_URL": "http://monitor:s3cret@127.0.0.1:1"}
    ):
        check = check_broker([spec])
    assert check.reachable
    assert serious(check) == set()
    (note,) = [f for f in check.findings if f.code == "management-api"]
    assert "http://monitor:***@127.0.0.1:1 is unreachable" in note.message
    assert "s3cret" not in repr(check)


def test_management_url_credentials_are_the_ones_used(ns: str, on_3_10: Any) -> None:
    """A MANAGEMENT_URL with a user of its own is read as that user: a wrong password is
    refused (401), the right one is not, whatever the broker URL's credentials."""
    spec = spec_of(f"rmtest.{ns}.creds")
    wrong = {**on_3_10, "MANAGEMENT_URL": "http://guest:wrong@127.0.0.1:15672"}
    with override_settings(RELIABLE_MESSAGING=wrong):
        (note,) = [f for f in check_broker([spec]).findings if f.code == "management-api"]
    assert "answered HTTP 401" in note.message
    right = {**on_3_10, "MANAGEMENT_URL": "http://guest:guest@127.0.0.1:15672"}
    with override_settings(RELIABLE_MESSAGING=right):
        assert not [f for f in check_broker([spec]).findings if f.code == "management-api"]


def test_an_unreachable_broker_is_said_not_raised(on_3_10: Any) -> None:
    url = "amqp://guest:s3cret@127.0.0.1:1/%2F"
    with override_settings(RELIABLE_MESSAGING={**on_3_10, "BROKER_URL": url}):
        check = check_broker([])
    assert not check.reachable
    assert "cannot connect to amqp://guest:***@127.0.0.1:1/%2F" in check.error
    assert "s3cret" not in check.error


# --------------------------------------------------------------------------- RabbitMQ 4


@pytest.fixture(scope="module", params=["rabbitmq4", "rabbitmq43"])
def node4(request: pytest.FixtureRequest) -> Any:
    """Each RabbitMQ 4 node in turn: 4.0 and 4.3 (tests/rabbitmq4.py)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def quorum_vhost(node4: Any) -> Iterator[str]:
    """A vhost of the 4.x node whose queues are quorum queues unless declared otherwise."""
    from tests.support import new_namespace

    vhost = f"rmtest-{new_namespace()}"
    node4.ctl("add_vhost", vhost, "--default-queue-type", "quorum")
    try:
        node4.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield vhost
    finally:
        node4.ctl("delete_vhost", vhost)


@pytest.fixture
def on_4(ns: str, node4: Any, quorum_vhost: str) -> Iterator[dict[str, Any]]:
    url = node4.url.rsplit("/", 1)[0] + "/" + urllib.parse.quote(quorum_vhost, safe="")
    values = {
        **settings.RELIABLE_MESSAGING,
        "BROKER_URL": url,
        "MANAGEMENT_URL": node4.management_url,
        "EXCHANGE": f"rmtest.{ns}",
        "MAX_BODY_BYTES": 20 * MIB,
    }
    with override_settings(RELIABLE_MESSAGING=values):
        yield values


def test_4_a_queue_the_quorum_vhost_default_turned_quorum(
    ns: str, node4: Any, quorum_vhost: str, on_4: Any
) -> None:
    """consume states every queue's type; a queue declared without one (by hand, by another
    tool) on a vhost whose default is quorum is a quorum queue with the broker's limit of 20
    and no dead-letter target, which the check reports."""
    spec = spec_of(f"rmtest.{ns}.orders")
    declare(on_4["BROKER_URL"], spec)
    connection = pika.BlockingConnection(pika.URLParameters(on_4["BROKER_URL"]))
    try:
        channel = connection.channel()
        channel.queue_delete(spec.queue)
        channel.queue_declare(spec.queue, durable=True)  # no x-queue-type
    finally:
        connection.close()
    policy = f"rmtest-{ns}-expires"
    node4.ctl(
        "set_policy", "-p", quorum_vhost, "--apply-to", "queues", policy,
        f"^{re.escape(spec.queue)}$", json.dumps({"expires": 600_000}),
    )  # fmt: skip
    node = check_broker([]).url
    assert node.startswith(f"amqp://127.0.0.1:{node4.amqp_port}/")  # not the system's
    check = check_until(
        [spec],
        ("error", "max-message-size", node),
        ("warning", "queue-type", spec.queue),
        ("error", "dead-letter-target", spec.queue),
        ("error", "queue-expires", spec.queue),
    )
    findings = {(f.code, f.subject): f for f in check.findings}
    size = findings["max-message-size", check.url]
    assert "over 16,777,216 bytes (16 MiB)" in size.message
    assert "up to 20,971,520 bytes (20 MiB)" in size.message
    # 4.0 gives a quorum queue a delivery limit of 20, and the app gave it no target.
    assert (
        "drops a message after 20 deliveries" in findings["dead-letter-target", spec.queue].message
    )
    assert "a consume outage that long" in findings["queue-expires", spec.queue].message
    assert f"RabbitMQ {node4.release}." in findings["server-version", check.url].message
    assert "not affected" in findings["vhost-default-queue-type", quorum_vhost].message


def test_4_a_policy_lowering_the_delivery_limit_and_the_consumer_timeout(
    ns: str, node4: Any, quorum_vhost: str, on_4: Any
) -> None:
    spec = spec_of(f"rmtest.{ns}.payments")
    with override_settings(
        RELIABLE_MESSAGING={**on_4, "QUEUE_TYPE": "quorum", "MAX_BODY_BYTES": 1 * MIB}
    ):
        declare(on_4["BROKER_URL"], spec)
        policy = f"rmtest-{ns}-short"
        node4.ctl(
            "set_policy", "-p", quorum_vhost, "--apply-to", "quorum_queues", policy,
            f"^{re.escape(spec.queue)}$",
            json.dumps({"delivery-limit": 2, "consumer-timeout": 60_000}),
        )  # fmt: skip
        check = check_until(
            [spec],
            ("warning", "delivery-limit", spec.queue),
            ("error", "consumer-timeout", spec.queue),
        )
    findings = {(f.code, f.subject): f for f in check.findings}
    limit = findings["delivery-limit", spec.queue]
    assert f"after 2 deliveries (policy {policy})" in limit.message
    assert "consumer timeout of 60 s" in findings["consumer-timeout", spec.queue].message
    # Declared by the app as quorum, with its target: the vhost default and the target are fine.
    codes = {code for code, _ in findings}
    assert not codes & {"vhost-default-queue-type", "dead-letter-target", "max-message-size"}


def test_4_a_consumer_timeout_policy_on_a_classic_queue_matters_before_4_3_only(
    ns: str, node4: Any, quorum_vhost: str, on_4: Any
) -> None:
    """From 4.3 classic queues never time a consumer out, whatever a policy says: the check
    reports such a policy on 4.0 (the broker would close the channel under a slow handler) and
    says nothing of it on 4.3. The quorum queue's finding says what 4.3 does instead."""
    classic, quorum = spec_of(f"rmtest.{ns}.classic"), spec_of(f"rmtest.{ns}.quorum")
    declare(on_4["BROKER_URL"], classic)  # QUEUE_TYPE classic
    with override_settings(RELIABLE_MESSAGING={**on_4, "QUEUE_TYPE": "quorum"}):
        declare(on_4["BROKER_URL"], quorum)
    policy = f"rmtest-{ns}-slow"
    node4.ctl(
        "set_policy", "-p", quorum_vhost, "--apply-to", "queues", policy,
        f"^rmtest\\.{re.escape(ns)}\\.(classic|quorum)$", json.dumps({"consumer-timeout": 60_000}),
    )  # fmt: skip
    check = check_until([quorum], ("error", "consumer-timeout", quorum.queue))
    quorum_message = {(f.code, f.subject): f for f in check.findings}[
        "consumer-timeout", quorum.queue
    ].message
    if node4.release == "4.0":
        check_until([classic], ("error", "consumer-timeout", classic.queue))
        assert "gets its channel closed by the broker" in quorum_message
        return
    # The policy reached the classic queue too (both are sampled alike), and 4.3 ignores it.
    wait_until(
        lambda: _queue_api(node4, quorum_vhost, classic.queue).get("policy") == policy,
        timeout=SAMPLED,
        message="the policy shown on the classic queue",
    )
    found = check_broker([classic]).findings
    assert [f for f in found if f.code == "consumer-timeout"] == []
    assert "takes a slow handler's delivery back while it runs and cancels the consumer" in (
        quorum_message
    )


def _queue_api(node: Any, vhost: str, queue: str) -> dict[str, Any]:
    quoted = "/".join(urllib.parse.quote(part, safe="") for part in (vhost, queue))
    request = urllib.request.Request(f"{node.management_url}/api/queues/{quoted}")
    request.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.load(response))


def test_messaging_status_broker_exits_1_on_an_error_finding(
    ns: str, on_4: Any, transactional_db: None
) -> None:
    spec = spec_of(f"rmtest.{ns}.status")
    out, err = io.StringIO(), io.StringIO()
    with registry.isolated():
        registry.register(spec)
        with pytest.raises(CommandError) as raised:
            call_command("messaging_status", "--broker", "--json", stdout=out, stderr=err)
    assert raised.value.returncode == 1
    assert "the broker check found 1 error(s)" in str(raised.value)
    document = json.loads(out.getvalue())
    check = document["broker_check"]
    errors = [f for f in check["findings"] if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["max-message-size"]
    assert "max_message_size = 20971520 in rabbitmq.conf" in errors[0]["fix"]
    assert document["exit_code"] == 1
    assert document["problems"] == []


def test_consume_start_logs_each_warning_and_error_once(
    ns: str, on_4: Any, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_of(f"rmtest.{ns}.startup")
    with caplog.at_level(logging.INFO, logger="reliable_messaging.broker.inspection"):
        log_findings_in_background([spec]).join(timeout=60)
    lines = [r for r in caplog.records if r.name == "reliable_messaging.broker.inspection"]
    assert {r.levelno for r in lines} == {logging.WARNING}
    logged = sorted(r.getMessage() for r in lines)
    expected = sorted(
        f"broker check: {f.severity.upper()}: {f.message}. Fix: {f.fix}"
        for f in check_broker([spec]).findings
        if f.severity != "info"
    )
    assert logged == expected  # each once
    assert logged[0].startswith("broker check: ERROR: the broker refuses message bodies over")


def test_consume_start_with_the_management_api_unreachable_is_one_info_line(
    ns: str, on_4: Any, caplog: pytest.LogCaptureFixture
) -> None:
    spec = spec_of(f"rmtest.{ns}.noapi")
    values = {**on_4, "MANAGEMENT_URL": "http://127.0.0.1:1", "MAX_BODY_BYTES": MIB}
    with (
        override_settings(RELIABLE_MESSAGING=values),
        caplog.at_level(logging.INFO, logger="reliable_messaging.broker.inspection"),
    ):
        log_findings_in_background([spec]).join(timeout=60)
    lines = [r for r in caplog.records if r.name == "reliable_messaging.broker.inspection"]
    (line,) = lines
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith(
        "broker check: queue types, arguments and policies were not checked: the management "
        "API at http://127.0.0.1:1 is unreachable"
    )


def test_relay_start_logs_an_error_naming_both_sizes(
    on_4: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="reliable_messaging.broker.inspection"):
        log_body_limit_in_background().join(timeout=60)
    (record,) = [r for r in caplog.records if r.name == "reliable_messaging.broker.inspection"]
    assert record.levelno == logging.ERROR
    assert "over 16,777,216 bytes (16 MiB) (max_message_size)" in record.getMessage()
    assert "accept up to 20,971,520 bytes (20 MiB)" in record.getMessage()


def test_relay_start_says_nothing_when_the_broker_takes_max_body_bytes(
    on_3_10: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="reliable_messaging.broker.inspection"):
        log_body_limit_in_background().join(timeout=60)
    assert not [r for r in caplog.records if r.name == "reliable_messaging.broker.inspection"]


# --------------------------------------------------------------------------- manage.py consume


@pytest.fixture
def management_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``manage.py consume`` subprocesses started after this read no management API."""
    monkeypatch.setenv("RM_TEST_MANAGEMENT_URL", "http://127.0.0.1:1")


@pytest.mark.slow
def test_consume_logs_a_policy_that_expires_its_queue_and_consumes(
    ns: str, rm_settings: dict[str, Any], consume: Any
) -> None:
    # The queue of the test app's consumer tests.alpha, declared as consume declares it, and a
    # policy the broker has sampled on it before consume starts.
    spec = spec_of(f"{ns}.alpha")
    declare(rm_settings["BROKER_URL"], spec)
    policy = f"rmtest-{ns}"
    rabbitmqctl(
        "set_policy", "-p", "/", "--apply-to", "queues", policy,
        f"^{re.escape(spec.queue)}$", json.dumps({"expires": 86_400_000}),
    )  # fmt: skip
    try:
        check_until([spec], ("error", "queue-expires", spec.queue))
        process: ConsumeProcess = consume("--queue", spec.queue)
        process.wait_for_log(
            "WARNING reliable_messaging.broker.inspection broker check: ERROR: "
            f"queue {spec.queue} expires after 24 h"
        )
        process.wait_consuming()
    finally:
        rabbitmqctl("clear_policy", "-p", "/", policy)
    assert process.log().count(f"queue {spec.queue} expires after") == 1


@pytest.mark.slow
def test_consume_with_the_management_api_unreachable_says_so_once_and_consumes(
    ns: str, management_unreachable: None, consume: Any
) -> None:
    process: ConsumeProcess = consume("--queue", f"{ns}.alpha")
    process.wait_consuming()
    process.wait_for_log("INFO reliable_messaging.broker.inspection broker check: queue types")
    assert "http://127.0.0.1:1 is unreachable" in process.log()
    assert process.returncode is None
