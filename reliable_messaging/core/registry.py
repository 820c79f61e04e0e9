"""The ``@consumer`` decorator and the registry of handlers it fills."""

from __future__ import annotations

import datetime as dt
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Literal, Self, TypeVar

from ..exceptions import ConsumerConfigurationError
from .breaker import Breaker
from .contracts import Contract, contract_of
from .coroutines import CoroutineHandler
from .envelope import Message

Handler = Callable[[Message], Any]
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """One message's own retry policy, where a consumer runs several kinds of work (a task
    queue's consumer runs many tasks); None: the consumer's."""

    max_attempts: int | None = None
    retry_delays: tuple[float, ...] | None = None


# What becomes of a message past its deadline: acked unhandled ("drop"), or kept as a dead letter.
OnExpiry = Literal["drop", "dead_letter"]


@dataclass(frozen=True)
class ConsumerSpec:
    """A registered handler and how it is wired to the broker; ``name`` is the deduplication
    scope, and None (``exchange``, ``max_attempts``, ``retry_delays``) means the setting's."""

    name: str
    queue: str
    # Always a plain callable: an ``async def`` handler is wrapped to run on the calling thread
    # (see core/coroutines.py); ``function`` is what the decorator was given.
    handler: Handler
    bindings: tuple[str, ...] = ()
    exchange: str | None = None
    ordered: bool = False
    max_attempts: int | None = None
    retry_delays: tuple[float, ...] | None = None
    # Seconds the handler may run; None means HANDLER_TIMEOUT (see consuming/time_limit.py).
    timeout: float | None = None
    # Seconds after its publish (its due time, when scheduled) past which a message is expired
    # instead of handled; None: no limit of the consumer's own (a publish(expires=...) still is).
    max_age: float | None = None
    on_expiry: OnExpiry = "drop"
    # The circuit breaker: a Breaker, False for none, None for the BREAKER setting's.
    breaker: Breaker | Literal[False] | None = None
    # The declared payload type: a message that does not match it is a dead letter
    # (invalid_payload) before the handler runs, and the handler's message.payload is its object.
    payload: Contract | None = None
    # Its messages carry priorities (the task queues'): a classic queue is declared with
    # x-max-priority (core/priorities.py), which it cannot be given later.
    priorities: bool = False
    # Looks up a failed delivery's own retry policy (None: the consumer's): the task queues'
    # consumers give each task its own max_attempts and retry_delays (task_runs/policies.py).
    retry_policy: Callable[[Message], RetryPolicy | None] | None = None

    @property
    def function(self) -> Callable[..., Any]:
        """The decorated function itself (``handler`` wraps an ``async def`` one)."""
        handler = self.handler
        return handler.function if isinstance(handler, CoroutineHandler) else handler


class KeyedRegistry(Generic[T]):
    """Entries by key, changed under a lock; :meth:`isolated` empties it for a test."""

    def __init__(self) -> None:
        self._entries: dict[str, T] = {}
        self._lock = threading.Lock()

    @contextmanager
    def isolated(self) -> Iterator[Self]:
        """Temporarily empty the registry (for tests); restores it on exit."""
        with self._lock:
            saved, self._entries = self._entries, {}
        try:
            yield self
        finally:
            with self._lock:
                self._entries = saved


class ConsumerRegistry(KeyedRegistry[ConsumerSpec]):
    """Handlers by name, with one handler per queue."""

    def register(self, spec: ConsumerSpec) -> None:
        with self._lock:
            existing = self._entries.get(spec.name)
            if existing is not None:
                if existing.function is spec.function or existing == spec:
                    return  # the same module imported twice under one name
                raise ConsumerConfigurationError(
                    f"Two consumers are named {spec.name!r}. The name is the deduplication "
                    f"scope, so it must be unique: pass name=... to one of them."
                )
            for other in self._entries.values():
                if other.queue == spec.queue:
                    raise ConsumerConfigurationError(
                        f"Queue {spec.queue!r} has two handlers: {other.name!r} and "
                        f"{spec.name!r}. Each queue feeds exactly one handler (retries and "
                        f"replays go back to the queue); give one of them its own queue."
                    )
            self._entries[spec.name] = spec

    def unregister(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def get(self, name: str) -> ConsumerSpec:
        return self._entries[name]

    def all(self) -> list[ConsumerSpec]:
        return sorted(self._entries.values(), key=lambda s: s.queue)

    def __iter__(self) -> Iterator[ConsumerSpec]:
        return iter(self.all())

    def __len__(self) -> int:
        return len(self._entries)


registry = ConsumerRegistry()


def _validate(
    queue: str,
    bindings: Sequence[str],
    max_attempts: int | None,
    retry_delays: Iterable[float] | None,
) -> tuple[float, ...] | None:
    if not isinstance(queue, str) or not queue.strip():
        raise ConsumerConfigurationError("consumer(queue=...) must be a non-empty string")
    if isinstance(bindings, str):
        raise ConsumerConfigurationError(
            f"bindings of {queue!r} must be a list of routing-key patterns, not a string "
            f"(write bindings=[{bindings!r}])"
        )
    if max_attempts is not None and (not isinstance(max_attempts, int) or max_attempts < 1):
        raise ConsumerConfigurationError(f"max_attempts of {queue!r} must be an integer >= 1")
    if retry_delays is None:
        return None
    delays = tuple(float(d) for d in retry_delays)
    if any(d <= 0 for d in delays) or list(delays) != sorted(delays):
        raise ConsumerConfigurationError(
            f"retry_delays of {queue!r} must be positive seconds in increasing order, "
            f"got {list(retry_delays)!r}"
        )
    return delays


def _seconds(
    queue: str, name: str, value: float | dt.timedelta | None, or_timedelta: bool = True
) -> float | None:
    if value is None:
        return None
    if or_timedelta and isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        also = " or a timedelta" if or_timedelta else ""
        raise ConsumerConfigurationError(
            f"consumer {queue!r}: {name} must be a positive number of seconds{also}, got {value!r}"
        )
    return float(value)


def _breaker(queue: str, value: Breaker | bool | None) -> Breaker | Literal[False] | None:
    if value is None or value is False or isinstance(value, Breaker):
        return value
    if value is True:
        return Breaker()
    raise ConsumerConfigurationError(
        f"consumer {queue!r}: breaker must be a Breaker(...), True (the defaults) or False, "
        f"got {value!r}"
    )


def consumer(
    queue: str,
    *,
    bindings: Sequence[str] = (),
    exchange: str | None = None,
    name: str | None = None,
    ordered: bool = False,
    max_attempts: int | None = None,
    retry_delays: Sequence[float] | None = None,
    timeout: float | None = None,
    max_age: float | dt.timedelta | None = None,
    on_expiry: OnExpiry = "drop",
    breaker: Breaker | bool | None = None,
    payload: Any = None,
    registry: ConsumerRegistry = registry,
) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``queue``, bound to ``bindings`` on
    the exchange, run in one transaction with its inbox row; the parameters are described in
    ``docs/reference/api.md``."""
    delays = _validate(queue, bindings, max_attempts, retry_delays)
    seconds = _seconds(queue, "timeout", timeout, or_timedelta=False)
    age = _seconds(queue, "max_age", max_age)
    if on_expiry not in ("drop", "dead_letter"):
        raise ConsumerConfigurationError(
            f"consumer {queue!r}: on_expiry must be 'drop' or 'dead_letter', got {on_expiry!r}"
        )
    breaker_spec = _breaker(queue, breaker)
    contract = contract_of(payload) if payload is not None else None

    def decorator(func: Handler) -> Handler:
        spec = ConsumerSpec(
            name=name or f"{func.__module__}.{func.__qualname__}",
            queue=queue,
            handler=CoroutineHandler(func) if inspect.iscoroutinefunction(func) else func,
            bindings=tuple(bindings),
            exchange=exchange,
            ordered=ordered,
            max_attempts=max_attempts,
            retry_delays=delays,
            timeout=seconds,
            max_age=age,
            on_expiry=on_expiry,
            breaker=breaker_spec,
            payload=contract,
        )
        registry.register(spec)
        return func

    return decorator
