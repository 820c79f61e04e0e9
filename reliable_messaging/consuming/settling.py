"""Carrying out the workers' outcomes on the broker, on the connection's thread: acks coalesced
(a retry's too: its copy is an outbox row committed with its decision), releases nacked."""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable

from .. import metrics
from ..broker.transport import BrokerChannel
from ..core.envelope import Delivery
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel, Release, ScheduleRetry, label_of
from ..core.registry import ConsumerSpec
from .board import DeliveryWork, Link

logger = logging.getLogger(__name__)


class OutcomeSettler:
    """Acks and nacks for the outcomes the workers hand back; counts them."""

    def __init__(
        self, on_outcome: Callable[[ConsumerSpec, Delivery, Outcome], None] | None = None
    ) -> None:
        self.on_outcome = on_outcome
        self._counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        """Outcomes handed back so far, by label (processed, duplicate, retried, released...)."""
        with self._counts_lock:
            return dict(self._counts)

    def hand_back(self, settled: list[tuple[DeliveryWork, Outcome]]) -> None:
        """Have ``settled`` carried out on the connection's thread of each delivery's link."""
        # One callback per link: after a reconnect a batch may span the old and the new one.
        by_link: dict[int, list[tuple[DeliveryWork, Outcome]]] = {}
        for item, outcome in settled:
            by_link.setdefault(id(item.link), []).append((item, outcome))
            with self._counts_lock:
                self._counts[label_of(outcome)] += 1
            if isinstance(outcome, Release):
                metrics.consumer_outcome(item.spec.name, OutcomeLabel.RELEASED)
        for pairs in by_link.values():
            link = pairs[0][0].link
            try:
                link.connection.add_callback_threadsafe(functools.partial(self.settle_all, pairs))
            except Exception:  # noqa: BLE001 - the connection is gone: the broker redelivers
                with link.lock:
                    link.in_flight -= len(pairs)
                logger.warning(
                    "connection closed before the outcomes of %d deliveries (message_id=%s%s) "
                    "could be settled; the broker will redeliver them",
                    len(pairs),
                    pairs[0][0].delivery.message_id,
                    ", ..." if len(pairs) > 1 else "",
                )

    def settle_all(self, settled: list[tuple[DeliveryWork, Outcome]]) -> None:
        """Carry out the outcomes of a batch: nacks first, so a coalesced multiple ack never
        covers a delivery meant otherwise."""
        acks: dict[int, tuple[Link, BrokerChannel, set[int]]] = {}
        done: list[tuple[DeliveryWork, Outcome]] = []
        for item, outcome in settled:
            if not _settleable(item, outcome):
                continue
            done.append((item, outcome))
            if isinstance(outcome, Acknowledge | ScheduleRetry):
                _, _, tags = acks.setdefault(id(item.channel), (item.link, item.channel, set()))
                tags.add(item.delivery.delivery_tag)
            elif item.link.held_for_the_drop(item.channel):
                # Dropping the connection gives it back in place (ordered stop): not nacked.
                pass
            else:
                item.channel.basic_nack(item.delivery.delivery_tag, requeue=True)
                item.link.forget(item.channel, item.delivery.delivery_tag)
        for link, channel, tags in acks.values():
            ack_coalesced(link, channel, tags)
        if self.on_outcome is not None:
            for item, outcome in done:
                self.on_outcome(item.spec, item.delivery, outcome)


def _settleable(item: DeliveryWork, outcome: Outcome) -> bool:
    link = item.link
    with link.lock:
        link.in_flight -= 1
    if link.connection.is_open and item.channel.is_open:
        return True
    logger.warning(
        "message_id=%s: connection closed before its %s could be settled; "
        "the broker will redeliver it",
        item.delivery.message_id,
        type(outcome).__name__,
    )
    return False


def ack_coalesced(link: Link, channel: BrokerChannel, tags: set[int]) -> None:
    """Ack ``tags``: the run from the channel's oldest unsettled one with a multiple ack."""
    unsettled = link.unsettled.get(channel.channel_number, {})
    run: list[int] = []
    for tag in unsettled:  # oldest first: tags grow on a channel
        if tag not in tags:
            break
        run.append(tag)
    if run:
        channel.basic_ack(run[-1], multiple=True)
        for tag in run:
            del unsettled[tag]
            tags.discard(tag)
    for tag in sorted(tags):
        channel.basic_ack(tag)
        unsettled.pop(tag, None)
