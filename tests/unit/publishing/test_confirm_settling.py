"""A batch takes publisher confirms in whatever order the broker sends them: RabbitMQ 4.0 acks
small messages before a large one published ahead of them, then the large one with a multiple
ack that also covers tags already settled."""

from __future__ import annotations

from reliable_messaging.publishing.claims import ClaimedRow
from reliable_messaging.publishing.sent import Batch


def batch(first_tag: int, count: int) -> Batch:
    rows = {
        first_tag + n: ClaimedRow(
            pk=1000 + first_tag + n,
            message_id=f"m{first_tag + n}",
            exchange="shop",
            routing_key="order.placed",
            body="{}",
            headers={},
            raw_body=None,
            raw_properties=None,
            ordering_key=None,
            attempts=0,
            published_us=1_767_225_600_000_000,
        )
        for n in range(count)
    }
    return Batch(rows=rows, claimed=list(rows.values()), pks={r.pk for r in rows.values()})


def test_a_multiple_ack_after_later_single_acks_settles_only_what_was_left() -> None:
    sent = batch(1, 6)
    assert sent.settle(2, multiple=True, acked=True) == (2, 0)
    for tag in (4, 5, 6):  # the small ones after the large message 3
        assert sent.settle(tag, multiple=False, acked=True) == (1, 0)
    assert not sent.complete
    # Covers 1..3; only 3 was still open.
    assert sent.settle(3, multiple=True, acked=True) == (1, 0)
    assert sent.complete
    assert sent.confirmed == sent.pks and not sent.errors


def test_a_late_multiple_nack_charges_only_the_unsettled_tags() -> None:
    sent = batch(1, 4)
    assert sent.settle(3, multiple=False, acked=True) == (1, 0)
    assert sent.settle(4, multiple=False, acked=True) == (1, 0)
    assert sent.settle(4, multiple=True, acked=False) == (0, 2)
    assert sent.complete
    assert sent.errors.keys() == {1001, 1002}
    assert sent.confirmed == {1003, 1004}


def test_confirms_across_batches_settle_each_batch_by_its_own_tags() -> None:
    first, second = batch(1, 3), batch(4, 3)
    # The second batch's small messages first, then one multiple ack for everything.
    for tag in (5, 6):
        assert second.settle(tag, multiple=False, acked=True) == (1, 0)
        assert first.settle(tag, multiple=False, acked=True) == (0, 0)
    assert first.settle(6, multiple=True, acked=True) == (3, 0)
    assert second.settle(6, multiple=True, acked=True) == (1, 0)
    assert first.complete and second.complete
    assert second.confirmed == second.pks
