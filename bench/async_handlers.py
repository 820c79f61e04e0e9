"""What an ``async def`` handler costs a delivery against the same handler written sync,
measured in one run.

    .venv/bin/python bench/async_handlers.py [--messages 500] [--rounds 5]

Both handlers write one row (``tests.testapp.Effect``): the sync one with ``objects.create``,
the async one with ``await objects.acreate`` (which runs back on the delivery's thread, see
docs/concepts.md#async-handlers-and-apublish). Each delivery goes the consumer's whole path
(``reliable_messaging.testing.deliver``: decode, inbox row and handler in one transaction, the
decision, the commit) on PostgreSQL, the two sides interleaved message by message. It prints
µs per delivery (the median of a round's) and the ratio async / sync per round; the difference
is the event loop and the two thread hand-offs each call pays.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe_machine, median, setup_django


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    namespace = setup_django()
    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)  # a line per delivery

    from reliable_messaging import Message, consumer
    from reliable_messaging.core.registry import ConsumerRegistry
    from reliable_messaging.testing import deliver
    from tests.testapp.models import Effect

    consumers = ConsumerRegistry()

    @consumer(f"{namespace}.bench-sync", bindings=["b.sync"], registry=consumers)
    def sync_handler(message: Message) -> None:
        Effect.objects.create(consumer="bench-sync", message_id=message.message_id, attempt=1)

    @consumer(f"{namespace}.bench-async", bindings=["b.async"], registry=consumers)
    async def async_handler(message: Message) -> None:
        await Effect.objects.acreate(
            consumer="bench-async", message_id=message.message_id, attempt=1
        )

    specs = {"sync": consumers.all()[1], "async": consumers.all()[0]}
    assert specs["sync"].function is sync_handler and specs["async"].function is async_handler
    print(f"machine: {describe_machine()}")
    print(f"{args.messages} deliveries a side per round, one row each, interleaved")
    ratios = []
    for round_ in range(1, args.rounds + 1):
        took: dict[str, list[float]] = {"sync": [], "async": []}
        for n in range(args.messages):
            for side, spec in specs.items():
                started = time.perf_counter()
                deliver(spec, {"n": n}, message_id=f"{namespace}-{round_}-{n}-{side}")
                took[side].append(time.perf_counter() - started)
        sync_us, async_us = (median(took[s]) * 1e6 for s in ("sync", "async"))
        ratios.append(async_us / sync_us)
        print(
            f"round {round_}: sync {sync_us:.0f} µs, async {async_us:.0f} µs per delivery "
            f"(async/sync {ratios[-1]:.2f}x)"
        )
    print(f"median async/sync: {median(ratios):.2f}x")


if __name__ == "__main__":
    main()
