"""Our probes' expected 404s stay out of the log; every other 404 is logged by pika.

Against the real broker, with pika's own loggers captured at INFO (what a project whose root
logger is at INFO shows)."""

from __future__ import annotations

import logging
import uuid

import pika.exceptions
import pytest

from reliable_messaging.broker.pika_logs import expecting_not_found
from reliable_messaging.broker.probes import PassiveProbe
from tests.support import broker_connection


def pika_404_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("pika") and "404" in r.getMessage()
    ]


def test_a_probe_for_a_missing_queue_or_exchange_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    missing = f"rmtest.missing.{uuid.uuid4().hex[:12]}"
    connection = broker_connection()
    try:
        with caplog.at_level(logging.INFO, logger="pika"):
            assert PassiveProbe(connection).queue(missing) is None
            assert PassiveProbe(connection).exchange(missing) is False
            assert connection.is_open  # only the probe's channel was closed
    finally:
        connection.close()
    assert pika_404_records(caplog) == []


def test_a_probe_under_debug_logging_answers_and_keeps_the_connection_usable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At DEBUG pika logs its frames and methods (objects whose ``==`` raises for an int):
    the filter must let them pass, untouched, while a probe runs."""
    missing = f"rmtest.missing.{uuid.uuid4().hex[:12]}"
    existing = f"rmtest.present.{uuid.uuid4().hex[:12]}"
    connection = broker_connection()
    try:
        with caplog.at_level(logging.DEBUG, logger="pika"):
            connection.channel().queue_declare(existing)
            assert PassiveProbe(connection).queue(existing) == (0, 0)
            assert PassiveProbe(connection).queue(missing) is None
            channel = connection.channel()
            with expecting_not_found():
                assert channel.queue_declare(existing, passive=True).method.queue == existing
            channel.queue_delete(existing)
    finally:
        connection.close()  # hung for ever when the filter raised inside pika
    assert any("Entering blocking state" in r.getMessage() for r in caplog.records)
    # pika's DEBUG lines about the close stay for whoever asked for DEBUG; the INFO and
    # WARNING ones of the expected 404 do not appear.
    assert not [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("pika") and r.levelno >= logging.INFO and "404" in r.getMessage()
    ]


def test_a_404_outside_a_probe_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    missing = f"rmtest.missing.{uuid.uuid4().hex[:12]}"
    connection = broker_connection()
    try:
        with caplog.at_level(logging.INFO, logger="pika"):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker):
                connection.channel().queue_declare(missing, passive=True)
            # Nor does a probe on this thread hide what another connection's close says later.
            with expecting_not_found():
                pass
            with pytest.raises(pika.exceptions.ChannelClosedByBroker):
                connection.channel().exchange_declare(missing, passive=True)
    finally:
        connection.close()
    said = pika_404_records(caplog)
    assert len([m for m in said if "Received remote Channel.Close (404)" in m]) == 2, said
