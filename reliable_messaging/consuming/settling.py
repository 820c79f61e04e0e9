"""Carrying out the workers' outcomes on the broker, on the connection's thread.

:meth:`OutcomeSettler.hand_back` (any thread) schedules :meth:`OutcomeSettler.settle_all` with
``add_callback_threadsafe``: acks coalesced, a retry copy confirmed before its original's ack,
releases nacked with requeue (except on an ordered channel being dropped).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable

from .. import metrics
from ..broker.retry_publisher import RetryCopy
from ..broker.topology import delay_exchange_name
from ..broker.transport import BrokerChannel, BrokerTransport, RetryPublishing
from ..conf import MessagingSettings
from ..core.envelope import Delivery
from ..core.outcomes import Acknowledge, Outcome, OutcomeLabel, Release, ScheduleRetry, label_of
from ..core.registry import ConsumerSpec
from .board import DeliveryWork, Link

logger = logging.getLogger(__name__)


class OutcomeSettler:
    """Acks, nacks and retry copies for the outcomes the workers hand back; counts them."""

    def __init__(
        self,
        transport: BrokerTransport,
        publisher: RetryPublishing,
        settings: MessagingSettings,
        on_outcome: Callable[[ConsumerSpec, Delivery, Outcome], None] | None = None,
    ) -> None:
        self.transport = transport
        self.publisher = publisher
        self.settings = settings
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
        """Carry out the outcomes of a batch: nacks and retries first, so a coalesced
        multiple ack never covers a delivery meant otherwise."""
        acks: dict[int, tuple[Link, BrokerChannel, set[int]]] = {}
        done: list[tuple[DeliveryWork, Outcome]] = []
        for item, outcome in settled:
            if not _settleable(item, outcome):
                continue
            done.append((item, outcome))
            if isinstance(outcome, Acknowledge):
                _, _, tags = acks.setdefault(id(item.channel), (item.link, item.channel, set()))
                tags.add(item.delivery.delivery_tag)
            elif isinstance(outcome, ScheduleRetry):
                self._publish_retry(item, outcome)
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

    def _publish_retry(self, item: DeliveryWork, retry: ScheduleRetry) -> None:
        """Hand the retry copy to the publisher; the original is acked once it is confirmed."""
        link, delivery = item.link, item.delivery
        if not (link.connection.is_open and item.channel.is_open):
            return  # the broker redelivers the original

        def on_link(ack: bool) -> None:
            def settle() -> None:
                if link.connection.is_open and item.channel.is_open:
                    if ack:
                        item.channel.basic_ack(delivery.delivery_tag)
                    else:
                        item.channel.basic_nack(delivery.delivery_tag, requeue=True)
                    link.forget(item.channel, delivery.delivery_tag)

            try:
                link.connection.add_callback_threadsafe(settle)
            except Exception:  # noqa: BLE001 - the connection is gone: the broker redelivers
                logger.debug("connection closed before a retry copy could be settled")

        self.publisher.submit(
            RetryCopy(
                exchange=delay_exchange_name(retry.delay, self.settings),
                routing_key=delivery.queue,
                body=delivery.body,
                properties=self.transport.retry_properties(item.properties, retry.headers),
                message_id=str(delivery.message_id),
                received=item.received,
                placed=lambda: on_link(True),
                give_back=lambda: on_link(False),
                wanted=lambda: link.connection.is_open and item.channel.is_open,
            )
        )


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
