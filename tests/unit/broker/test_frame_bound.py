"""publish()'s check of a message's header frame against frame_max (broker/limits.py)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_messaging.broker import limits
from reliable_messaging.broker.limits import header_frame_refusal, header_frame_size
from reliable_messaging.broker.publisher import message_properties


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x-rm-ordering-key": "k"},
        {"n": 2**63 - 1, "m": -(2**63), "small": 7, "f": 1.5, "t": True, "none": None},
        {"é" * 100: "ü" * 5000, "k": "v" * 60_000},
        {"nested": {"a": [1, "b"]}, "raw": b"raw", "x-rm-priority": 3},
    ],
)
def test_the_judged_frame_is_the_one_pika_writes(
    headers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    judged: list[int] = []
    monkeypatch.setattr(limits, "frame_size_refusal", lambda size, _max: judged.append(size))
    header_frame_refusal("m", headers)
    expected = header_frame_size(message_properties("m", 0, dict(headers)))
    assert judged == [expected + limits.RELAY_HEADERS_ROOM]


def test_headers_near_the_frame_size_are_still_judged_exactly() -> None:
    assert header_frame_refusal("m", {"big": "a" * 131_000}) is not None
    assert header_frame_refusal("m", {"big": "a" * 120_000}) is None
