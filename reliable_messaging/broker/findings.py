"""What in the broker we are given can drop or redeliver our messages behind our back: a pure
judgement of the facts :mod:`.inspection` read, one :class:`Finding` with its fix per thing an
operator should know (docs/operations.md, "Checking the broker")."""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.priorities import MAX_PRIORITY as MAX_TASK_PRIORITY

Severity = Literal["error", "warning", "info"]
OurQueueKind = Literal["consumer", "dead"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")

# RabbitMQ 4.0 gives a quorum queue without any delivery limit this one.
DEFAULT_DELIVERY_LIMIT_4 = 20
# The per-queue consumer timeout (argument or policy) exists from 3.12 on; from 4.3 the queue
# evaluates it, quorum queues only (classic queues and streams never time a consumer out), and
# takes the late delivery back with a basic.cancel instead of closing the channel.
PER_QUEUE_CONSUMER_TIMEOUT_SINCE = (3, 12)
QUEUE_EVALUATES_CONSUMER_TIMEOUT_SINCE = (4, 3)
# Where an argument and a policy both set a key, the argument wins for these; the lower value
# wins for the others.
ARGUMENT_WINS = frozenset({"dead-letter-exchange", "dead-letter-routing-key", "overflow"})
PERMITTED = "permitted_by_default"
# Quorum queues order by priority from 4.0 (two levels), strictly by 32 levels from 4.3.
QUORUM_PRIORITIES_SINCE = (4, 0)
QUORUM_STRICT_PRIORITIES_SINCE = (4, 3)


@dataclass(frozen=True)
class OurQueue:
    """A queue ``consume`` declares, and what the app expects of it."""

    name: str
    kind: OurQueueKind
    consumer: str | None = None
    handler_timeout: float | None = None
    dead_letter_to: str | None = None
    # Its messages carry priorities (a task queue): the queue should honour them.
    priorities: bool = False


@dataclass(frozen=True)
class QueueFacts:
    """One of our queues as the management API shows it (``sampled``: its policy fields are
    published yet; ``delivery_limit``: the broker's own figure, 4.0 and later)."""

    queue: OurQueue
    exists: bool
    sampled: bool = True
    type: str = "classic"
    arguments: Mapping[str, Any] = field(default_factory=dict)
    policy: str | None = None
    operator_policy: str | None = None
    effective_policy: Mapping[str, Any] = field(default_factory=dict)
    delivery_limit: int | None = None


@dataclass(frozen=True)
class DeprecatedFeature:
    name: str
    phase: str  # permitted_by_default, denied_by_default, disconnected, removed
    used: bool = False


@dataclass(frozen=True)
class BrokerFacts:
    """What was read of the broker. ``max_message_size`` is set when it refused a body of
    ``MAX_BODY_BYTES``; ``deprecated_features`` is None before 3.13."""

    url: str
    vhost: str
    server_version: str | None = None
    max_message_size: int | None = None
    probe_error: str = ""
    management_url: str = ""
    management_error: str = ""
    management_version: str | None = None
    vhost_default_queue_type: str | None = None
    deprecated_features: tuple[DeprecatedFeature, ...] | None = None
    queues: tuple[QueueFacts, ...] = ()


@dataclass(frozen=True)
class Expectations:
    """The settings the broker is held to (see :func:`.inspection.expectations_from`)."""

    queue_type: str = "classic"
    quorum_delivery_limit: int = 50
    crash_limit: int = 3
    max_body_bytes: int = 1024 * 1024
    broker_consumer_timeout: float = 1800.0
    handler_timeout_grace: float = 10.0


@dataclass(frozen=True)
class Finding:
    """One thing found, what happens to the messages, and how to fix it; ``code`` is stable."""

    severity: Severity
    code: str
    subject: str
    message: str
    fix: str = ""


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``"4.0.5"`` as ``(4, 0, 5)``; () when unknown."""
    return tuple(int(part) for part in re.findall(r"\d+", version or "")[:3])


def _number(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def effective(facts: QueueFacts, key: str) -> Any:
    """The value of policy key ``key`` that applies to the queue (None: not set)."""
    argument = facts.arguments.get(f"x-{key}")
    policy = facts.effective_policy.get(key)
    if argument is None or policy is None:
        return policy if argument is None else argument
    if key in ARGUMENT_WINS:
        return argument
    low_a, low_p = _number(argument), _number(policy)
    if low_a is None or low_p is None:
        return argument
    return min(low_a, low_p)


def _origin(facts: QueueFacts, key: str) -> str | None:
    """Whether ``argument`` or ``policy`` gives the effective value of ``key`` (or None)."""
    argument = facts.arguments.get(f"x-{key}")
    if argument is not None and effective(facts, key) == argument:
        return "argument"
    return None if facts.effective_policy.get(key) is None else "policy"


def _policies(facts: QueueFacts) -> list[tuple[str, str]]:
    """(kind, name) of the policy and of the operator policy applied to the queue, if any."""
    kinds = (("policy", facts.policy), ("operator_policy", facts.operator_policy))
    return [(kind, name) for kind, name in kinds if name]


def _source(facts: QueueFacts, key: str) -> str:
    """Who sets the effective value of ``key`` on the queue, for a person."""
    origin = _origin(facts, key)
    if origin == "argument":
        return f"its argument x-{key}"
    if origin is None:
        return "nothing"
    names = [f"{kind.replace('_', ' ')} {name}" for kind, name in _policies(facts)]
    return " or ".join(names) or "a policy"


def _delete_queue(vhost: str, name: str) -> str:
    return f"rabbitmqctl delete_queue -p {shlex.quote(vhost)} {shlex.quote(name)}"


def _remove_key_fix(facts: QueueFacts, key: str, vhost: str) -> str:
    """How to take ``key`` off the queue: the policies that set it, or a new declaration."""
    origin = _origin(facts, key)
    if origin == "argument":
        return (
            f"x-{key} was given when the queue was declared: drain it, delete it "
            f"({_delete_queue(vhost, facts.queue.name)}) and let consume declare it"
        )
    if origin is None:
        return ""
    v = shlex.quote(vhost)
    steps = []
    for kind, name in _policies(facts):
        skip = f" or make its pattern skip {facts.queue.name}" if kind == "policy" else ""
        n = shlex.quote(name)
        steps.append(
            f"remove {key!r} from {kind.replace('_', ' ')} {name}{skip} (rabbitmqctl set_{kind} "
            f"-p {v} {n} ... / rabbitmqctl clear_{kind} -p {v} {n})"
        )
    return "; ".join(steps)


def _ms(value: int) -> str:
    seconds = value / 1000
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 7200 and seconds % 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def _mib(size: int) -> str:
    return f"{size:,} bytes ({size / 1024 / 1024:g} MiB)"


def body_limit_under_setting(limit: int, max_body_bytes: int) -> tuple[str, str]:
    """What is wrong, and the fix, when the broker's ``max_message_size`` is under
    ``MAX_BODY_BYTES`` (``check --deploy``, ``messaging_status --broker``, the relay's start)."""
    message = (
        f"the broker refuses message bodies over {_mib(limit)} (max_message_size), but "
        f"RELIABLE_MESSAGING['MAX_BODY_BYTES'] lets publish() accept up to "
        f"{_mib(max_body_bytes)}: the relay's publish of a larger outbox row is refused (406) "
        "and the row is marked failed at once"
    )
    fix = (
        f"lower RELIABLE_MESSAGING['MAX_BODY_BYTES'] to {limit} or less, or raise the broker's "
        f"limit: max_message_size = {max_body_bytes} in rabbitmq.conf (at most 536870912), "
        "then restart the node"
    )
    return message, fix


def delivery_limit(facts: QueueFacts, version: tuple[int, ...]) -> int | None:
    """A quorum queue's effective delivery limit; None when unlimited."""
    if facts.delivery_limit is not None:  # the broker's own figure (4.0+)
        return facts.delivery_limit if facts.delivery_limit >= 0 else None
    argument = _number(facts.arguments.get("x-delivery-limit"))
    policy = _number(facts.effective_policy.get("delivery-limit"))
    given = [value for value in (argument, policy) if value is not None]
    if not given:
        return DEFAULT_DELIVERY_LIMIT_4 if version >= (4,) else None
    if version >= (4,) and any(value < 0 for value in given):
        # 4.0: a negative value means unlimited; against a limit, the limit wins.
        limit = max(given)
        return limit if limit >= 0 else None
    return min(given)


def find_findings(facts: BrokerFacts, expected: Expectations) -> list[Finding]:
    """Every finding, errors first."""
    found = _broker_findings(facts, expected)
    if not facts.management_error:
        found += _vhost_findings(facts, expected)
        found += _deprecation_findings(facts)
        version = version_tuple(facts.server_version or facts.management_version)
        by_name = {q.queue.name: q for q in facts.queues}
        vhost = facts.vhost
        for queue in (q for q in facts.queues if q.exists and q.sampled):
            found += _type_findings(queue, vhost, expected)
            found += _length_findings(queue, vhost)
            found += _expiry_findings(queue, vhost)
            found += _ttl_findings(queue, vhost)
            found += _consumer_timeout_findings(queue, vhost, version, expected)
            if queue.queue.kind == "consumer" and queue.type == "quorum":
                found += _delivery_limit_findings(queue, vhost, version, expected, by_name)
            if queue.queue.priorities:
                found += _priority_findings(queue, vhost, version)
        found += _unread_queue_findings(facts.queues)
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))


def _broker_findings(facts: BrokerFacts, expected: Expectations) -> list[Finding]:
    url = facts.url
    versions = f"RabbitMQ {facts.server_version or 'version unknown'} at {url}"
    if facts.management_version and facts.management_version != facts.server_version:
        versions += (
            f"; the management API at {facts.management_url} runs {facts.management_version}"
        )
    found = [Finding("info", "server-version", url, versions)]
    if facts.max_message_size is not None:
        message, fix = body_limit_under_setting(facts.max_message_size, expected.max_body_bytes)
        found.append(Finding("error", "max-message-size", url, message, fix))
    elif facts.probe_error:
        message = (
            f"whether the broker takes a body of MAX_BODY_BYTES ({expected.max_body_bytes:,} "
            f"bytes) could not be learned: {facts.probe_error}"
        )
        found.append(Finding("info", "max-message-size", url, message))
    if facts.management_error:
        message = f"queue types, arguments and policies were not checked: {facts.management_error}"
        fix = (
            "give RELIABLE_MESSAGING['MANAGEMENT_URL'] (or --management-url) the management "
            "API's address, with the credentials of a user tagged monitoring "
            "(rabbitmqctl set_user_tags USER monitoring)"
        )
        found.append(Finding("info", "management-api", facts.management_url or url, message, fix))
    return found


def _vhost_findings(facts: BrokerFacts, expected: Expectations) -> list[Finding]:
    default = facts.vhost_default_queue_type
    if default in (None, expected.queue_type):
        return []
    message = (
        f"vhost {facts.vhost!r} makes {default} queues by default; consume states the type "
        f"of every queue it declares (QUEUE_TYPE {expected.queue_type!r}), so its queues "
        "are not affected. A queue declared by hand or by another tool without "
        "x-queue-type is, and is reported by its own findings"
    )
    return [Finding("info", "vhost-default-queue-type", facts.vhost, message)]


def _deprecation_findings(facts: BrokerFacts) -> list[Finding]:
    features = facts.deprecated_features
    if features is None:
        message = (
            f"RabbitMQ {facts.server_version or '(version unknown)'} does not report "
            "deprecated features (its management API has no /api/deprecated-features, "
            "added in 3.13): not an error"
        )
        return [Finding("info", "deprecated-features", facts.url, message)]
    found = [
        Finding(
            "warning",
            "deprecated-feature-used",
            feature.name,
            f"something on this broker uses deprecated feature {feature.name} "
            f"({feature.phase}): a later RabbitMQ refuses it (the app itself uses none)",
            "see https://www.rabbitmq.com/docs/deprecated-features and `rabbitmq-diagnostics "
            "list_deprecated_features --used`",
        )
        for feature in features
        if feature.used
    ]
    denied = ", ".join(f"{f.name} ({f.phase})" for f in features if f.phase != PERMITTED)
    if denied:
        message = (
            f"the broker refuses these deprecated features: {denied}; the app uses none of them"
        )
        found.append(Finding("info", "deprecated-features-denied", facts.url, message))
    return found


def _unread_queue_findings(queues: Sequence[QueueFacts]) -> list[Finding]:
    found = []
    missing = ", ".join(q.queue.name for q in queues if not q.exists)
    if missing:
        message = f"not declared yet, so not checked (manage.py consume declares them): {missing}"
        found.append(Finding("info", "queue-missing", missing, message))
    unsampled = ", ".join(q.queue.name for q in queues if q.exists and not q.sampled)
    if unsampled:
        message = (
            "the broker has not published the policies of these queues yet (it samples "
            f"every few seconds after a declaration), so they were not checked: {unsampled}"
        )
        fix = "run the check again in a few seconds"
        found.append(Finding("info", "queue-not-sampled", unsampled, message, fix))
    return found


def _type_findings(facts: QueueFacts, vhost: str, expected: Expectations) -> list[Finding]:
    name = facts.queue.name
    if facts.type == expected.queue_type:
        return []
    if facts.type == "stream":
        message = (
            f"queue {name} is a stream: an ack does not remove a message from it, and "
            "consume cannot read it as a queue"
        )
        fix = f"drain and delete it ({_delete_queue(vhost, name)}) and let consume declare it"
        return [Finding("error", "queue-type", name, message, fix)]
    if facts.type == "classic":
        what = "it is not replicated: a lost node takes its messages with it"
    else:
        what = (
            "the broker counts its deliveries and, past the delivery limit, dead-letters or "
            "drops a message (see the dead-letter-target findings)"
        )
    message = (
        f"queue {name} is a {facts.type} queue, but QUEUE_TYPE is {expected.queue_type!r}: {what}"
    )
    fix = (
        f"set QUEUE_TYPE = {facts.type!r}, or move the queue to {expected.queue_type} as "
        "docs/quorum-migration.md says (drain, delete, let consume declare it)"
    )
    return [Finding("warning", "queue-type", name, message, fix)]


def _dead_letters_to(facts: QueueFacts) -> str | None:
    """Where the queue dead-letters, for a person; None when it drops instead."""
    exchange = effective(facts, "dead-letter-exchange")
    if exchange is None:
        return None
    key = effective(facts, "dead-letter-routing-key")
    shown = f"exchange {exchange!r}" if exchange else "the default exchange"
    return f"{shown} with routing key {key!r}" if key is not None else shown


def _fate(facts: QueueFacts, what: str) -> tuple[Severity, str]:
    """What the broker does with ``what`` when it takes them out of the queue: drops them (an
    error) or dead-letters them (a warning)."""
    target = _dead_letters_to(facts)
    if target is None:
        return "error", f"the broker drops {what}, unhandled and unrecorded"
    return "warning", f"the broker dead-letters {what} to {target}, unhandled"


def _length_findings(facts: QueueFacts, vhost: str) -> list[Finding]:
    limits = {
        key: f"{value:,} {unit}"
        for key, unit in (("max-length", "messages"), ("max-length-bytes", "bytes"))
        if (value := effective(facts, key)) is not None
    }
    if not limits:
        return []
    name = facts.queue.name
    overflow = effective(facts, "overflow") or "drop-head"
    fix = "; ".join(_remove_key_fix(facts, key, vhost) for key in limits)
    sources = " and ".join(_source(facts, key) for key in limits)
    held = f"queue {name} holds at most {' / '.join(limits.values())} ({sources}), overflow"
    if overflow == "drop-head":
        severity, fate = _fate(facts, "the oldest messages")
        message = f"{held} drop-head: past it {fate}"
    else:
        severity = "warning"
        message = (
            f"{held} {overflow}: past it the broker refuses new messages (a nack): the relay "
            "retries the rows and marks them failed after OUTBOX_MAX_ATTEMPTS, and retries of "
            "failed deliveries cannot be scheduled"
        )
    return [Finding(severity, "queue-overflow", name, message, fix)]


def _expiry_findings(facts: QueueFacts, vhost: str) -> list[Finding]:
    expires = effective(facts, "expires")
    if expires is None:
        return []
    name = facts.queue.name
    unused = "unused means no consumer attached: a consume outage that long"
    message = (
        f"queue {name} expires after {_ms(expires)} unused ({_source(facts, 'expires')}): "
        f"the broker then deletes it with every message in it ({unused})"
    )
    fix = _remove_key_fix(facts, "expires", vhost)
    return [Finding("error", "queue-expires", name, message, fix)]


def _ttl_findings(facts: QueueFacts, vhost: str) -> list[Finding]:
    ttl = effective(facts, "message-ttl")
    if ttl is None:
        return []
    name = facts.queue.name
    severity, fate = _fate(facts, "them")
    source = _source(facts, "message-ttl")
    message = f"messages expire in queue {name} after {_ms(ttl)} ({source}): {fate}"
    fix = _remove_key_fix(facts, "message-ttl", vhost)
    return [Finding(severity, "queue-message-ttl", name, message, fix)]


def _consumer_timeout_findings(
    facts: QueueFacts, vhost: str, version: tuple[int, ...], expected: Expectations
) -> list[Finding]:
    if version and version < PER_QUEUE_CONSUMER_TIMEOUT_SINCE:
        return []  # the broker ignores it: only its global consumer_timeout applies
    by_the_queue = version >= QUEUE_EVALUATES_CONSUMER_TIMEOUT_SINCE
    if by_the_queue and facts.type != "quorum":
        return []  # 4.3: classic queues and streams ignore it
    timeout = effective(facts, "consumer-timeout")
    if timeout is None:
        return []
    seconds = timeout / 1000
    name = facts.queue.name
    handler = facts.queue.handler_timeout
    grace = expected.handler_timeout_grace
    fix = (
        f"{_remove_key_fix(facts, 'consumer-timeout', vhost)}; or set it to at least "
        f"BROKER_CONSUMER_TIMEOUT ({expected.broker_consumer_timeout * 1000:.0f} ms)"
    )
    source = _source(facts, "consumer-timeout")
    has = f"queue {name} has a consumer timeout of {_ms(timeout)} ({source})"
    if handler is not None and seconds <= handler + grace:
        late = (
            "the broker takes a slow handler's delivery back while it runs and cancels the "
            "consumer, and the delivery is redelivered"
            if by_the_queue
            else "a slow handler gets its channel closed by the broker, and every delivery of "
            "that channel is redelivered"
        )
        message = (
            f"{has}, within its handler's time limit ({handler:g} s plus {grace:g} s grace): {late}"
        )
        return [Finding("error", "consumer-timeout", name, message, fix)]
    if seconds < expected.broker_consumer_timeout / 2:
        message = (
            f"{has}, under half of BROKER_CONSUMER_TIMEOUT "
            f"({expected.broker_consumer_timeout:g} s), which the app holds deliveries "
            "unacked for at most: the broker may "
            + ("cancel the consumer" if by_the_queue else "close the channel")
            + " first and redeliver"
        )
        fix += f", or set BROKER_CONSUMER_TIMEOUT to {seconds:g}"
        return [Finding("warning", "consumer-timeout", name, message, fix)]
    return []


def _priority_findings(facts: QueueFacts, vhost: str, version: tuple[int, ...]) -> list[Finding]:
    """A task queue whose tasks' priorities the broker ignores, or orders more coarsely than
    docs/tasks.md#priorities says for our declaration."""
    name = facts.queue.name
    move = (
        f"stop the relay, let the consumers empty {name}, delete it ({_delete_queue(vhost, name)}) "
        "and start consume, which declares it afresh"
    )
    if facts.type == "classic":
        levels = _number(facts.arguments.get("x-max-priority"))
        if levels is None:
            message = (
                f"task queue {name} is a classic queue without x-max-priority: it ignores the "
                "tasks' priorities (consume refuses to start until it is declared afresh)"
            )
            return [Finding("error", "task-priorities-ignored", name, message, move)]
        if levels < MAX_TASK_PRIORITY:
            message = (
                f"task queue {name} has x-max-priority {levels}: the tasks' priorities above it "
                f"(up to {MAX_TASK_PRIORITY}) are all run as {levels}"
            )
            return [Finding("warning", "task-priorities-capped", name, message, move)]
        return []
    if facts.type != "quorum" or version >= QUORUM_STRICT_PRIORITIES_SINCE:
        return []
    if version and version < QUORUM_PRIORITIES_SINCE:
        message = (
            f"task queue {name} is a quorum queue on RabbitMQ {'.'.join(map(str, version))}, "
            "which ignores message priorities: its tasks run in the order they arrive"
        )
        fix = (
            "upgrade RabbitMQ (4.3 orders quorum queues strictly by priority), or use "
            "QUEUE_TYPE 'classic', or give urgent tasks a queue of their own in QUEUES"
        )
        return [Finding("warning", "task-priorities-ignored", name, message, fix)]
    message = (
        f"task queue {name} is a quorum queue on RabbitMQ "
        f"{'.'.join(map(str, version)) or '(version unknown)'}: it orders by two levels only, "
        "tasks of priority above 0 and the others, about two of the first for one of the "
        "second (4.3 orders by every level, strictly)"
    )
    return [Finding("info", "task-priorities-two-levels", name, message)]


def _delivery_limit_findings(
    facts: QueueFacts,
    vhost: str,
    version: tuple[int, ...],
    expected: Expectations,
    by_name: Mapping[str, QueueFacts],
) -> list[Finding]:
    name = facts.queue.name
    limit = delivery_limit(facts, version)
    quorum = expected.queue_type == "quorum"
    limit_fix = _remove_key_fix(facts, "delivery-limit", vhost)
    limit_source = _source(facts, "delivery-limit")
    found = []
    if limit is None:
        if quorum:
            message = (
                f"quorum queue {name} has no delivery limit ({limit_source}): a message whose "
                "delivery kills its consumer before the crash guard records it comes back forever"
            )
            found.append(Finding("warning", "delivery-limit", name, message, limit_fix))
        return found
    if quorum and limit < expected.quorum_delivery_limit:
        message = (
            f"quorum queue {name} takes a message out after {limit} deliveries ({limit_source}), "
            f"fewer than QUORUM_DELIVERY_LIMIT ({expected.quorum_delivery_limit})"
        )
        if limit <= expected.crash_limit:
            message += (
                f", and not more than CRASH_LIMIT ({expected.crash_limit}): the broker takes "
                "out a message that kills its consumer before the crash guard does"
            )
        found.append(Finding("warning", "delivery-limit", name, message, limit_fix))
    exchange = effective(facts, "dead-letter-exchange")
    key = effective(facts, "dead-letter-routing-key")
    wanted = facts.queue.dead_letter_to
    if exchange is None:
        message = (
            f"quorum queue {name} drops a message after {limit} deliveries: it has no "
            "dead-letter target, so the message is neither handled nor recorded"
        )
        fix = (
            f"rabbitmqctl set_policy -p {shlex.quote(vhost)} --apply-to quorum_queues "
            f"--priority 10 {shlex.quote(name + '-dead-letters')} "
            f"{shlex.quote('^' + re.escape(name) + '$')} "
            + shlex.quote(
                '{"dead-letter-exchange":"","dead-letter-routing-key":"' + str(wanted) + '"}'
            )
            + " (one policy applies per queue: fold these keys into a policy that already "
            f"matches it), and QUEUE_TYPE = 'quorum' so that consume declares {wanted}"
        )
        found.append(Finding("error", "dead-letter-target", name, message, fix))
        return found
    target = by_name.get(wanted or "")
    if quorum and (exchange != "" or key != wanted):
        message = (
            f"quorum queue {name} dead-letters to {_dead_letters_to(facts)} "
            f"({_source(facts, 'dead-letter-routing-key')}), not to {wanted}: consume "
            "never records those messages as dead letters"
        )
        fix = _remove_key_fix(facts, "dead-letter-routing-key", vhost) or _remove_key_fix(
            facts, "dead-letter-exchange", vhost
        )
        found.append(Finding("warning", "dead-letter-target", name, message, fix))
    elif exchange == "" and target is not None and not target.exists:
        message = (
            f"quorum queue {name} dead-letters to queue {wanted}, which does not exist: "
            f"the broker drops a message after {limit} deliveries"
        )
        fix = "start manage.py consume, which declares it"
        found.append(Finding("error", "dead-letter-target", name, message, fix))
    return found


def summary(findings: Iterable[Finding]) -> str:
    """``2 errors, 1 warning, 3 notes``, or ``nothing found``."""
    counts = Counter(finding.severity for finding in findings)
    words = {"error": "error", "warning": "warning", "info": "note"}
    parts = [
        f"{counts[s]} {words[s]}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES if counts[s]
    ]
    return ", ".join(parts) or "nothing found"
