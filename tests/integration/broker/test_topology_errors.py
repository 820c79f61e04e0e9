"""Declaring over what the broker already has: a clear error that says what differs and how to
migrate, never a bare PRECONDITION_FAILED."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.exceptions import TopologyMismatchError
from tests.support import broker_connection


def spec(ns: str, **kwargs: Any) -> ConsumerSpec:
    return ConsumerSpec(
        name=f"{ns}.alpha",
        queue=f"{ns}.alpha",
        handler=lambda message: None,
        bindings=("order.*",),
        **kwargs,
    )


def test_classic_queue_declared_as_quorum_says_what_differs_and_how_to_migrate(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [spec(ns)], messaging_settings)
        quorum = {**rm_settings, "QUEUE_TYPE": "quorum"}
        with (
            override_settings(RELIABLE_MESSAGING=quorum),
            pytest.raises(TopologyMismatchError) as caught,
        ):
            declare_topology(connection.channel(), [spec(ns)], messaging_settings)
    finally:
        if connection.is_open:
            connection.close()
    text = str(caught.value)
    assert f"queue '{ns}.alpha'" in text
    assert "x-queue-type" in text  # the broker's own words on what differs
    assert "'x-delivery-limit': 50" in text  # what these settings asked for
    assert "cannot change in place" in text and "QUEUE_TYPE='quorum'" in text


def test_ordered_consumer_declares_hashed_single_active_partitions(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    from tests.support import queue_arguments

    connection = broker_connection()
    try:
        declare_topology(connection.channel(), [spec(ns, ordered=True)], messaging_settings)
    finally:
        connection.close()
    for index in range(4):
        assert queue_arguments(f"{ns}.alpha.p{index}") == {
            "x-queue-type": "classic",
            "x-single-active-consumer": True,
        }
    assert queue_arguments(f"{ns}.alpha") is None  # no queue of the plain name


def test_a_tolerated_mismatch_is_named_and_the_queue_bound_while_the_rest_is_declared(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    """The relay's way: a queue another version declared differently does not stop the rest."""
    import pika

    from tests.support import queue_exists, ready_count

    beta = ConsumerSpec(
        name=f"{ns}.beta", queue=f"{ns}.beta", handler=lambda message: None, bindings=("order.*",)
    )
    connection = broker_connection()
    try:
        connection.channel().queue_declare(
            f"{ns}.alpha", durable=True, arguments={"x-max-length": 999}
        )
        with pytest.raises(TopologyMismatchError):
            declare_topology(connection.channel(), [spec(ns), beta], messaging_settings)
        declared = declare_topology(
            connection.channel(), [spec(ns), beta], messaging_settings, tolerate_mismatch=True
        )
        assert list(declared.mismatched) == [f"{ns}.alpha"]
        assert "x-max-length" in declared.mismatched[f"{ns}.alpha"]
        assert declared.channel.is_open
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            rm_settings["EXCHANGE"],
            "order.placed",
            b"{}",
            pika.BasicProperties(delivery_mode=2),
            mandatory=True,
        )
    finally:
        if connection.is_open:
            connection.close()
    assert queue_exists(f"{ns}.beta")
    assert ready_count(f"{ns}.alpha") == 1 and ready_count(f"{ns}.beta") == 1


def test_a_quorum_queue_without_a_dead_letter_target_is_used_as_it_is_with_a_warning(
    ns: str, rm_settings: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Its arguments cannot change in place: consume starts on it, and says how to give it one."""
    from tests.support import queue_arguments

    existing = {"x-queue-type": "quorum", "x-delivery-limit": 50}
    connection = broker_connection()
    try:
        connection.channel().queue_declare(f"{ns}.alpha", durable=True, arguments=existing)
        quorum = {**rm_settings, "QUEUE_TYPE": "quorum"}
        with override_settings(RELIABLE_MESSAGING=quorum), caplog.at_level("WARNING"):
            declared = declare_topology(connection.channel(), [spec(ns)], messaging_settings)
        assert declared.channel.is_open and not declared.mismatched
    finally:
        if connection.is_open:
            connection.close()
    assert queue_arguments(f"{ns}.alpha") == existing
    (warning,) = [r.getMessage() for r in caplog.records if "dead-letter target" in r.getMessage()]
    assert f"queue {ns}.alpha exists without a dead-letter target" in warning
    assert f'"dead-letter-routing-key":"{ns}.alpha.dead"' in warning
