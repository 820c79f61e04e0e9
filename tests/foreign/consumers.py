"""A consumer that records what a handler sees of a foreign producer's message.

Each handled message becomes an :class:`~tests.testapp.models.Effect` whose payload holds the
message's payload and, per header, the type name and ``repr`` of the value the handler got: a
double must arrive as the exact ``float``, a timestamp as a ``datetime``. A payload with
``"permanent": true`` raises :class:`PermanentError`, so the message (and its headers) ends as
a dead letter instead; ``"fail_attempts": n`` fails the first n attempts, so the message comes
back as retry copies (its headers published again by the consumer, n times).
"""

from __future__ import annotations

import os

from reliable_messaging import Message, PermanentError, consumer
from tests.testapp.models import Effect

NAMESPACE = os.environ["RM_TEST_NAMESPACE"]


@consumer(f"{NAMESPACE}.foreign", bindings=["foreign.*"], name="tests.foreign")
def record_what_arrived(message: Message) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    if payload.get("permanent"):
        raise PermanentError("the test asked for a dead letter")
    if message.attempt <= payload.get("fail_attempts", 0):
        raise RuntimeError("the test asked for a retry")
    Effect.objects.create(
        consumer="foreign",
        message_id=message.message_id,
        attempt=message.attempt,
        payload={
            "payload": message.payload,
            "headers": {k: [type(v).__name__, repr(v)] for k, v in message.headers.items()},
        },
    )
