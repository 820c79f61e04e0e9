"""Fewer, larger socket writes for a burst of publishes on pika's asynchronous connection: the
buffers pika would ``send()`` one by one, joined (same bytes, same order). Reads pika internals
(``_transport._tx_buffers``); call it on the connection's I/O thread. See docs/benchmarks.md.
"""

from __future__ import annotations

import collections
from typing import Any

# Large enough that a batch of small messages goes in a handful of writes; small enough that
# joining never copies much (a message body at or above it stays a buffer of its own).
CHUNK_BYTES = 256 * 1024


def coalesce_writes(connection: Any) -> int:
    """Join the buffers waiting on ``connection``'s transport into chunks of at most
    ``CHUNK_BYTES`` (a larger buffer stays whole); how many there were, or 0 when nothing was
    joined."""
    buffers = getattr(getattr(connection, "_transport", None), "_tx_buffers", None)
    if not isinstance(buffers, collections.deque) or len(buffers) < 2:
        return 0
    if not all(isinstance(buffer, bytes) for buffer in buffers):
        return 0
    before = len(buffers)
    chunks: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for buffer in buffers:
        if pending and size + len(buffer) > CHUNK_BYTES:
            chunks.append(b"".join(pending))
            pending, size = [], 0
        pending.append(buffer)
        size += len(buffer)
    chunks.append(b"".join(pending))
    # The byte count pika keeps beside the deque is unchanged: the same bytes, fewer pieces.
    buffers.clear()
    buffers.extend(chunks)
    return before
