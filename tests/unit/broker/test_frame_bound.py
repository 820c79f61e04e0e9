"""The cheap bound publish() checks headers against before encoding them (broker/limits.py)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_messaging.broker.limits import (
    _flat_headers_bound,
    header_frame_refusal,
    header_frame_size,
)
from reliable_messaging.broker.publisher import message_properties


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x-rm-ordering-key": "k"},
        {"n": 2**63 - 1, "m": -(2**63), "small": 7, "f": 1.5, "t": True, "none": None},
        {"é" * 100: "ü" * 5000, "k": "v" * 60_000},
    ],
)
def test_the_bound_is_never_below_the_encoded_size(headers: dict[str, Any]) -> None:
    bound = _flat_headers_bound(headers)
    assert bound is not None
    empty = header_frame_size(message_properties("m", 0, {}))
    assert empty + bound >= header_frame_size(message_properties("m", 0, headers))


@pytest.mark.parametrize("value", [{"nested": 1}, [1, 2], b"raw", 2**63])
def test_what_the_bound_cannot_judge_is_encoded(value: Any) -> None:
    assert _flat_headers_bound({"k": value}) is None


def test_headers_near_the_frame_size_are_still_judged_exactly() -> None:
    assert header_frame_refusal("m", {"big": "a" * 131_000}) is not None
    assert header_frame_refusal("m", {"big": "a" * 120_000}) is None
