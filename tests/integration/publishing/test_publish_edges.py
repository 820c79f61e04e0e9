"""``publish()`` at the edges: the alias it writes to under database routers, the body size it
refuses, and whose clock its row's times come from."""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.core.envelope import encode_payload
from reliable_messaging.models import OutboxMessage

from .test_publish import committed_rows

LIMIT = 64 * 1024  # MAX_BODY_BYTES in tests/settings.py


class OutboxToOther:
    """Sends every model of the app to the alias ``other``."""

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "reliable_messaging" else None

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "reliable_messaging" else None


class OutboxToDefault(OutboxToOther):
    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "default"

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "default"


@pytest.fixture
def other_alias(transactional_db: None) -> Iterator[str]:
    """A second alias, ``other``: its own connection to the test database.

    Django's test case forbids aliases of ``DATABASES`` it was not told about, and allows
    connections created on the fly: this one is such, set on ``connections`` and not in its
    settings. The rows it commits are flushed with the test database's.
    """
    default = connections["default"]
    connections["other"] = type(default)(copy.deepcopy(default.settings_dict), alias="other")
    try:
        yield "other"
    finally:
        connections["other"].close()
        del connections["other"]


# --------------------------------------------------------------------------- the alias


def test_publish_writes_where_the_routers_send_the_outbox(other_alias: str, settings: Any) -> None:
    settings.DATABASE_ROUTERS = [f"{__name__}.OutboxToOther"]
    with transaction.atomic(using="other"):
        message_id = publish("order.placed", {"n": 1})
        # In the transaction of ``other``, where the relay reads: not committed on its own, and
        # not on the default connection (which has no transaction open here).
        assert connections["other"].in_atomic_block
        assert OutboxMessage.objects.using("other").filter(message_id=message_id).exists()
        assert committed_rows(message_id) == 0
    assert committed_rows(message_id) == 1


def test_rollback_on_the_routed_alias_discards_the_message(other_alias: str, settings: Any) -> None:
    settings.DATABASE_ROUTERS = [f"{__name__}.OutboxToOther"]
    with pytest.raises(RuntimeError), transaction.atomic(using="other"):
        message_id = publish("order.placed", {"n": 1})
        raise RuntimeError("business rule says no")
    assert committed_rows(message_id) == 0


def test_an_explicit_using_still_wins_over_the_routers(other_alias: str, settings: Any) -> None:
    settings.DATABASE_ROUTERS = [f"{__name__}.OutboxToOther"]
    with transaction.atomic(using="default"):
        message_id = publish("order.placed", {"n": 1}, using="default")
        assert committed_rows(message_id) == 0  # in default's transaction, as asked
    assert committed_rows(message_id) == 1


@pytest.mark.django_db
def test_a_router_naming_default_keeps_default(settings: Any) -> None:
    settings.DATABASE_ROUTERS = [f"{__name__}.OutboxToDefault"]
    message_id = publish("order.placed", {"n": 1})
    assert OutboxMessage.objects.using("default").filter(message_id=message_id).exists()


# --------------------------------------------------------------------------- body size


@pytest.mark.django_db
def test_a_body_over_max_body_bytes_is_refused_at_the_call() -> None:
    at_limit = "x" * (LIMIT - 2)  # a JSON string: two quotes around it
    assert len(encode_payload(at_limit)) == LIMIT
    accepted = publish("order.placed", at_limit)
    assert OutboxMessage.objects.filter(message_id=accepted).exists()

    with pytest.raises(ValueError, match=r"MAX_BODY_BYTES.*65536") as refused:
        publish("order.placed", at_limit + "x", message_id="too-large")
    assert str(LIMIT + 1) in str(refused.value)
    # Counted in bytes of UTF-8, as the consumer counts them, not in characters.
    with pytest.raises(ValueError, match="MAX_BODY_BYTES"):
        publish("order.placed", "é" * (LIMIT // 2), message_id="too-large-in-bytes")
    assert not OutboxMessage.objects.filter(message_id__startswith="too-large").exists()


# --------------------------------------------------------------------------- clock


@pytest.fixture
def clock_an_hour_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host's clock, as Django reads it (``timezone.now()``), one hour ahead of the
    database's: the skew of a publisher on another host."""

    class Ahead(dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return dt.datetime.now(tz) + dt.timedelta(hours=1)

    monkeypatch.setattr(timezone, "datetime", Ahead)
    assert timezone.now() - dt.datetime.now(dt.UTC) > dt.timedelta(minutes=59)


def database_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        row = cursor.fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clock_an_hour_ahead")
def test_the_row_carries_the_database_clock_not_the_publishers() -> None:
    message_id = publish("order.placed", {"n": 1})
    keyed = publish("order.placed", {"n": 2}, idempotency_key="order-2")
    assert publish("order.placed", {"n": 2}, idempotency_key="order-2") == keyed
    now = database_now()
    for row in OutboxMessage.objects.filter(message_id__in=[message_id, keyed]):
        assert abs(row.next_attempt_at - now) < dt.timedelta(seconds=1), row.next_attempt_at
        assert abs(row.created_at - now) < dt.timedelta(seconds=1), row.created_at
    # Due at once by the database's clock: the relay's query finds it.
    assert OutboxMessage.objects.filter(message_id=message_id, next_attempt_at__lte=now).exists()
