"""The broker's ``max_message_size`` (16 MiB by default from RabbitMQ 4.0, 128 MiB before): a
body it refuses fails at once with the limit in its error, the rows after it flow, ``publish()``
refuses it while the process knows the limit and takes it again once the operator raised it,
and ``check --deploy`` compares the setting with the broker's limit. On 3.10.8 the same body is
delivered."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.broker import limits
from reliable_messaging.checks import check_broker_max_message_size
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from tests import support
from tests.rabbitmq4 import NODES
from tests.support import wait_until

from .conftest import Broker, OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1024 * 1024
SYSTEM_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


@pytest.fixture(params=["rabbitmq3", "rabbitmq4", "rabbitmq43"])
def broker(request: pytest.FixtureRequest) -> Broker:
    """The system's 3.10 node, or the fixture of that name (the 4.0 and the 4.3 node)."""
    if request.param == "rabbitmq3":
        return Broker(SYSTEM_URL)
    return Broker(request.getfixturevalue(request.param).url)


def test_a_body_over_the_brokers_limit_fails_at_once_and_the_rest_flows(
    ob: OutboxEnv, broker: Broker
) -> None:
    ob.set(BROKER_URL=broker.url, MAX_BODY_BYTES=20 * MIB)
    queue = ob.queue()
    on_4 = broker.url != SYSTEM_URL
    with transaction.atomic():
        big = publish("limits.big", "x" * (17 * MIB))
        after = publish("limits.after", {"n": 1})
    ob.relay_thread()
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=after).status == OutboxStatus.SENT,
        timeout=60,
        message="the row after the big one sent",
    )
    row = OutboxMessage.objects.get(message_id=big)
    if not on_4:
        wait_until(
            lambda: OutboxMessage.objects.get(message_id=big).status == OutboxStatus.SENT,
            timeout=60,
            message="the 17 MiB row sent (3.10 takes up to 128 MiB)",
        )
        assert {m.message_id for m in broker.drain(queue, expected=2)} == {big, after}
        return
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=big).status == OutboxStatus.FAILED,
        timeout=30,
        message="the refused row failed at once, not after every attempt",
    )
    row = OutboxMessage.objects.get(message_id=big)
    assert row.attempts == 1
    assert "max_message_size is 16777216" in row.last_error
    assert "MAX_BODY_BYTES" in row.last_error
    assert [m.message_id for m in broker.drain(queue, expected=1)] == [after]
    # The process heard the limit: publish() refuses such a payload from now on.
    with pytest.raises(ValueError, match="max_message_size \\(16777216\\)"):
        publish("limits.big", "x" * (17 * MIB))
    publish("limits.small", "x" * MIB)


def test_check_deploy_compares_max_body_bytes_with_the_brokers_limit(
    ob: OutboxEnv, broker: Broker
) -> None:
    ob.set(BROKER_URL=broker.url, MAX_BODY_BYTES=20 * MIB)
    found = check_broker_max_message_size()
    if broker.url == SYSTEM_URL:
        assert found == []
    else:
        assert [m.id for m in found] == ["reliable_messaging.E050"]
        assert "16,777,216 bytes" in found[0].msg and "16777216 or less" in str(found[0].hint)
    ob.set(MAX_BODY_BYTES=MIB)
    assert check_broker_max_message_size() == []


def test_check_deploy_warns_when_the_broker_cannot_be_asked(ob: OutboxEnv) -> None:
    ob.set(BROKER_URL="amqp://guest:guest@127.0.0.1:1/%2F")
    found: list[Any] = check_broker_max_message_size()
    assert [m.id for m in found] == ["reliable_messaging.W050"]


def _accepted(routing_key: str, payload: str) -> str | None:
    """The message id of ``payload`` if ``publish()`` takes it, None while it refuses it."""
    try:
        return publish(routing_key, payload)
    except ValueError:
        return None


@pytest.mark.skipif(
    support.BROKER.name not in NODES,
    reason="sets max_message_size inside the node: the 4.x nodes' serial lane only",
)
@pytest.mark.parametrize("broker", [support.BROKER.name], indirect=True)
def test_a_limit_the_operator_raises_is_taken_without_a_restart(
    ob: OutboxEnv, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal teaches the process the limit; once the operator raises it, ``publish()`` and
    the relay take the larger body again: after ``LEARNED_FOR`` (shortened here), or at once
    when the broker takes a probe of that size. A 4.x node reads ``max_message_size`` from a
    persistent term on every publish: putting it there is what a restart with a new
    rabbitmq.conf would do, without the restart."""
    node = NODES[support.BROKER.name]

    def set_limit(size: int | str) -> None:
        node.ctl("eval", f"persistent_term:put(max_message_size, {size}).")

    original = node.ctl("eval", "persistent_term:get(max_message_size).").strip()
    assert original.isdigit(), original
    monkeypatch.setattr(limits, "LEARNED_FOR", 3.0, raising=False)
    ob.set(BROKER_URL=broker.url, MAX_BODY_BYTES=8 * MIB)
    queue = ob.queue()
    body = "x" * (2 * MIB)
    try:
        set_limit(MIB)
        with transaction.atomic():
            refused = publish("limits.big", body)
        ob.relay_thread()
        wait_until(
            lambda: OutboxMessage.objects.get(message_id=refused).status == OutboxStatus.FAILED,
            timeout=30,
            message="the row over the lowered limit failed at once",
        )
        assert (
            "max_message_size is 1048576"
            in OutboxMessage.objects.get(message_id=refused).last_error
        )
        with pytest.raises(ValueError, match="max_message_size \\(1048576\\)"):
            publish("limits.big", body)

        set_limit(4 * MIB)  # the operator raises it
        taken = wait_until(
            lambda: _accepted("limits.big", body),
            timeout=limits.LEARNED_FOR + 10,
            message="publish() takes the body once the learned limit is forgotten",
        )
        wait_until(
            lambda: OutboxMessage.objects.get(message_id=taken).status == OutboxStatus.SENT,
            timeout=30,
            message="the relay sent the body under the raised limit",
        )
        assert [m.message_id for m in broker.drain(queue, expected=1)] == [taken]

        # Learned again from a probe's refusal; a probe the raised broker takes forgets it.
        monkeypatch.setattr(limits, "LEARNED_FOR", 3600.0)
        set_limit(MIB)
        assert limits.ask_broker(2 * MIB) == (MIB, None)
        assert _accepted("limits.big", body) is None
        set_limit(4 * MIB)
        assert limits.ask_broker(2 * MIB) == (None, None)
        assert _accepted("limits.big", body) is not None
    finally:
        set_limit(original)
