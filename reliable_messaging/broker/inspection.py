"""Check the broker we are given (``messaging_status --broker``, and ``consume`` and ``relay``
at their start): read what it does to our queues, judged by :func:`.findings.find_findings`."""

from __future__ import annotations

import logging
import threading
import urllib.error
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any

import pika

from ..conf import MessagingSettings, messaging_settings, redact_url
from ..core.registry import ConsumerSpec, registry
from .findings import (
    BrokerFacts,
    DeprecatedFeature,
    Expectations,
    Finding,
    OurQueue,
    QueueFacts,
    body_limit_under_setting,
    find_findings,
)
from .limits import ask_broker, broker_refuses
from .queues import (
    DEFAULT_TIMEOUT,
    MANAGEMENT_ERRORS,
    READ_ERRORS,
    BadBrokerURL,
    BrokerUnreachable,
    describe_error,
    management_failure,
    management_get,
    management_queue,
    management_url_for,
    open_connection,
    our_queues,
    scrub,
)
from .replies import NOT_FOUND

logger = logging.getLogger(__name__)

CONNECTION_NAME = "broker_check"
_QUEUE_COLUMNS = (
    "name,type,arguments,policy,operator_policy,effective_policy_definition,delivery_limit"
)


@dataclass(frozen=True)
class BrokerCheck:
    """The outcome of a check: its findings, or why the broker could not be reached."""

    url: str  # redacted
    reachable: bool
    findings: tuple[Finding, ...] = ()
    error: str = ""

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")


def expectations_from(settings: MessagingSettings = messaging_settings) -> Expectations:
    return Expectations(**{f.name: getattr(settings, f.name) for f in fields(Expectations)})


def read_broker_facts(
    specs: Iterable[ConsumerSpec],
    *,
    settings: MessagingSettings = messaging_settings,
    management_url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> BrokerFacts:
    """What the broker says about ``specs``' queues and ``MAX_BODY_BYTES``; raises what
    :func:`.queues.open_connection` raises when no broker URL can be reached."""
    connection, params, secrets = open_connection(settings, CONNECTION_NAME, timeout)
    try:
        # The Connection.Start the broker opened with; BlockingConnection does not expose it.
        impl: Any = getattr(connection, "_impl")  # noqa: B009 - pika private
        version = _text(impl.server_properties.get("version"))
        max_message_size, probe_error = None, ""
        try:
            max_message_size = broker_refuses(connection, settings.max_body_bytes)
        except READ_ERRORS as exc:
            probe_error = scrub(describe_error(exc), *secrets)
    finally:
        if connection.is_open:
            connection.close()
    facts = BrokerFacts(
        url=redact_url(_url_of(params)),
        vhost=params.virtual_host,
        server_version=version,
        max_message_size=max_message_size,
        probe_error=probe_error,
    )
    base_url = management_url_for(management_url, settings, params)
    if not base_url:
        return replace(facts, management_error="the management API was skipped (no URL given)")
    facts = replace(facts, management_url=redact_url(base_url))

    get = partial(management_get, base_url, params=params, timeout=timeout)
    try:
        overview = get("/api/overview")
        described = get(f"/api/vhosts/{urllib.parse.quote(params.virtual_host, safe='')}")
        default_type = described.get("default_queue_type") or (described.get("metadata") or {}).get(
            "default_queue_type"
        )
        return replace(
            facts,
            management_version=_text(overview.get("rabbitmq_version")),
            # 3.10 answers "undefined": no default set, classic.
            vhost_default_queue_type=None if default_type in (None, "undefined") else default_type,
            deprecated_features=_deprecated_features(get),
            queues=tuple(
                _queue_facts(queue, management_queue(get, params, queue.name, _QUEUE_COLUMNS))
                for queue in our_queues(specs, settings)
            ),
        )
    except MANAGEMENT_ERRORS as exc:
        return replace(facts, management_error=management_failure(exc, base_url, secrets))


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


def _url_of(params: pika.URLParameters) -> str:
    """The node a connection reached, as a URL without the password."""
    scheme = "amqps" if params.ssl_options is not None else "amqp"
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    host = f"[{params.host}]" if ":" in params.host else params.host
    return f"{scheme}://{host}:{params.port}/{vhost}"


def _deprecated_features(get: Any) -> tuple[DeprecatedFeature, ...] | None:
    try:
        listed = get("/api/deprecated-features")
        used = {feature.get("name") for feature in get("/api/deprecated-features/used")}
    except urllib.error.HTTPError as exc:
        if exc.code == NOT_FOUND:  # before 3.13
            return None
        raise
    return tuple(
        DeprecatedFeature(
            str(feature.get("name")),
            str(feature.get("deprecation_phase")),
            used=feature.get("name") in used,
        )
        for feature in listed
    )


def _queue_facts(queue: OurQueue, data: dict[str, Any] | None) -> QueueFacts:
    if data is None:
        return QueueFacts(queue, exists=False)
    # 4.0 gives its own figure of a quorum queue's limit ("unlimited" when there is none).
    limit = data.get("delivery_limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
        limit = -1
    return QueueFacts(
        queue,
        exists=True,
        # The policy fields come with the queue's first statistics, seconds after it is made.
        sampled="effective_policy_definition" in data,
        type=str(data.get("type") or "classic"),
        arguments=data.get("arguments") or {},
        policy=data.get("policy") or None,
        operator_policy=data.get("operator_policy") or None,
        effective_policy=data.get("effective_policy_definition") or {},
        delivery_limit=limit,
    )


def check_broker(
    specs: Iterable[ConsumerSpec] | None = None,
    *,
    settings: MessagingSettings = messaging_settings,
    management_url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> BrokerCheck:
    """Read the broker and judge it for ``specs`` (default: every registered consumer)."""
    specs = list(registry.all() if specs is None else specs)
    shown = settings.broker_shown
    try:
        facts = read_broker_facts(
            specs, settings=settings, management_url=management_url, timeout=timeout
        )
    except BadBrokerURL:
        return BrokerCheck(shown, reachable=False, error="the URL cannot be parsed")
    except BrokerUnreachable as exc:
        return BrokerCheck(shown, reachable=False, error=f"cannot connect to {shown}: {exc}")
    return BrokerCheck(
        facts.url, reachable=True, findings=tuple(find_findings(facts, expectations_from(settings)))
    )


def _in_background(name: str, check: Callable[[], None]) -> threading.Thread:
    """Run ``check`` on a daemon thread; its failure is logged, never raised: a check must not
    take the consumer or the relay down."""

    def run() -> None:
        try:
            check()
        except Exception:
            logger.info("the broker check %s failed", name, exc_info=True)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def log_findings_in_background(
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
    timeout: float = DEFAULT_TIMEOUT,
) -> threading.Thread:
    """Check the broker in a daemon thread and log each warning and error found at WARNING."""
    specs = list(specs)

    def log_findings() -> None:
        check = check_broker(specs, settings=settings, timeout=timeout)
        if not check.reachable:
            logger.info("broker check skipped: %s", check.error)
            return
        for finding in check.findings:
            if finding.severity != "info":
                logger.warning(
                    "broker check: %s: %s. Fix: %s",
                    finding.severity.upper(),
                    finding.message,
                    finding.fix or "-",
                )
            elif finding.code == "management-api":
                logger.info("broker check: %s", finding.message)

    return _in_background("rm-broker-check", log_findings)


def log_body_limit_in_background(
    settings: MessagingSettings = messaging_settings, timeout: float = DEFAULT_TIMEOUT
) -> threading.Thread:
    """In a daemon thread, log an ERROR when the broker refuses a body of ``MAX_BODY_BYTES``."""

    def log_body_limit() -> None:
        limit, _ = ask_broker(settings.max_body_bytes, settings, timeout=timeout)
        if limit is not None:
            logger.error("%s. Fix: %s", *body_limit_under_setting(limit, settings.max_body_bytes))

    return _in_background("rm-body-limit-check", log_body_limit)
