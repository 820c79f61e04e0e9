"""``manage.py relay`` says at its start when the broker refuses bodies ``publish()`` accepts."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import OutboxEnv

MIB = 1024 * 1024
LOGGED = "ERROR reliable_messaging.broker.inspection the broker refuses message bodies over"


@pytest.mark.slow
def test_relay_logs_the_size_4_0_refuses_once_and_keeps_running(
    ob: OutboxEnv, rabbitmq4: Any
) -> None:
    ob.set(BROKER_URL=rabbitmq4.url, MAX_BODY_BYTES=20 * MIB)
    relay = ob.relay_process()
    relay.wait_for_log(LOGGED)
    relay.wait_connected()
    log = relay.log()
    assert log.count(LOGGED) == 1
    assert "over 16,777,216 bytes (16 MiB) (max_message_size)" in log
    assert "MAX_BODY_BYTES'] lets publish() accept up to 20,971,520 bytes (20 MiB)" in log
    assert "Fix: lower RELIABLE_MESSAGING['MAX_BODY_BYTES'] to 16777216 or less" in log
    assert relay.returncode is None
