"""One typed settings object over ``settings.RELIABLE_MESSAGING``, read lazily.

Every attribute is read from Django settings at access time, so ``override_settings`` in tests
and settings changed after import both take effect. Validation lives in :mod:`.checks`; here
values are only converted, never judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings

DEFAULTS: dict[str, Any] = {
    "BROKER_URL": "amqp://guest:guest@localhost:5672/%2F",
    "EXCHANGE": "reliable_messaging",
    "PREFETCH": 100,
    "RETRY_DELAYS": (1, 5, 30, 120, 600),
    "MAX_ATTEMPTS": 6,
    "DEDUP_RETENTION": timedelta(days=14),
    "OUTBOX_RETENTION": timedelta(days=7),
    "CACHE_ALIAS": None,
    "QUEUE_TYPE": "classic",
    # A delivery whose body is larger than this is dead-lettered without being decoded.
    "MAX_BODY_BYTES": 1024 * 1024,
    # When True, a message without a message_id gets "sha256:<hex of body>" as its id instead of
    # being dead-lettered. Only safe when identical bodies always mean the same event.
    "DERIVE_MESSAGE_ID": False,
    # Seconds a graceful stop waits for handlers in flight before giving up on them.
    "SHUTDOWN_TIMEOUT": 30.0,
    # Cap of the exponential backoff between broker reconnects and database probes.
    "RECONNECT_MAX_DELAY": 30.0,
    "HEARTBEAT": 60,
    # The relay: rows claimed per batch, the polling period when no NOTIFY wakes it (the only
    # mode on SQLite), how long to wait for the broker's confirms, and how many failed sends
    # (nack, unroutable, timeout) make a row "failed" for a person to look at.
    "RELAY_BATCH_SIZE": 500,
    "RELAY_POLL_INTERVAL": 1.0,
    "RELAY_CONFIRM_TIMEOUT": 30.0,
    "OUTBOX_MAX_ATTEMPTS": 10,
    # Topic patterns of routing keys that are commands: such a row must reach a queue, and when
    # the broker returns it unroutable it is retried, then failed. Every other row is an event:
    # returned unroutable (nobody subscribes yet) it is marked "unrouted" and not retried.
    "REQUIRE_ROUTE": (),
    # The consumer commits up to this many deliveries in one transaction (a savepoint each);
    # their acks go out after that commit. 1 gives one transaction per delivery.
    "CONSUMER_BATCH_SIZE": 50,
    # Partition queues of an ordered consumer (keys are spread over them by consistent hashing).
    # Changing it remaps keys: drain the partitions first (see docs/concepts.md).
    "ORDERED_PARTITIONS": 4,
    # Quorum queues only: the broker dead-drops a message redelivered this many times, a guard
    # against poison loops that never reach a handler (crashes before the ack).
    "QUORUM_DELIVERY_LIMIT": 50,
    # The Redis fast path (CACHE_ALIAS): how long a consumer holds its processing lease.
    "DEDUP_LEASE_SECONDS": 60.0,
    # Seconds a handler may run; past it the delivery's transaction rolls back and it counts as
    # a failed attempt (a dead letter with reason "timeout" once attempts run out). A handler
    # that cannot be interrupted (blocked in C) for HANDLER_TIMEOUT_GRACE seconds more makes the
    # process exit, and the crash guard charges the delivery when it comes back.
    "HANDLER_TIMEOUT": 600.0,
    "HANDLER_TIMEOUT_GRACE": 10.0,
    # Deaths of a process (killed, or exited past a handler's time limit) during one delivery
    # before that delivery becomes a dead letter instead of being tried again.
    "CRASH_LIMIT": 3,
    # The broker's consumer_timeout (RabbitMQ's default is 30 minutes): a delivery held unacked
    # longer makes the broker close the channel. The consumer gives back what it has held for
    # half of it, and the checks compare HANDLER_TIMEOUT and ordered retry horizons with it.
    "BROKER_CONSUMER_TIMEOUT": 1800.0,
    # Failures of our own code (not the handler's) on one delivery before it is isolated and
    # dead-lettered with reason "consumer_error".
    "CONSUMER_ERROR_LIMIT": 3,
    # Seconds a consumer waits for the inbox row of a message another consumer is handling in a
    # transaction not yet committed (a twin delivery, or a consumer cut off from the network
    # mid-batch whose transaction the database has not yet ended). Past it, the delivery is
    # deferred through a delay queue instead of stalling the consumer.
    "INBOX_LOCK_TIMEOUT": 2.0,
    # Who may read the web process's metrics/ and healthz/ views: staff users of the admin
    # always; a request with "Authorization: Bearer <OPS_VIEWS_TOKEN>" when a token is set (a
    # Prometheus scraper, a probe); everyone only when OPS_VIEWS_PUBLIC is True.
    "OPS_VIEWS_TOKEN": None,
    "OPS_VIEWS_PUBLIC": False,
}


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***``, safe for logs, reprs and checks.

    Works on the text, not on a parse: the URLs worth redacting are often the malformed ones
    (``amqps//app:pw@mq`` without its colon, a password holding ``/``, ``?``, ``#`` or ``@``, an
    unclosed IPv6 bracket), which ``urlsplit`` either rejects or splits so that the password
    lands in the host or path. Everything from the first ``:`` after ``scheme://`` (or after
    the start, when there is no scheme) to the last ``@`` is hidden. When the last ``@`` was in
    the query instead, more is hidden than needed, never less. Never raises."""
    first_at = url.find("@")
    if first_at < 0:
        return url  # nothing can separate credentials from the host
    scheme_end = url.find("://", 0, first_at)
    start = scheme_end + 3 if scheme_end >= 0 else 0
    last_at = url.rfind("@")
    colon = url.find(":", start, last_at)
    if colon < 0:
        return url  # a user name without a password
    return f"{url[: colon + 1]}***{url[last_at:]}"


def split_broker_urls(value: Any) -> list[str]:
    """``BROKER_URL`` as a list of URLs; an empty list for a value that holds none."""
    if isinstance(value, list | tuple):
        return [str(url).strip() for url in value if str(url).strip()]
    return [url.strip() for url in str(value).split(";") if url.strip()]


class MessagingSettings:
    """Typed, lazily-read view of ``settings.RELIABLE_MESSAGING`` with the contract's defaults."""

    @property
    def raw(self) -> Mapping[str, Any]:
        value = getattr(django_settings, "RELIABLE_MESSAGING", None) or {}
        return value if isinstance(value, Mapping) else {}

    def get(self, key: str) -> Any:
        return self.raw.get(key, DEFAULTS[key])

    @property
    def broker_urls(self) -> list[str]:
        """The broker's URLs: ``BROKER_URL`` is one URL, several joined by ``;`` (as kombu
        writes them), or a list of URLs (the nodes of a cluster)."""
        return split_broker_urls(self.get("BROKER_URL"))

    @property
    def broker_url(self) -> str:
        """The URLs as one ``;``-separated string (``;`` never occurs inside an AMQP URL)."""
        return ";".join(self.broker_urls)

    @property
    def broker_shown(self) -> str:
        """The URLs for a log line or a page: each with its password hidden."""
        return ", ".join(redact_url(url) for url in self.broker_urls)

    @property
    def exchange(self) -> str:
        return str(self.get("EXCHANGE"))

    @property
    def prefetch(self) -> int:
        return int(self.get("PREFETCH"))

    @property
    def retry_delays(self) -> tuple[float, ...]:
        return tuple(float(d) for d in self.get("RETRY_DELAYS"))

    @property
    def max_attempts(self) -> int:
        return int(self.get("MAX_ATTEMPTS"))

    @property
    def dedup_retention(self) -> timedelta:
        value: timedelta = self.get("DEDUP_RETENTION")
        return value

    @property
    def outbox_retention(self) -> timedelta:
        value: timedelta = self.get("OUTBOX_RETENTION")
        return value

    @property
    def cache_alias(self) -> str | None:
        value = self.get("CACHE_ALIAS")
        return None if value is None else str(value)

    @property
    def queue_type(self) -> str:
        return str(self.get("QUEUE_TYPE"))

    @property
    def max_body_bytes(self) -> int:
        return int(self.get("MAX_BODY_BYTES"))

    @property
    def derive_message_id(self) -> bool:
        return bool(self.get("DERIVE_MESSAGE_ID"))

    @property
    def shutdown_timeout(self) -> float:
        return float(self.get("SHUTDOWN_TIMEOUT"))

    @property
    def reconnect_max_delay(self) -> float:
        return float(self.get("RECONNECT_MAX_DELAY"))

    @property
    def heartbeat(self) -> int:
        return int(self.get("HEARTBEAT"))

    @property
    def relay_batch_size(self) -> int:
        return int(self.get("RELAY_BATCH_SIZE"))

    @property
    def relay_poll_interval(self) -> float:
        return float(self.get("RELAY_POLL_INTERVAL"))

    @property
    def relay_confirm_timeout(self) -> float:
        return float(self.get("RELAY_CONFIRM_TIMEOUT"))

    @property
    def outbox_max_attempts(self) -> int:
        return int(self.get("OUTBOX_MAX_ATTEMPTS"))

    @property
    def require_route(self) -> tuple[str, ...]:
        return tuple(self.get("REQUIRE_ROUTE"))

    @property
    def consumer_batch_size(self) -> int:
        return int(self.get("CONSUMER_BATCH_SIZE"))

    @property
    def ordered_partitions(self) -> int:
        return int(self.get("ORDERED_PARTITIONS"))

    @property
    def quorum_delivery_limit(self) -> int:
        return int(self.get("QUORUM_DELIVERY_LIMIT"))

    @property
    def dedup_lease_seconds(self) -> float:
        return float(self.get("DEDUP_LEASE_SECONDS"))

    @property
    def handler_timeout(self) -> float:
        return float(self.get("HANDLER_TIMEOUT"))

    @property
    def handler_timeout_grace(self) -> float:
        return float(self.get("HANDLER_TIMEOUT_GRACE"))

    @property
    def crash_limit(self) -> int:
        return int(self.get("CRASH_LIMIT"))

    @property
    def broker_consumer_timeout(self) -> float:
        return float(self.get("BROKER_CONSUMER_TIMEOUT"))

    @property
    def max_hold_seconds(self) -> float:
        """How long a delivery may be held unacked before it is given back: half the broker's
        consumer_timeout, so the broker never closes the channel under us."""
        return self.broker_consumer_timeout / 2

    @property
    def consumer_error_limit(self) -> int:
        return int(self.get("CONSUMER_ERROR_LIMIT"))

    @property
    def inbox_lock_timeout(self) -> float:
        return float(self.get("INBOX_LOCK_TIMEOUT"))

    @property
    def ops_views_token(self) -> str | None:
        token = self.get("OPS_VIEWS_TOKEN")
        return str(token) if token else None

    @property
    def ops_views_public(self) -> bool:
        return bool(self.get("OPS_VIEWS_PUBLIC"))

    def __repr__(self) -> str:
        return f"<MessagingSettings broker={self.broker_shown} exchange={self.exchange}>"


messaging_settings = MessagingSettings()
