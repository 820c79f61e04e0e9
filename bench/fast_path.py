"""The Redis duplicate fast path (``CACHE_ALIAS``) against the consumer without it, same run.

    .venv/bin/python bench/fast_path.py [--messages 10000] [--rounds 5] [--concurrency 2]

Each round measures four runs of the consumer (ConsumerService, the engine of ``manage.py
consume``, in this process, CONN_MAX_AGE=60, INFO logs off), alternating which variant goes
first from one round to the next so that drift hits both alike:

- fresh messages without the fast path, and with it;
- the same messages again (duplicates) without it (the inbox decides) and with it (Redis does).

It prints each round's figures and ratios (with / without), then the median of the ratios and
their spread, and how many batches asked Redis (``check``) and how many round trips went to it
(``_run``: a batch's, or the flusher's), timed with ``time.perf_counter``. Ends with one JSON
line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pika
from _common import BROKER_URL, describe_machine, setup_django
from consume import fill, run_service


class RoundTrips:
    """Counts and times the fast path's calls to Redis (each call is one round trip)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}

    def install(self) -> None:
        from reliable_messaging.consuming import fastpath

        # check(): one per batch; _run(): one per round trip to Redis (a check's, or the
        # flusher's when no batch came to take what the last one committed).
        for name in ("check", "_run"):
            original = getattr(fastpath.DuplicateCache, name, None)
            if original is None:
                continue
            setattr(fastpath.DuplicateCache, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def timed(cache: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(cache, *args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                self.calls[name] += 1
                self.keys[name] += len(args[0]) if args and isinstance(args[0], list) else 0

        return timed

    def reset(self) -> dict[str, dict[str, float]]:
        summary = {
            name: {
                "calls": self.calls[name],
                "keys": self.keys[name],
                "ms": round(self.seconds[name] * 1000, 1),
            }
            for name in sorted(self.calls)
        }
        self.calls.clear()
        self.keys.clear()
        self.seconds.clear()
        return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()

    setup_django()
    import logging

    from django.conf import settings as django_settings
    from django.db import connections
    from django.db.models import Count
    from django.test import override_settings
    from django_redis import get_redis_connection

    from reliable_messaging.broker.topology import declare_topology
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.consuming.fastpath import DuplicateCache
    from reliable_messaging.testing import find_consumer
    from tests.support import fast_path_key
    from tests.testapp.models import Effect

    logging.getLogger("reliable_messaging").setLevel(logging.WARNING)
    connections["default"].settings_dict["CONN_MAX_AGE"] = 60
    base = {
        **django_settings.RELIABLE_MESSAGING,
        "DEDUP_RETENTION": dt.timedelta(days=14),
    }
    variants = {
        "without": {**base, "CACHE_ALIAS": None},
        "with": {**base, "CACHE_ALIAS": "messaging"},
    }
    spec = find_consumer("tests.alpha")
    n = args.messages
    trips = RoundTrips()
    trips.install()
    with override_settings(RELIABLE_MESSAGING=variants["without"]):
        connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
        declare_topology(connection.channel(), [spec], messaging_settings)
        connection.close()
        exchange = messaging_settings.exchange
        Effect.objects.all().delete()
    leftovers: list[str] = []
    for variant in variants:
        # A warm-up of each, not counted: connections, the partitions, the first queries'
        # plans, the script loaded into Redis.
        with override_settings(RELIABLE_MESSAGING=variants[variant]):
            warm = [f"warm{variant}-{uuid.uuid4()}" for _ in range(n // 4)]
            fill(exchange, warm, {"n": 1})
            run_service(spec, n // 4, f"warm-up {variant}", args.concurrency)
            leftovers += warm

    print(f"machine: {describe_machine()}")
    print(f"{n:,} messages per run, concurrency {args.concurrency}, {args.rounds} rounds")
    rounds: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = ("without", "with") if round_ % 2 == 0 else ("with", "without")
        ids = {
            variant: [f"r{round_}{variant}-{uuid.uuid4()}" for _ in range(n)] for variant in order
        }
        leftovers += ids["with"]
        rates: dict[str, float] = {}
        redis: dict[str, object] = {}
        for kind in ("fresh", "duplicates"):
            for variant in order:
                with override_settings(RELIABLE_MESSAGING=variants[variant]):
                    fill(exchange, ids[variant], {"n": 1})
                    trips.reset()
                    seconds = run_service(spec, n, f"{kind} {variant}", args.concurrency)
                    rates[f"{kind}_{variant}"] = n / seconds
                    if variant == "with":
                        redis[kind] = trips.reset()
        result = {
            "round": round_ + 1,
            "order": "/".join(order),
            **{key: round(value) for key, value in rates.items()},
            "fresh_ratio": round(rates["fresh_with"] / rates["fresh_without"], 3),
            "duplicates_ratio": round(rates["duplicates_with"] / rates["duplicates_without"], 3),
            "redis": redis,
        }
        rounds.append(result)
        print(
            f"round {round_ + 1} ({result['order']} first): fresh {rates['fresh_without']:,.0f} "
            f"without / {rates['fresh_with']:,.0f} with = {result['fresh_ratio']}; duplicates "
            f"{rates['duplicates_without']:,.0f} / {rates['duplicates_with']:,.0f} = "
            f"{result['duplicates_ratio']}; Redis calls (fresh) {redis.get('fresh')}, "
            f"(duplicates) {redis.get('duplicates')}",
            flush=True,
        )

    doubled = (
        Effect.objects.values("message_id")
        .order_by()
        .annotate(c=Count("id"))
        .filter(c__gt=1)
        .count()
    )
    # The done keys of this run are left to no one: remove them.
    with override_settings(RELIABLE_MESSAGING=variants["with"]):
        cache = DuplicateCache("messaging")
        client = get_redis_connection("messaging")
        for start in range(0, len(leftovers), 1000):
            batch = leftovers[start : start + 1000]
            client.delete(*(fast_path_key(cache, "done", spec.name, m) for m in batch))

    fresh = [r["fresh_ratio"] for r in rounds]
    dups = [r["duplicates_ratio"] for r in rounds]
    summary = {
        "machine": describe_machine(),
        "messages": n,
        "concurrency": args.concurrency,
        "rounds": rounds,
        "fresh_ratio_median": round(statistics.median(fresh), 3),
        "fresh_ratio_range": [min(fresh), max(fresh)],
        "duplicates_ratio_median": round(statistics.median(dups), 3),
        "duplicates_ratio_range": [min(dups), max(dups)],
        "doubled_effects": doubled,
    }
    print(
        f"fresh messages, with / without the fast path: median {summary['fresh_ratio_median']} "
        f"(rounds {min(fresh)} to {max(fresh)}; aim: at least 0.97)"
    )
    print(
        f"duplicates, with / without: median {summary['duplicates_ratio_median']} "
        f"(rounds {min(dups)} to {max(dups)}; aim: clearly above 1)"
    )
    print(f"doubled effects: {doubled}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
