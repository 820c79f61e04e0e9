"""Prometheus metrics of one process, counted through helpers that check their label values
(``docs/operations.md#metrics``); the whole system's gauges are in :mod:`.ops.collectors`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .core.liveness import HealthCheck
from .core.outcomes import OutcomeLabel

CONSUMER_OUTCOMES = frozenset(OutcomeLabel)
DEDUP_RESULTS = frozenset({"hit", "miss", "error", "lease_busy"})
RELAY_FAILURE_KINDS = ("returned", "nacked", "timeout", "refused")

_RECEIVED = Counter(
    "reliable_messaging_consumer_received", "Deliveries received by a consumer.", ["consumer"]
)
_REDELIVERED = Counter(
    "reliable_messaging_consumer_redelivered",
    "Deliveries received with the broker's redelivered flag set.",
    ["consumer"],
)
_MESSAGES = Counter(
    "reliable_messaging_consumer_messages",
    "Deliveries handled by a consumer, by outcome.",
    ["consumer", "outcome"],
)
_HANDLER_DURATION = Histogram(
    "reliable_messaging_handler_duration_seconds",
    "Time a consumer's handler ran (its transaction included).",
    ["consumer"],
)
_PROCESSING_TIME = Histogram(
    "reliable_messaging_processing_time_seconds",
    "Time a consumer took to decide a delivery, from the start of its transaction (its batch's) "
    "to the commit.",
    ["consumer"],
)
_CRITICAL_TIME = Histogram(
    "reliable_messaging_critical_time_seconds",
    "Time from a message's publish (its outbox row's insert, else the producer's timestamp) to "
    "its processing by a consumer (the commit), retries included.",
    ["consumer"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600),
)
_HANDLER_TIMEOUTS = Counter(
    "reliable_messaging_handler_timeouts",
    "Handler calls interrupted at their time limit (HANDLER_TIMEOUT or the consumer's timeout).",
    ["consumer"],
)
_DEDUP_CACHE = Counter(
    "reliable_messaging_dedup_cache",
    "Lookups in the Redis duplicate fast path, by result.",
    ["consumer", "result"],
)
_RELAY_CLAIMED = Counter(
    "reliable_messaging_relay_claimed", "Outbox rows claimed by the relay for publishing."
)
_RELAY_PUBLISHED = Counter(
    "reliable_messaging_relay_published", "Outbox rows confirmed by the broker and marked sent."
)
_RELAY_FAILED = Counter(
    "reliable_messaging_relay_failed",
    "Outbox rows whose send failed, by kind (returned, nacked, timeout, refused).",
    ["kind"],
)
_RELAY_CONFIRM_LATENCY = Histogram(
    "reliable_messaging_relay_confirm_latency_seconds",
    "Time from publishing an outbox row to the broker's confirm of it.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
_CONSUMER_UNAVAILABLE = Gauge(
    "reliable_messaging_consumer_queues_unavailable",
    "Queues the consumer cannot declare or consume now (their node down, say); it consumes "
    "the others and tries these again.",
)
_BREAKER_STATE = Gauge(
    "reliable_messaging_breaker_state",
    "The consumer's circuit breaker in this process: 0 closed, 1 half-open (probing), 2 open "
    "(starting none of its deliveries).",
    ["consumer"],
)
_BREAKER_OPENED = Counter(
    "reliable_messaging_breaker_opened",
    "Times the consumer's circuit breaker opened in this process (a half-open probe that "
    "failed included).",
    ["consumer"],
)

_RELAY_BLOCKED = Gauge(
    "reliable_messaging_relay_blocked",
    "Relay connections the broker is blocking now (resource alarm); 0 or 1 per relay lane.",
)
_RELAY_BLOCKS = Counter(
    "reliable_messaging_relay_blocks", "Times the broker blocked a relay connection."
)

_PARTITION_DAYS_AHEAD = Gauge(
    "reliable_messaging_partition_days_ahead",
    "Days of day partitions made ahead of now, by the last partition upkeep run {table}.",
    ["table"],
)
_PARTITION_UPKEEP_FAILURES = Counter(
    "reliable_messaging_partition_upkeep_failures",
    "Partition upkeep runs that failed (a day not made, an expired day not dropped) {table}.",
    ["table"],
)

# Series that exist from the start, so rate() and the dashboard see zeros, not gaps.
for _kind in RELAY_FAILURE_KINDS:
    _RELAY_FAILED.labels(_kind)


def _check(value: str, allowed: Iterable[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(allowed)}")


# -- the consumer --------------------------------------------------------------------------------


def consumers_started(consumers: Iterable[str]) -> None:
    """Create every consumer series at zero, so ``rate()`` sees the first dead letter."""
    for consumer in consumers:
        for series in (_RECEIVED, _REDELIVERED, _PROCESSING_TIME, _CRITICAL_TIME):
            series.labels(consumer)
        for outcome in CONSUMER_OUTCOMES:
            _MESSAGES.labels(consumer, outcome)


def consumer_received(consumer: str, redelivered: bool = False) -> None:
    """A delivery reached ``consumer``; ``redelivered`` is the broker's flag."""
    _RECEIVED.labels(consumer).inc()
    if redelivered:
        _REDELIVERED.labels(consumer).inc()


def consumer_outcome(consumer: str, outcome: str, duration: float | None = None) -> None:
    """``consumer`` finished a delivery with ``outcome`` (``duration``: the handler's run time)."""
    consumer_outcomes(consumer, {outcome: 1}, () if duration is None else (duration,))


def consumer_outcomes(consumer: str, counts: Mapping[str, int], durations: Sequence[float]) -> None:
    """A batch's outcomes of ``consumer`` (how many of each) and its handlers' run times, each
    series changed once (:func:`_observe_all`)."""
    for outcome, count in counts.items():
        _check(outcome, CONSUMER_OUTCOMES, "consumer outcome")
        _MESSAGES.labels(consumer, outcome).inc(count)
    if durations:
        _observe_all(_HANDLER_DURATION.labels(consumer), durations)


def delivery_times(
    consumer: str, processing: float, critical: float | None, trace_id: str | None = None
) -> None:
    """A delivery of ``consumer`` was decided in ``processing`` seconds, ``critical`` seconds
    after its publish; ``trace_id`` becomes the observations' exemplar."""
    exemplar = {"trace_id": trace_id} if trace_id else None
    _PROCESSING_TIME.labels(consumer).observe(processing, exemplar)
    if critical is not None:
        _CRITICAL_TIME.labels(consumer).observe(max(0.0, critical), exemplar)


def batch_times(consumer: str, processing: float, count: int, critical: Sequence[float]) -> None:
    """``count`` deliveries of ``consumer`` decided together in ``processing`` seconds, those
    processed ``critical`` seconds after their publish: :func:`delivery_times` without
    exemplars, each series changed once."""
    _observe_all(_PROCESSING_TIME.labels(consumer), (processing,), count)
    if critical:
        _observe_all(_CRITICAL_TIME.labels(consumer), [max(0.0, c) for c in critical])


def handler_timeout(consumer: str) -> None:
    _HANDLER_TIMEOUTS.labels(consumer).inc()


def breaker_state(consumer: str, state: int) -> None:
    """``consumer``'s breaker is now ``state`` (0 closed, 1 half-open, 2 open)."""
    _BREAKER_STATE.labels(consumer).set(state)
    _BREAKER_OPENED.labels(consumer)


def breaker_opened(consumer: str) -> None:
    _BREAKER_OPENED.labels(consumer).inc()


# -- partition upkeep (consumer and relay) -------------------------------------------------------


def partition_days_ahead(table: str, days: float) -> None:
    _PARTITION_DAYS_AHEAD.labels(table).set(days)
    _PARTITION_UPKEEP_FAILURES.labels(table)


def partition_upkeep_failed(table: str) -> None:
    _PARTITION_UPKEEP_FAILURES.labels(table).inc()


def dedup_cache(consumer: str, result: str) -> None:
    """One lookup in the duplicate fast path: hit, miss, error or lease_busy."""
    _check(result, DEDUP_RESULTS, "dedup cache result")
    _DEDUP_CACHE.labels(consumer, result).inc()


consumer_queues_unavailable = _CONSUMER_UNAVAILABLE.set


# -- the relay -----------------------------------------------------------------------------------


relay_claimed = _RELAY_CLAIMED.inc
# relay_published(count=1): rows confirmed by the broker and their sent mark committed.
relay_published = _RELAY_PUBLISHED.inc


def relay_confirm_latency(seconds: float, count: int = 1) -> None:
    """``count`` rows confirmed ``seconds`` after they went out, as ``count`` observations
    taken in one step (an ``observe`` per row cost the relay about a tenth of its CPU)."""
    _observe_all(_RELAY_CONFIRM_LATENCY, (seconds,), count)


def _observe_all(histogram: Histogram, values: Iterable[float], count: int = 1) -> None:
    """Each of ``values`` observed ``count`` times, as ``Histogram.observe`` would (no
    exemplar), in one step: the sum and each bucket reached changed once, not per value."""
    bounds = histogram._upper_bounds
    reached: dict[int, int] = {}
    total = 0.0
    for value in values:
        total += value
        index = bisect_left(bounds, value)  # the first bucket with value <= its bound
        reached[index] = reached.get(index, 0) + 1
    if reached:
        histogram._sum.inc(total * count)
        for index, observed in reached.items():
            histogram._buckets[index].inc(observed * count)


def relay_failed(kind: str, count: int = 1) -> None:
    """``count`` rows were not sent: returned, nacked, timeout or refused."""
    _check(kind, RELAY_FAILURE_KINDS, "relay failure kind")
    _RELAY_FAILED.labels(kind).inc(count)


def relay_blocked(blocked: bool) -> None:
    """A relay connection was blocked, or is no longer (each True followed by one False)."""
    if blocked:
        _RELAY_BLOCKED.inc()
        _RELAY_BLOCKS.inc()
    else:
        _RELAY_BLOCKED.dec()


# -- the health gauge -----------------------------------------------------------------------------


class HealthCollector:
    """Exports ``reliable_messaging_healthy`` (1 or 0) for one process's health."""

    def __init__(self, health: HealthCheck) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        ok, _ = self.health.check()
        yield GaugeMetricFamily(
            "reliable_messaging_healthy",
            "1 when this process's health check passes (as /healthz), else 0.",
            value=1 if ok else 0,
        )
