"""The metric helpers that change a histogram without its ``observe``."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, Histogram

from reliable_messaging import metrics

CONFIRM_LATENCY = "reliable_messaging_relay_confirm_latency_seconds"


def _samples(name: str) -> dict[tuple[str, str | None], float]:
    return {
        (sample.name, sample.labels.get("le")): sample.value
        for metric in REGISTRY.collect()
        if metric.name == name
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


@pytest.mark.parametrize(
    "seconds", [0.0, 0.0004, 0.001, 0.003, 0.25, 7.0, 30.0, 31.5], ids=lambda value: f"{value}s"
)
def test_confirms_counted_at_once_are_the_observations_one_by_one(seconds: float) -> None:
    reference = Histogram(
        "reference_confirm_latency_seconds",
        "the same buckets, observed once per row",
        buckets=metrics._RELAY_CONFIRM_LATENCY._upper_bounds[:-1],
        registry=None,
    )
    before = _samples(CONFIRM_LATENCY)
    metrics.relay_confirm_latency(seconds, 7)
    metrics.relay_confirm_latency(seconds)
    after = _samples(CONFIRM_LATENCY)
    for _ in range(8):
        reference.observe(seconds)
    expected = {
        (sample.name.replace("reference", "reliable_messaging_relay"), sample.labels.get("le")): (
            sample.value
        )
        for metric in reference.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }
    assert expected.keys() == after.keys()
    for key, value in expected.items():
        assert after[key] - before[key] == pytest.approx(value), key


def _state(histogram: Histogram) -> dict[tuple[str, str | None], float]:
    return {
        (sample.name, sample.labels.get("le")): sample.value
        for metric in histogram.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


def test_values_observed_in_one_step_are_the_observations_one_by_one() -> None:
    """What a batch's handler durations or times since publish leave: every bound met exactly,
    values between bounds, below the first and past the last, each observed three times."""
    values = [0.0, 0.005, 0.0051, 0.1, 0.1, 2.4, 10.0, 11.0, 400.0, 0.03]
    batched, one_by_one = (
        Histogram(f"{name}_seconds", "the default buckets", registry=None)
        for name in ("batched", "one_by_one")
    )
    metrics._observe_all(batched, values, 3)
    metrics._observe_all(batched, [])
    for value in values * 3:
        one_by_one.observe(value)
    expected = {
        (name.replace("one_by_one", "batched"), le): value
        for (name, le), value in _state(one_by_one).items()
    }
    assert _state(batched) == pytest.approx(expected)
