"""Time-ordered message ids: UUID version 7 (RFC 9562), increasing within a process, so that
they are inserted at the inbox index's right edge (Python before 3.14 has no ``uuid.uuid7``).
``docs/design.md#time-ordered-message-ids`` explains the layout."""

from __future__ import annotations

import os
import secrets
import threading
import time
import uuid

_RANDOM_BITS = 74
_RANDOM_MASK = (1 << _RANDOM_BITS) - 1
_TIMESTAMP_MASK = (1 << 48) - 1

_lock = threading.Lock()
_last_ms = -1
_last_random = 0


def _reset_after_fork() -> None:
    # A child continuing its parent's sequence would mint the ids the parent mints next.
    global _last_ms, _last_random
    _last_ms, _last_random = -1, 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _next(now_ms: int) -> tuple[int, int]:
    """The (timestamp, 74 bits) of the next id, strictly after the previous one."""
    global _last_ms, _last_random
    with _lock:
        if now_ms > _last_ms:
            _last_ms, _last_random = now_ms, secrets.randbits(_RANDOM_BITS)
        else:
            # Same millisecond, or the clock went back: count up from the last id.
            _last_random += 1
            if _last_random > _RANDOM_MASK:  # 2**74 ids in one millisecond: borrow the next
                _last_ms, _last_random = _last_ms + 1, secrets.randbits(_RANDOM_BITS)
        return _last_ms, _last_random


def uuid7(now_ns: int | None = None) -> uuid.UUID:
    """A new version 7 UUID; ``now_ns`` (nanoseconds since the epoch) is for tests."""
    now_ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    timestamp, random = _next(now_ms)
    value = (timestamp & _TIMESTAMP_MASK) << 80
    value |= 0x7 << 76  # version
    value |= (random >> 62) << 64  # rand_a: 12 bits
    value |= 0b10 << 62  # variant (RFC 9562)
    value |= random & ((1 << 62) - 1)  # rand_b: 62 bits
    return uuid.UUID(int=value)


def new_message_id() -> str:
    """A message id minted by the app: a UUIDv7 in the canonical 36-character form."""
    return str(uuid7())
