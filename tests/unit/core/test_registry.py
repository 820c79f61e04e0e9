"""The @consumer decorator and its registry: clear errors for every wrong registration."""

from __future__ import annotations

import pytest

from reliable_messaging import Message, consumer
from reliable_messaging.core.registry import ConsumerRegistry, ConsumerSpec, registry
from reliable_messaging.exceptions import ConsumerConfigurationError
from reliable_messaging.testing import find_consumer


def handler_a(message: Message) -> None:
    pass


def handler_b(message: Message) -> None:
    pass


def test_registration_fills_the_spec() -> None:
    reg = ConsumerRegistry()
    returned = consumer(
        "billing.charge",
        bindings=["order.placed", "order.paid"],
        exchange="shop",
        max_attempts=4,
        retry_delays=[1, 5],
        registry=reg,
    )(handler_a)
    assert returned is handler_a  # the decorator leaves the function usable
    spec = reg.get(f"{__name__}.handler_a")  # the default name is the dotted path
    assert spec == ConsumerSpec(
        name=f"{__name__}.handler_a",
        queue="billing.charge",
        handler=handler_a,
        bindings=("order.placed", "order.paid"),
        exchange="shop",
        max_attempts=4,
        retry_delays=(1.0, 5.0),
    )
    assert len(reg) == 1 and list(reg) == [spec]


def test_two_handlers_on_one_queue_is_an_error() -> None:
    reg = ConsumerRegistry()
    consumer("billing.charge", name="billing.a", registry=reg)(handler_a)
    with pytest.raises(ConsumerConfigurationError) as info:
        consumer("billing.charge", name="billing.b", registry=reg)(handler_b)
    text = str(info.value)
    assert "'billing.charge' has two handlers" in text
    assert "'billing.a'" in text and "'billing.b'" in text
    assert "own queue" in text  # says how to fix it
    assert [s.name for s in reg] == ["billing.a"]  # the first one stays


def test_duplicate_name_is_an_error() -> None:
    reg = ConsumerRegistry()
    consumer("queue.one", name="billing.charge", registry=reg)(handler_a)
    with pytest.raises(ConsumerConfigurationError) as info:
        consumer("queue.two", name="billing.charge", registry=reg)(handler_b)
    text = str(info.value)
    assert "Two consumers are named 'billing.charge'" in text
    assert "deduplication scope" in text and "name=" in text
    assert len(reg) == 1


def test_same_function_registered_twice_is_accepted() -> None:
    # e.g. a consumers.py module imported under two names
    reg = ConsumerRegistry()
    consumer("queue.one", registry=reg)(handler_a)
    consumer("queue.one", registry=reg)(handler_a)
    assert len(reg) == 1


def test_bindings_given_as_a_string_is_an_error() -> None:
    with pytest.raises(ConsumerConfigurationError) as info:
        consumer("billing.charge", bindings="order.placed", registry=ConsumerRegistry())
    text = str(info.value)
    assert "not a string" in text
    assert "bindings=['order.placed']" in text  # shows the fix


@pytest.mark.parametrize("queue", ["", "   ", None, 5])
def test_queue_must_be_a_non_empty_string(queue: object) -> None:
    with pytest.raises(ConsumerConfigurationError, match="non-empty string"):
        consumer(queue, registry=ConsumerRegistry())  # type: ignore[arg-type]


@pytest.mark.parametrize("max_attempts", [0, -1, 1.5, "3"])
def test_max_attempts_must_be_a_positive_integer(max_attempts: object) -> None:
    with pytest.raises(ConsumerConfigurationError, match="max_attempts"):
        consumer("q", max_attempts=max_attempts, registry=ConsumerRegistry())  # type: ignore


@pytest.mark.parametrize("delays", [[0, 1], [-1], [5, 1]])
def test_retry_delays_must_be_positive_and_increasing(delays: list[float]) -> None:
    with pytest.raises(ConsumerConfigurationError, match="retry_delays"):
        consumer("q", retry_delays=delays, registry=ConsumerRegistry())


def test_unregister_and_isolated() -> None:
    reg = ConsumerRegistry()
    consumer("q1", name="one", registry=reg)(handler_a)
    with reg.isolated():
        assert len(reg) == 0
        consumer("q2", name="two", registry=reg)(handler_b)
        assert [s.name for s in reg] == ["two"]
    assert [s.name for s in reg] == ["one"]
    reg.unregister("one")
    reg.unregister("missing")  # no error
    assert len(reg) == 0


def test_testapp_consumers_are_autodiscovered() -> None:
    names = {spec.name for spec in registry}
    assert {"tests.alpha", "tests.beta"} <= names
    spec = find_consumer("tests.alpha")
    assert spec.bindings == ("order.*",)
    assert find_consumer(spec.queue) is spec and find_consumer(spec.handler) is spec


def test_find_consumer_names_the_registered_ones_when_missing() -> None:
    with pytest.raises(LookupError, match=r"tests\.alpha"):
        find_consumer("nope")
