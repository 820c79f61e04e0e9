"""What a declared payload costs a message: validation on publish and on consume, against the
same path without a declared type, measured in one run.

    .venv/bin/python bench/contracts.py [--messages 2000] [--batch-size 50] [--rounds 5]

The payload is a 10-field pydantic v2 model (ints, text, a Decimal, a datetime, a UUID, a bool,
a list of text and an optional field); the same JSON is sent either way. Each round interleaves the
two sides of a comparison message by message (batch by batch), on PostgreSQL:

- *publish*: one business transaction per message (``transaction.atomic()``, then
  ``publish()``, then the commit) with the routing key declared (``publishes``: validate, then
  write the type's JSON form) and with an undeclared key;
- *consume*: ``process_batch`` of fresh deliveries for a consumer whose handler writes one row
  through the ORM (``tests.testapp.Effect``), with ``@consumer(payload=...)`` (the stage's
  validation, the handler given the object) and without.

It prints µs per message for each (the median of a round's calls; a batch's time divided by its
size) and their ratio; then what the step itself costs, timed alone in the same run
(``validate`` + ``encode`` less the dict's ``encode_payload`` for publish, ``validate`` for
consume), as a share of the path without a type: on a shared machine the paths' medians move
by more than the step costs, and the share is the figure to hold against the issue's goal (at
most 5 %).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import decimal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe_machine, setup_django


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=2000, help="per round and side")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django()
    import logging

    import pydantic
    from django.db import transaction

    from reliable_messaging import Message, publish
    from reliable_messaging.consuming.processing import DeliveryProcessor, process_batch
    from reliable_messaging.consuming.stage import Job
    from reliable_messaging.contracts import contract_of, published_registry, publishes
    from reliable_messaging.core.envelope import Delivery, encode_payload
    from reliable_messaging.core.registry import ConsumerSpec
    from tests.testapp.models import Effect

    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)

    class OrderPlaced(pydantic.BaseModel):
        order_id: int
        customer_id: int
        customer_name: str
        email: str
        amount: decimal.Decimal
        currency: str
        placed_at: dt.datetime
        reference: uuid.UUID
        gift: bool
        skus: list[str]
        note: str | None = None

    payload: dict[str, Any] = {
        "order_id": 123456,
        "customer_id": 42,
        "customer_name": "Ada Lovelace",
        "email": "ada@example.com",
        "amount": "129.90",
        "currency": "EUR",
        "placed_at": "2026-11-29T10:00:00+00:00",
        "reference": "6f1c2a38-7a4e-4b8e-9a43-0b2d4e1f9c11",
        "gift": False,
        "skus": ["A-1", "B-22", "C-333"],
    }
    assert len(OrderPlaced.model_fields) - 1 == 10  # ten fields given, one optional left out
    contract = contract_of(OrderPlaced)

    # Each round interleaves the two sides message by message (batch by batch), the side that
    # goes first alternating: a load that comes and goes on a shared machine falls on both.

    # The median of each side's calls: a commit that waited on another process's fsync is an
    # outlier of either side, not a cost of either.

    def interleaved(first: Callable[[], None], second: Callable[[], None], n: int) -> list[float]:
        times: tuple[list[float], list[float]] = ([], [])
        sides = (first, second)
        for i in range(n):
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                started = time.perf_counter()
                sides[side]()
                times[side].append(time.perf_counter() - started)
        return [statistics.median(times[0]), statistics.median(times[1])]

    # ------------------------------------------------------------------ publish

    def publishing(routing_key: str) -> Callable[[], None]:
        def run() -> None:
            with transaction.atomic():
                publish(routing_key, payload)

        return run

    # ------------------------------------------------------------------ consume

    def handler(message: Message) -> None:
        Effect.objects.create(
            consumer="bench.contracts", message_id=message.message_id, attempt=1, payload={}
        )

    plain = ConsumerSpec(name="bench.contracts", queue="bench.contracts", handler=handler)
    typed = dataclasses.replace(plain, payload=contract)
    body = encode_payload(payload)

    def consuming(spec: ConsumerSpec) -> Callable[[], None]:
        processor = DeliveryProcessor(spec)

        def run() -> None:
            jobs = [
                Job(
                    processor,
                    Delivery(
                        body=body,
                        queue=spec.queue,
                        exchange="bench",
                        routing_key="order.placed",
                        message_id=str(uuid.uuid4()),
                        content_type="application/json",
                    ),
                )
                for _ in range(args.batch_size)
            ]
            outcomes = process_batch(jobs)
            assert all(getattr(o, "result", None) == "processed" for o in outcomes), outcomes

        return run

    def validation_alone() -> float:
        started = time.perf_counter()
        for _ in range(args.messages):
            contract.validate(payload)
        return time.perf_counter() - started

    def round_trip_alone() -> float:
        """What publish does with a type beyond what it does without: validate and encode
        the object, less the encoding of the dict an undeclared publish does instead."""
        started = time.perf_counter()
        for _ in range(args.messages):
            contract.encode(contract.validate(payload))
        typed = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.messages):
            encode_payload(payload)
        return typed - (time.perf_counter() - started)

    batches = max(1, args.messages // args.batch_size)
    with published_registry.isolated():
        publishes("bench.declared", OrderPlaced)
        pairs = {
            "publish": (publishing("bench.undeclared"), publishing("bench.declared"), 1),
            "consume": (consuming(plain), consuming(typed), args.batch_size),
        }
        for without, with_type, _per in pairs.values():  # warm up: connections, partitions
            interleaved(without, with_type, 20)
        figures: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
        for _ in range(args.rounds):
            for name, (without, with_type, per) in pairs.items():
                calls = args.messages if per == 1 else batches
                spent = interleaved(without, with_type, calls)
                figures[name][0].append(spent[0] / per * 1e6)
                figures[name][1].append(spent[1] / per * 1e6)
        alone = [validation_alone() / args.messages * 1e6 for _ in range(args.rounds)]
        trip = [round_trip_alone() / args.messages * 1e6 for _ in range(args.rounds)]

    print(f"machine: {describe_machine()}")
    print(
        f"pydantic {pydantic.VERSION}; {args.rounds} rounds of {args.messages} messages a side "
        f"(consume: batches of {args.batch_size})"
    )
    steps = {"publish": statistics.median(trip), "consume": statistics.median(alone)}
    print(
        "| path | µs per message, no type | with the 10-field model | with / without "
        "(rounds) | the step alone, µs | step / path |"
    )
    print("|---|---|---|---|---|---|")
    for name, (untyped_us, typed_us_) in figures.items():
        ratios = [w / p - 1 for p, w in zip(untyped_us, typed_us_, strict=True)]
        base, typed_us = statistics.median(untyped_us), statistics.median(typed_us_)
        print(
            f"| {name} | {base:.1f} | {typed_us:.1f} | {statistics.median(ratios):+.1%} "
            f"({', '.join(f'{r:+.1%}' for r in ratios)}) | {steps[name]:.1f} | "
            f"{steps[name] / base:.2%} |"
        )
    print("the step: validate + encode less encode_payload(dict) on publish, validate on consume")
    print("goal: at most 5 % on each path")


if __name__ == "__main__":
    main()
