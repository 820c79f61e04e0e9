"""What the suite's ``async def`` handler does (issue 47): consumers.py registers it as
``tests.async`` (``<ns>.async``, bound to ``async.*``, a time limit of 1 s) in a process with
``RM_TEST_ASYNC_CONSUMERS`` set; in-process tests register it themselves.

The handler writes an ``Effect`` of consumer ``async-sync`` through
``sync_to_async(thread_sensitive=True)`` and one of ``async-orm`` through the async ORM, whose
payload says what the async ORM saw inside the delivery's transaction: the inbox row of the
message and the ``async-sync`` row (neither committed yet), the database session's
``pg_backend_pid()`` and the thread the sync part ran on. Then, per the payload:
``{"fail": 2}`` fails the first two attempts, ``{"sleep": {"1": 30}}`` awaits
``asyncio.sleep(30)`` on attempt 1, ``{"pause": 0.3}`` awaits that long before the writes.
Every attempt also ``apublish()``-es ``async-done.<message_id>`` (message_id
``<message_id>.done``), which commits or rolls back with the rest.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connection

from reliable_messaging import Message, apublish
from reliable_messaging.models import ProcessedMessage

from .models import Effect

ASYNC_CONSUMER = "tests.async"


def write_in_sync_code(message: Message) -> dict[str, Any]:
    """The sync part: a write, and where it ran (session, transaction, thread)."""
    Effect.objects.create(
        consumer="async-sync", message_id=message.message_id, attempt=message.attempt
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    return {
        "pid": pid,
        "in_atomic_block": connection.in_atomic_block,
        "thread": threading.current_thread().name,
    }


async def handle(message: Message, consumer_name: str = ASYNC_CONSUMER) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    await asyncio.sleep(float(payload.get("pause", 0)))
    seen = await sync_to_async(write_in_sync_code, thread_sensitive=True)(message)
    seen["saw_inbox_row"] = await ProcessedMessage.objects.filter(
        consumer=consumer_name, message_id=message.message_id
    ).aexists()
    seen["saw_sync_row"] = await Effect.objects.filter(
        consumer="async-sync", message_id=message.message_id, attempt=message.attempt
    ).aexists()
    await Effect.objects.acreate(
        consumer="async-orm", message_id=message.message_id, attempt=message.attempt, payload=seen
    )
    await apublish(
        f"async-done.{message.message_id}",
        {"after": message.message_id},
        message_id=f"{message.message_id}.done",
    )
    sleep = payload.get("sleep", {}).get(str(message.attempt))
    if sleep:
        await asyncio.sleep(float(sleep))
    if message.attempt <= int(payload.get("fail", 0)):
        raise RuntimeError(f"async: transient failure on attempt {message.attempt}")
