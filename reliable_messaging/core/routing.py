"""AMQP topic-exchange matching, for the broker-free test helpers."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1024)
def _split(value: str) -> tuple[str, ...]:
    return tuple(value.split(".")) if value else ()


def topic_matches(pattern: str, routing_key: str) -> bool:
    """True when ``routing_key`` matches the binding ``pattern`` as RabbitMQ's topic exchange
    decides (``*`` one word, ``#`` zero or more); a key that is not text matches nothing."""
    if not isinstance(pattern, str) or not isinstance(routing_key, str):
        return False
    if "*" not in pattern and "#" not in pattern:
        return pattern == routing_key  # the same words, in the same order
    return _match(_split(pattern), _split(routing_key))


def _match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head in ("*", words[0])) and _match(rest, words[1:])
