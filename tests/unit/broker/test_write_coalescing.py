"""write_coalescing: pika's buffered frames joined into fewer writes, the same bytes in order.

Pure logic against a stand-in transport (a deque of buffers, as pika keeps it). That it engages
on pika's real transport, and that the broker gets every message intact, is
tests/integration/broker/test_write_coalescing.py.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

from reliable_messaging.broker.write_coalescing import CHUNK_BYTES, coalesce_writes


def connection_with(*buffers: Any) -> SimpleNamespace:
    return SimpleNamespace(_transport=SimpleNamespace(_tx_buffers=collections.deque(buffers)))


def test_small_frames_become_one_write_with_the_same_bytes_in_order() -> None:
    frames = [bytes([i % 256]) * (10 + i) for i in range(1500)]
    connection = connection_with(*frames)
    assert coalesce_writes(connection) == 1500
    buffers = connection._transport._tx_buffers
    assert b"".join(buffers) == b"".join(frames)
    assert len(buffers) == -(-sum(map(len, frames)) // CHUNK_BYTES)  # a handful, not 1,500
    assert all(len(b) <= CHUNK_BYTES for b in buffers)


def test_a_buffer_larger_than_a_chunk_stays_whole_between_its_neighbours() -> None:
    big = b"B" * (CHUNK_BYTES * 3)
    before = [b"a" * 100, b"b" * 100]
    after = [b"c" * 100, b"d" * 100]
    connection = connection_with(*before, big, *after)
    coalesce_writes(connection)
    buffers = list(connection._transport._tx_buffers)
    assert buffers == [b"a" * 100 + b"b" * 100, big, b"c" * 100 + b"d" * 100]


def test_chunks_fill_up_to_the_limit_and_no_further() -> None:
    piece = b"x" * (CHUNK_BYTES // 4)
    connection = connection_with(*[piece] * 9)
    coalesce_writes(connection)
    assert [len(b) for b in connection._transport._tx_buffers] == [
        CHUNK_BYTES,
        CHUNK_BYTES,
        len(piece),
    ]


def test_nothing_changes_where_there_is_nothing_to_join_or_the_transport_is_unknown() -> None:
    assert coalesce_writes(connection_with(b"only")) == 0
    assert coalesce_writes(connection_with()) == 0
    assert coalesce_writes(SimpleNamespace(_transport=None)) == 0
    assert coalesce_writes(SimpleNamespace()) == 0
    assert (
        coalesce_writes(SimpleNamespace(_transport=SimpleNamespace(_tx_buffers=[b"a", b"b"]))) == 0
    )
    assert coalesce_writes(None) == 0
    # A buffer of a kind this does not know (a memoryview, say): left to pika as it is.
    odd = connection_with(b"a", memoryview(b"b"))
    assert coalesce_writes(odd) == 0
    assert len(odd._transport._tx_buffers) == 2
