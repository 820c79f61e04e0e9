"""The framework's task priorities as AMQP priorities (core/priorities.py)."""

from __future__ import annotations

from reliable_messaging.core.priorities import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    PRIORITY_HEADER,
    amqp_priority,
    priority_of_headers,
)


def test_the_default_is_a_quorum_queues_normal_and_above_it_is_high() -> None:
    assert amqp_priority(0) == DEFAULT_PRIORITY == 4  # what 4.x gives a message without one
    assert all(amqp_priority(p) >= 5 for p in range(1, 101))  # RabbitMQ 4.0's "high"
    assert all(amqp_priority(p) <= 3 for p in range(-100, 0))


def test_each_level_takes_an_equal_share_and_the_order_is_kept() -> None:
    levels = [amqp_priority(p) for p in range(-100, 101)]
    assert levels == sorted(levels)
    assert min(levels) == 0 and max(levels) == MAX_PRIORITY == 9
    counts = {level: levels.count(level) for level in set(levels)}
    assert counts == {0: 25, 1: 25, 2: 25, 3: 25, 4: 1, 5: 20, 6: 20, 7: 20, 8: 20, 9: 20}


def test_only_an_octet_in_the_header_becomes_a_priority() -> None:
    assert priority_of_headers({PRIORITY_HEADER: 9}) == 9
    assert priority_of_headers({PRIORITY_HEADER: 255}) == 255
    for bad in (256, -1, "9", 9.0, True, None, [9]):
        assert priority_of_headers({PRIORITY_HEADER: bad}) is None
    assert priority_of_headers(None) is None and priority_of_headers({}) is None
