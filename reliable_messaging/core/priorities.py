"""Message priorities: a task's priority (-100 to 100, default 0) as an AMQP ``priority``
(0 to :data:`MAX_PRIORITY`, 0 mapping to 4) and the header the outbox keeps it in
(``docs/tasks.md#priorities``)."""

from __future__ import annotations

import math
from typing import Any

from .envelope import PRIORITY_HEADER

# The highest AMQP priority we send: a classic queue of tasks is declared with this
# x-max-priority (10 levels, RabbitMQ's advice for classic priority queues).
MAX_PRIORITY = 9
# What the framework's default priority 0 becomes.
DEFAULT_PRIORITY = 4
LOWEST, HIGHEST = -100, 100
# AMQP's priority property is an octet.
_OCTET = 255


def amqp_priority(priority: int) -> int:
    """``priority`` (-100 to 100) as an AMQP priority: 0 is 4; 1 to 100 are 5 to 9 (20 each);
    -100 to -1 are 0 to 3 (25 each)."""
    if priority > 0:
        return DEFAULT_PRIORITY + math.ceil(
            min(priority, HIGHEST) * (MAX_PRIORITY - DEFAULT_PRIORITY) / HIGHEST
        )
    if priority < 0:
        return DEFAULT_PRIORITY - math.ceil(max(priority, LOWEST) * DEFAULT_PRIORITY / LOWEST)
    return DEFAULT_PRIORITY


def priority_of_headers(headers: Any) -> int | None:
    """The AMQP priority a message's headers ask for, or None (no header, or a value the
    priority property cannot carry: a header is not ours to trust)."""
    value = headers.get(PRIORITY_HEADER) if isinstance(headers, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _OCTET:
        return None
    return value
