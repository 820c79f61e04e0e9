"""UUIDv7 message ids: RFC 9562 layout, time order, monotonic within a process."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

import pytest

from reliable_messaging.core import uuid7 as uuid7_module
from reliable_messaging.core.uuid7 import new_message_id, uuid7

CANONICAL = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def timestamp_ms(value: uuid.UUID) -> int:
    return value.int >> 80


def random_bits(value: uuid.UUID) -> int:
    """The 74 bits below the version and the variant."""
    rand_a = (value.int >> 64) & 0xFFF
    rand_b = value.int & ((1 << 62) - 1)
    return (rand_a << 62) | rand_b


def test_layout_is_rfc_9562_version_7() -> None:
    before = time.time_ns() // 1_000_000
    value = uuid7()
    after = time.time_ns() // 1_000_000
    assert value.version == 7
    assert value.variant == uuid.RFC_4122
    assert before <= timestamp_ms(value) <= after
    text = new_message_id()
    assert CANONICAL.match(text), text
    assert str(uuid.UUID(text)) == text  # the canonical 36-character form


def test_ids_sort_by_time_as_text_and_as_uuid() -> None:
    ids = [new_message_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)  # many share a millisecond: those count up
    assert [uuid.UUID(i) for i in ids] == sorted(uuid.UUID(i) for i in ids)


def test_first_id_of_a_millisecond_has_74_fresh_random_bits() -> None:
    base = (time.time_ns() // 1_000_000 + 10_000) * 1_000_000
    firsts = [random_bits(uuid7(base + n * 1_000_000)) for n in range(200)]
    assert len(set(firsts)) == 200
    # Every one of the 74 bits is set in some id and clear in another: none is fixed.
    ored = 0
    anded = (1 << 74) - 1
    for bits in firsts:
        ored |= bits
        anded &= bits
    assert ored == (1 << 74) - 1
    assert anded == 0


def test_same_millisecond_counts_up_and_a_clock_step_back_keeps_order() -> None:
    now = (time.time_ns() // 1_000_000 + 20_000) * 1_000_000
    first = uuid7(now)
    second = uuid7(now)  # same millisecond
    assert timestamp_ms(second) == timestamp_ms(first)
    assert random_bits(second) == random_bits(first) + 1
    stepped_back = uuid7(now - 5_000 * 1_000_000)  # NTP stepped the clock back 5 s
    assert stepped_back > second
    assert timestamp_ms(stepped_back) == timestamp_ms(first)
    later = uuid7(now + 1_000_000)
    assert later > stepped_back
    assert timestamp_ms(later) == timestamp_ms(first) + 1


def test_counter_overflow_borrows_the_next_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    now_ms = time.time_ns() // 1_000_000 + 30_000
    first = uuid7(now_ms * 1_000_000)
    monkeypatch.setattr(uuid7_module, "_last_random", (1 << 74) - 1)
    after = uuid7(now_ms * 1_000_000)
    assert after > first
    assert timestamp_ms(after) == now_ms + 1


def test_threads_never_mint_the_same_id() -> None:
    minted: list[list[str]] = [[] for _ in range(4)]

    def mint(out: list[str]) -> None:
        out.extend(new_message_id() for _ in range(5_000))

    threads = [threading.Thread(target=mint, args=(out,)) for out in minted]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    every = [i for out in minted for i in out]
    assert len(set(every)) == len(every) == 20_000
    for out in minted:
        assert out == sorted(out)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_continue_its_parents_sequence() -> None:
    uuid7()  # the parent has a sequence going
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id, then leave at once
        try:
            os.write(write, new_message_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    parent_next = new_message_id()
    child_next = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child_next != parent_next
    same_ms = timestamp_ms(uuid.UUID(child_next)) == timestamp_ms(uuid.UUID(parent_next))
    if same_ms:  # not one apart as a shared counter would make them
        assert abs(random_bits(uuid.UUID(child_next)) - random_bits(uuid.UUID(parent_next))) > 1
