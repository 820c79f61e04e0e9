"""Acks of a settled batch are coalesced into one ``multiple`` ack where that cannot cover a
delivery still being handled, held for a retry in place, or meant to be nacked."""

from __future__ import annotations

from typing import Any, cast

from reliable_messaging.broker.transport import BrokerChannel
from reliable_messaging.consuming.board import Link
from reliable_messaging.consuming.settling import ack_coalesced


class RecordingChannel:
    channel_number = 7

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def basic_ack(self, delivery_tag: int, multiple: bool = False) -> None:
        self.calls.append((delivery_tag, multiple))


def link_with(unsettled: list[int]) -> Link:
    link = Link(connection=cast(Any, None))
    link.unsettled[RecordingChannel.channel_number] = dict.fromkeys(unsettled)
    return link


def ack(link: Link, tags: set[int]) -> list[tuple[int, bool]]:
    channel = RecordingChannel()
    ack_coalesced(link, cast(BrokerChannel, channel), set(tags))
    return channel.calls


def test_a_whole_batch_of_the_oldest_deliveries_is_one_multiple_ack() -> None:
    link = link_with([1, 2, 3, 4, 5])
    assert ack(link, {1, 2, 3, 4, 5}) == [(5, True)]
    assert link.unsettled[7] == {}


def test_the_run_stops_at_a_delivery_still_unsettled() -> None:
    # 3 is still running on another worker (or held for a retry in place): never covered.
    link = link_with([1, 2, 3, 4, 5, 6])
    assert ack(link, {1, 2, 4, 6}) == [(2, True), (4, False), (6, False)]
    assert list(link.unsettled[7]) == [3, 5]
    # When 3 and 5 settle later, the rest is the oldest run again.
    assert ack(link, {3, 5}) == [(5, True)]
    assert link.unsettled[7] == {}


def test_a_batch_behind_an_older_one_is_acked_one_by_one() -> None:
    link = link_with([10, 11, 20, 21])
    assert ack(link, {20, 21}) == [(20, False), (21, False)]
    assert ack(link, {10, 11}) == [(11, True)]


def test_a_nacked_delivery_forgotten_first_lets_the_run_pass_it() -> None:
    link = link_with([1, 2, 3])
    channel = RecordingChannel()
    link.forget(cast(BrokerChannel, channel), 2)  # settled otherwise (nack, retry copy)
    assert ack(link, {1, 3}) == [(3, True)]
