"""The duplicate fast path: Redis remembers what the inbox already holds.

With ``CACHE_ALIAS`` set, two kinds of keys live in that cache:

- a *done* key per (consumer, message_id), written after the inbox row committed, with the
  inbox's retention as its lifetime. A delivery whose done key exists is a duplicate: it is
  acked without opening a transaction. The key is only ever written after the commit, so a hit
  is always true; a miss proves nothing and the database decides, as without the cache.
- a *lease* per (consumer, message_id), taken with ``SET NX`` and a short TTL before the handler
  runs. A second consumer that receives the same message while the first is still on it does
  not run it in parallel (and does not wait on the inbox's unique index); it puts the delivery
  aside for a moment, by which time the done key usually answers.

PostgreSQL stays the source of truth. Redis being down, slow or flushed changes nothing but
speed: any cache error logs one warning, and the cache is left alone for a few seconds before it
is tried again (so a dead Redis costs one failed call per pause, not one per message).

A lease holds this process's token, and is given back only while it still holds that token: a
handler that ran past the lease's TTL finds its lease expired and maybe taken by another
consumer, whose lease it must leave alone (compare-and-delete, in a Lua script, since Redis has
no such command).

The keys are read and written through django-redis's raw client, a batch per round trip
(MGET, a pipeline of ``SET NX PX``, one script that writes the done keys and gives back the
leases), with the cache's KEY_PREFIX. Values are plain bytes, never passed through the cache's
serializer: nothing read from Redis is ever unpickled.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from ..conf import MessagingSettings, messaging_settings

logger = logging.getLogger(__name__)

# After a cache error, seconds during which the cache is not tried at all.
PAUSE_AFTER_ERROR = 5.0
# Seconds between two warnings about the cache being unavailable.
WARN_EVERY = 60.0

# After a commit, in one round trip: the done keys are written, and each lease is deleted only if
# it still holds this process's token. GET then DEL inside a script is atomic (no other command
# runs in between), which two separate commands would not be.
# KEYS: the done keys, then the leases. ARGV: how many done keys, their TTL in seconds, the token.
_REMEMBER_SCRIPT = """
local done = tonumber(ARGV[1])
for i = 1, done do
    redis.call('SET', KEYS[i], '1', 'EX', ARGV[2])
end
local released = 0
for i = done + 1, #KEYS do
    if redis.call('GET', KEYS[i]) == ARGV[3] then
        redis.call('DEL', KEYS[i])
        released = released + 1
    end
end
return released
"""


def _digest(consumer: str, message_id: str) -> str:
    # Hashed: message ids are arbitrary text, cache keys should be short and plain.
    return hashlib.sha1(f"{consumer}\0{message_id}".encode(), usedforsecurity=False).hexdigest()


class DuplicateCache:
    """The fast path over one Django cache (django-redis). Thread-safe; never raises."""

    def __init__(self, alias: str, settings: MessagingSettings = messaging_settings) -> None:
        self.alias = alias
        self.settings = settings
        self._token = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._last_warning = -WARN_EVERY

    @property
    def cache(self) -> Any:
        from django.core.cache import caches

        return caches[self.alias]

    def _client(self) -> Any:
        from django_redis import get_redis_connection

        return get_redis_connection(self.alias)

    def _key(self, kind: str, consumer: str, message_id: str) -> str:
        return str(self.cache.make_key(f"rm:{kind}:{_digest(consumer, message_id)}"))

    def done_key(self, consumer: str, message_id: str) -> str:
        return self._key("done", consumer, message_id)

    def lease_key(self, consumer: str, message_id: str) -> str:
        return self._key("lease", consumer, message_id)

    # -- the three operations ---------------------------------------------------------------------

    def processed(self, keys: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
        """Which of the (consumer, message_id) pairs are known to be processed."""
        if not keys or not self._available():
            return set()
        try:
            found = self._client().mget([self.done_key(c, m) for c, m in keys])
        except Exception as exc:  # noqa: BLE001 - any cache failure means "ask the database"
            self._failed("read processed ids", exc)
            return set()
        return {key for key, value in zip(keys, found, strict=True) if value is not None}

    def lease(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], bool] | None:
        """Take the processing leases of ``keys``: True where taken, False where another
        consumer holds it. None when the cache cannot tell (run them all; the inbox decides)."""
        if not keys or not self._available():
            return None
        ttl_ms = max(1, round(self.settings.dedup_lease_seconds * 1000))
        try:
            pipe = self._client().pipeline(transaction=False)
            for consumer, message_id in keys:
                pipe.set(self.lease_key(consumer, message_id), self._token, nx=True, px=ttl_ms)
            taken = pipe.execute()
        except Exception as exc:  # noqa: BLE001
            self._failed("take processing leases", exc)
            return None
        return {key: bool(ok) for key, ok in zip(keys, taken, strict=True)}

    def remember(
        self, processed: Iterable[tuple[str, str]], leased: Iterable[tuple[str, str]]
    ) -> None:
        """After the commit: mark ``processed`` done and give back the ``leased`` leases, those
        this process still holds (one that expired meanwhile may be another consumer's now)."""
        done = [self.done_key(c, m) for c, m in processed]
        leases = [self.lease_key(c, m) for c, m in leased]
        if not (done or leases) or not self._available():
            return
        ttl = max(1, int(self.settings.dedup_retention.total_seconds()))
        try:
            client = self._client()
            # EVALSHA, loading the script on the first call to a server that lacks it.
            client.register_script(_REMEMBER_SCRIPT)(
                keys=[*done, *leases], args=[len(done), ttl, self._token], client=client
            )
        except Exception as exc:  # noqa: BLE001
            # The leases expire on their own and the inbox still knows what was processed.
            self._failed("record processed ids", exc)

    # -- availability -----------------------------------------------------------------------------

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._paused_until

    def _failed(self, what: str, exc: Exception) -> None:
        from .. import metrics

        now = time.monotonic()
        with self._lock:
            was_available = now >= self._paused_until
            self._paused_until = now + PAUSE_AFTER_ERROR
            warn = now - self._last_warning >= WARN_EVERY
            if warn:
                self._last_warning = now
        metrics.dedup_cache("-", "error")
        if warn and was_available:
            logger.warning(
                "duplicate fast path: cannot %s in cache %r (%s: %s); the database decides "
                "alone (correct, only slower) until the cache answers again",
                what,
                self.alias,
                type(exc).__name__,
                exc,
            )
        else:
            logger.debug("duplicate fast path: cache %r still failing: %s", self.alias, exc)


def duplicate_cache(settings: MessagingSettings = messaging_settings) -> DuplicateCache | None:
    alias = settings.cache_alias
    return None if alias is None else DuplicateCache(alias, settings)
