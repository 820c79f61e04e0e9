"""The duplicate fast path: Redis remembers what the inbox holds, so duplicates skip PostgreSQL
(docs/operations.md, "The Redis fast path"); the inbox decides whatever the cache says."""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from .. import metrics
from ..conf import MessagingSettings, messaging_settings
from ..core.envelope import REPLAY_HEADER, Message
from ..core.outcomes import Acknowledge, OutcomeLabel
from .stage import Batch, DeliveryOutcome, Stage

logger = logging.getLogger(__name__)

# Seconds a consumer holds a message's processing lease (outliving it only loses the shortcut).
LEASE_SECONDS = 60.0
# After a cache error, seconds during which the cache is not tried at all.
PAUSE_AFTER_ERROR = 5.0
# Seconds between two warnings about the cache being unavailable.
WARN_EVERY = 60.0
# Seconds what a batch committed may wait for the next batch's round trip before it is sent.
FLUSH_AFTER = 0.05
# Seconds a flusher thread waits with nothing to send before it ends.
FLUSHER_IDLE = 30.0

# One atomic round trip: write the done keys and give back the leases still holding our token,
# then answer per digest asked "d" (done), "n" (new: leased, or no lease wanted) or "b" (leased
# elsewhere). ARGV: prefix, counts to write and to give back, done TTL (s), token, lease TTL
# (ms), lease flags ("1"/"0" per asked digest), then the digests: to write, to give back, asked.
_SCRIPT = """
local prefix, write, give_back = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local token, flags, first = ARGV[5], ARGV[7], 8
for i = first, first + write - 1 do
    redis.call('SET', prefix .. 'done:' .. ARGV[i], '1', 'EX', ARGV[4])
end
for i = first + write, first + write + give_back - 1 do
    local lease = prefix .. 'lease:' .. ARGV[i]
    if redis.call('GET', lease) == token then
        redis.call('DEL', lease)
    end
end
local base = first + write + give_back - 1
local answers = {}
for i = 1, #ARGV - base do
    local digest = ARGV[base + i]
    if redis.call('EXISTS', prefix .. 'done:' .. digest) == 1 then
        answers[i] = 'd'
    elseif string.sub(flags, i, i) ~= '1' then
        answers[i] = 'n'
    elseif redis.call('SET', prefix .. 'lease:' .. digest, token, 'NX', 'PX', ARGV[6]) then
        answers[i] = 'n'
    else
        answers[i] = 'b'
    end
end
return table.concat(answers)
"""
DONE, NEW = ord("d"), ord("n")


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
        self._script: Any = None
        # What committed batches left to tell Redis (digests to mark done, leases to give back).
        self._to_write: list[str] = []
        self._to_give_back: list[str] = []
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        # The flusher is a daemon thread: a process that ends sends what is left.
        atexit.register(_flush_at_exit, weakref.ref(self))

    def _client(self) -> Any:
        from django_redis import get_redis_connection

        return get_redis_connection(self.alias)

    def _prefix(self) -> str:
        from django.core.cache import caches

        return str(caches[self.alias].make_key("rm:"))

    def check(
        self, keys: Sequence[tuple[str, str]], lease: Collection[tuple[str, str]] = ()
    ) -> tuple[set[tuple[str, str]], dict[tuple[str, str], bool] | None]:
        """Which of ``keys`` (no repeats) are known processed, and for those of ``lease`` that
        are not, whether this process took the lease; on a cache error, nothing and None."""
        if not keys or not self._available():
            return set(), None
        flags = "".join("1" if key in lease else "0" for key in keys)
        answers = self._run(
            [_digest(c, m) for c, m in keys], flags, "read processed ids and take leases"
        )
        if answers is None:
            return set(), None
        known = {key for key, answer in zip(keys, answers, strict=True) if answer == DONE}
        leases = {
            key: answer == NEW
            for key, answer, flag in zip(keys, answers, flags, strict=True)
            if flag == "1" and answer != DONE
        }
        return known, leases

    def remember(
        self, processed: Iterable[tuple[str, str]], leased: Iterable[tuple[str, str]]
    ) -> None:
        """After the commit: mark ``processed`` done and give back the ``leased`` leases, with
        the next :meth:`check` or within ``FLUSH_AFTER`` seconds."""
        done = [_digest(c, m) for c, m in processed]
        leases = [_digest(c, m) for c, m in leased]
        if not (done or leases) or not self._available():
            return
        with self._lock:
            self._to_write += done
            self._to_give_back += leases
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="rm-fast-path-flush", daemon=True
                )
                self._flusher.start()
        self._wake.set()

    def flush(self) -> None:
        """Send what :meth:`remember` kept now (or drop it while the cache is failing)."""
        if self._available():
            self._run([], "", "record processed ids")
        else:
            with self._lock:
                self._to_write, self._to_give_back = [], []

    def _run(self, asked: list[str], flags: str, what: str) -> bytes | None:
        """The script's round trip for the digests ``asked``; its answer, or None on error."""
        with self._lock:
            write, self._to_write = self._to_write, []
            give_back, self._to_give_back = self._to_give_back, []
        if not (asked or write or give_back):
            return b""
        try:
            client = self._client()
            if self._script is None:
                # EVALSHA, loading the script on the first call to a server that lacks it.
                self._script = client.register_script(_SCRIPT)
            answers: bytes | str = self._script(
                keys=[],
                args=[
                    self._prefix(),
                    len(write),
                    len(give_back),
                    max(1, int(self.settings.dedup_retention.total_seconds())),
                    self._token,
                    max(1, round(LEASE_SECONDS * 1000)),
                    flags,
                    *write,
                    *give_back,
                    *asked,
                ],
                client=client,
            )
        except Exception as exc:  # noqa: BLE001 - any cache failure means "ask the database"
            self._failed(what, exc)
            return None
        # bytes, unless the cache's client decodes responses
        return answers.encode() if isinstance(answers, str) else answers

    def _flush_loop(self) -> None:
        while True:
            if not self._wake.wait(FLUSHER_IDLE):
                with self._lock:
                    if not (self._to_write or self._to_give_back):
                        self._flusher = None
                        return
                continue
            time.sleep(FLUSH_AFTER)  # the next batch's check usually takes it meanwhile
            self._wake.clear()
            self.flush()

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._paused_until

    def _failed(self, what: str, exc: Exception) -> None:
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


def _flush_at_exit(ref: weakref.ref[DuplicateCache]) -> None:
    cache = ref()
    if cache is not None:
        cache.flush()


def duplicate_cache(settings: MessagingSettings = messaging_settings) -> DuplicateCache | None:
    alias = settings.cache_alias
    return None if alias is None else DuplicateCache(alias, settings)


class FastPath(Stage):
    """Settles duplicates and messages another consumer leases before the transaction; after the
    commit, remembers what the batch processed and gives back its leases."""

    def open(self, batch: Batch) -> Any:
        jobs, decided = batch.jobs, batch.decided
        cache = jobs[0].processor.cache if jobs else None
        if cache is None:
            return None
        # Replays go to the database: a forced replay has just removed its inbox row, which the
        # cache may still remember.
        candidates = [
            (index, job, job.message)
            for index, job in enumerate(jobs)
            if isinstance(job.message, Message) and REPLAY_HEADER not in job.delivery.headers
        ]
        keys = list(dict.fromkeys((job.name, message.message_id) for _, job, message in candidates))
        # Ordered partitions have one consumer at a time already (single active consumer).
        wanted = {
            (job.name, message.message_id)
            for _, job, message in candidates
            if not job.processor.spec.ordered
        }
        known, leases = cache.check(keys, wanted)
        leased: list[tuple[str, str]] = []
        for index, job, message in candidates:
            key = (job.name, message.message_id)
            if key in known:
                metrics.dedup_cache(job.name, "hit")
                decided[index] = DeliveryOutcome(
                    Acknowledge(OutcomeLabel.DUPLICATE), OutcomeLabel.DUPLICATE, from_cache=True
                )
                continue
            metrics.dedup_cache(job.name, "miss")
            if leases is None or key not in leases:
                continue
            if leases[key]:
                leases[key] = False  # the same message twice in one batch: the inbox decides
                leased.append(key)
            elif key not in leased:
                metrics.dedup_cache(job.name, "lease_busy")
                decided[index] = job.processor.failures.defer(job.delivery, message)
        return cache, leased

    def close(self, batch: Batch, state: Any, error: BaseException | None) -> None:
        if state is None:
            return
        cache, leased = state
        processed = []
        if error is None:
            processed = [
                (job.name, job.message.message_id)
                for job, done in batch.outcomes()
                if done.processed and isinstance(job.message, Message)
            ]
        cache.remember(processed, leased)
