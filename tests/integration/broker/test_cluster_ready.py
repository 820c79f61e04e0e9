"""What a cluster asks of one consumer, tried against the one broker of the suite: several broker
URLs, a retry copy whose queue is gone, an inbox row another transaction holds, and
keepalives on the database connections. The faults of a real 3-node cluster (a queue whose
node is down among them) are in ``tests/cluster``.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
import urllib.request
from typing import Any
from unittest import mock

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from reliable_messaging.broker.queues import broker_connection_error, broker_status
from reliable_messaging.management.long_running import KEEPALIVE_OPTIONS, keep_database_alive
from reliable_messaging.models import OutboxMessage, ProcessedMessage
from reliable_messaging.storage import inbox
from tests import support
from tests.integration.consuming.test_consumer_service import (  # noqa: F401 - fixtures
    Recorder,
    effects,
    exchange_of,
    make_spec,
    rec,
)
from tests.support import Publisher, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

GOOD = support.BROKER.url
# Nothing listens on port 1: a node that is down.
DEAD = "amqp://guest:s3cret-dead@127.0.0.1:1/%2F"


def _queue_info(name: str) -> dict[str, Any]:
    return dict(support.management("GET", f"/queues/%2F/{urllib.parse.quote(name, safe='')}"))


# --------------------------------------------------------------------------- several broker URLs


@pytest.mark.parametrize("form", ["list", "semicolons"])
def test_a_node_that_is_down_is_skipped_by_consume_status_and_health(
    form: str,
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
    publisher: Publisher,
) -> None:
    urls: Any = [DEAD, GOOD] if form == "list" else f"{DEAD} ; {GOOD}"
    alpha = make_spec("alpha")
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "BROKER_URL": urls}):
        # Shuffled on every connect: over several starts the dead node comes first too.
        for _ in range(3):
            assert broker_connection_error(timeout=2) == ""
        found = broker_status([alpha], timeout=2)
        assert found.reachable
        assert found.management_api  # asked of the node that answered
        assert "s3cret-dead" not in found.url
        assert found.url.count("***") == 2
        service([alpha], on_outcome=rec)
    publisher.publish(exchange_of(ns), "order.placed", {"n": 1}, message_id="multi-1")
    rec.wait_count(alpha.name, 1)
    assert effects("alpha") == [("multi-1", 1)]


def test_with_every_node_down_the_error_names_no_password(rm_settings: dict[str, Any]) -> None:
    urls = [DEAD, DEAD.replace(":1/", ":2/")]
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "BROKER_URL": urls}):
        error = broker_connection_error(timeout=2)
        status = broker_status([], timeout=2)
    assert error
    assert not status.reachable
    assert "s3cret" not in error + str(status.error) + status.url


# --------------------------------------------------------------------------- a retry's queue gone


def test_a_retry_copy_due_while_its_queue_is_gone_is_kept_until_the_queue_is_back(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
    publisher: Publisher,
) -> None:
    """The retry copy comes due while the consumer's queue is deleted (as when it is on a node
    that is down, or the broker is stopping): the broker returns it, and the outbox keeps it,
    sent again with backoff until consume has declared the queue again. No broker setting."""
    alpha = make_spec("alpha")
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "RETRY_DELAYS": [1.0]}):
        first = service([alpha], on_outcome=rec)
        publisher.publish(exchange_of(ns), "order.placed", {"fail": {"alpha": 1}}, message_id="k1")
        rec.wait_count(alpha.name, 1)
        assert rec.results(alpha.name) == ["retry"]
        first.request_stop()
        wait_until(
            lambda: (
                not any(t.name == "rm-test-service" and t.is_alive() for t in threading.enumerate())
            ),
            timeout=30,
            message="the consumer stopped",
        )
        admin = support.broker_connection()
        try:
            admin.channel().queue_delete(alpha.queue)
        finally:
            admin.close()
        # The copy comes due with no queue to take it: returned, charged, kept.
        wait_until(
            lambda: OutboxMessage.objects.filter(message_id="k1", attempts__gt=0).exists(),
            timeout=30,
            message="the copy returned while its queue was gone",
        )
        (copy,) = OutboxMessage.objects.filter(message_id="k1")
        assert copy.status == "pending" and "does not exist now" in copy.last_error
        service([alpha], on_outcome=rec)  # declares the queue again
        rec.wait_count(alpha.name, 2, timeout=60)
    assert rec.results(alpha.name) == ["retry", "processed"]
    assert effects("alpha") == [("k1", 2)]


# --------------------------------------------------------------------------- inbox lock wait


def _hold_inbox_row(consumer: str, message_id: str) -> psycopg.Connection[Any]:
    """A connection of its own holding the inbox row of (consumer, message_id) in a
    transaction it neither commits nor rolls back until the test says so."""
    params = connection.get_connection_params()
    blocker = psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"})
    blocker.execute(
        "INSERT INTO reliable_messaging_processedmessage (consumer, message_id, processed_at) "
        "VALUES (%s, %s, now())",
        [consumer, message_id],
    )
    return blocker


def test_an_inbox_row_held_by_a_transaction_that_does_not_end_defers_instead_of_stalling(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
    publisher: Publisher,
) -> None:
    alpha = make_spec("alpha")
    # Another consumer cut off mid-batch: its inbox row inserted, its transaction left open.
    blocker = _hold_inbox_row(alpha.name, "held-1")
    try:
        with mock.patch.object(inbox, "LOCK_TIMEOUT", 0.5):
            service([alpha], on_outcome=rec)
            publisher.publish(exchange_of(ns), "order.placed", {}, message_id="held-1")
            for n in range(3):
                publisher.publish(exchange_of(ns), "order.placed", {}, message_id=f"free-{n}")
            started = time.monotonic()
            wait_until(
                lambda: len([r for r in rec.results(alpha.name) if r == "processed"]) == 3,
                timeout=20,
                message="the other messages handled while the row is held",
            )
            # Deferred (a retry copy at the same attempt), again and again while held.
            wait_until(lambda: rec.results(alpha.name).count("retry") >= 2, timeout=20)
            assert time.monotonic() - started < 15
            # The other consumer's transaction ends without committing (the server dropped
            # it): the next copy takes effect, once.
            blocker.rollback()
            wait_until(
                lambda: ("held-1", 1) in effects("alpha"), timeout=20, message="held-1 handled"
            )
    finally:
        blocker.close()
    assert sorted(effects("alpha")) == [("free-0", 1), ("free-1", 1), ("free-2", 1), ("held-1", 1)]
    assert ProcessedMessage.objects.filter(consumer=alpha.name).count() == 4


def test_a_twin_that_commits_within_the_bound_is_a_duplicate_not_a_deferral(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
    publisher: Publisher,
) -> None:
    alpha = make_spec("alpha")
    blocker = _hold_inbox_row(alpha.name, "twin-1")
    try:
        service([alpha], on_outcome=rec)
        publisher.publish(exchange_of(ns), "order.placed", {}, message_id="twin-1")
        threading.Timer(0.3, blocker.commit).start()
        rec.wait_count(alpha.name, 1)
    finally:
        time.sleep(0.4)
        blocker.close()
    assert rec.results(alpha.name) == ["duplicate"]
    assert effects("alpha") == []


# --------------------------------------------------------------------------- keepalives


def test_consume_and_relay_connections_carry_tcp_keepalives() -> None:
    connection.close()
    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    options["keepalives_idle"] = 7  # the project's own value wins
    try:
        assert "default" in keep_database_alive()
        connection.ensure_connection()
        dsn = connection.connection.info.dsn
        assert "keepalives_idle=7" in dsn
        assert f"keepalives_count={KEEPALIVE_OPTIONS['keepalives_count']}" in dsn
        assert "tcp_user_timeout=60000" in dsn
    finally:
        connection.close()
        options.clear()
        options.update(saved)
