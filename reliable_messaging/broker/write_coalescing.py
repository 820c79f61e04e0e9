"""Fewer, larger socket writes for a burst of publishes on pika's asynchronous connection.

pika hands every frame of a message (method, content header, body) to its transport as a buffer
of its own, and the transport's writer sends one buffer per ``send()``: a batch of 500 messages
is 1,500 system calls and as many small TCP segments for the broker to read. Profiled, those
calls were a fifth of the relay's I/O thread. Joining what is buffered into chunks of up to
``CHUNK_BYTES`` before the I/O loop gets to write sends the same bytes, in the same order, in a
few calls.

This reads two attributes pika does not promise (``connection._transport`` and its
``_tx_buffers`` deque, the same in pika 1.3 and 1.4). Where either is missing or not what it
was, :func:`coalesce_writes` does nothing and pika writes as it always did: a pika upgrade can
lose the speed, never a byte. ``tests/unit/broker/test_write_coalescing.py`` pins that it engages on
the pika this project installs.

Call it only on the connection's own I/O thread, as pika's writes are made.
"""

from __future__ import annotations

import collections
from typing import Any

# Large enough that a batch of small messages goes in a handful of writes; small enough that
# joining never copies much (a message body at or above it stays a buffer of its own).
CHUNK_BYTES = 256 * 1024


def coalesce_writes(connection: Any) -> int:
    """Join the buffers waiting on ``connection``'s transport into chunks of at most
    ``CHUNK_BYTES`` (a single larger buffer stays whole). Returns how many buffers there were
    before, or 0 when there was nothing to join or the transport is not one this knows."""
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
