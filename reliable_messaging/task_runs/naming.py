"""Where the tasks of a ``TASKS`` backend of ours travel: one consumer per queue of its
``QUEUES``, its AMQP queue and routing key ``<QUEUE_PREFIX><queue_name>``, and the backend's
``OPTIONS`` with their defaults. Plain values: no framework, no broker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.envelope import Message
from ..core.registry import RetryPolicy

# The consumer names of tasks start with this: what the consumer's stage of tasks looks for.
TASK_CONSUMER_PREFIX = "django.tasks:"
MAX_TASK_ID_LENGTH = 64  # TaskRun.id's
DEFAULT_QUEUE_PREFIX = "tasks."
# Longest AMQP queue name and routing key (a short string).
_MAX_NAME_BYTES = 255


@dataclass(frozen=True)
class TaskQueues:
    """The queues of one backend (``TASKS[alias]``) and the retry policy of its tasks (None:
    the ``RELIABLE_MESSAGING`` settings')."""

    alias: str
    queues: tuple[str, ...]
    prefix: str = DEFAULT_QUEUE_PREFIX
    max_attempts: int | None = None
    retry_delays: tuple[float, ...] | None = None
    # OPTIONS["TASK_RETRIES"]: the policies of tasks named by their dotted path, over their
    # decorator's (``task_runs.policies``).
    task_retries: tuple[tuple[str, RetryPolicy], ...] = ()

    @classmethod
    def of(cls, alias: str, params: Mapping[str, Any]) -> TaskQueues:
        """From a ``TASKS`` entry the system checks passed (:func:`problems`)."""
        options = params.get("OPTIONS") or {}
        return cls(
            alias=alias,
            queues=tuple(params.get("QUEUES") or ()),
            prefix=options.get("QUEUE_PREFIX", DEFAULT_QUEUE_PREFIX),
            max_attempts=options.get("MAX_ATTEMPTS"),
            retry_delays=delays_of(options.get("RETRY_DELAYS")),
            task_retries=tuple(
                (path, RetryPolicy(own.get("MAX_ATTEMPTS"), delays_of(own.get("RETRY_DELAYS"))))
                for path, own in (options.get("TASK_RETRIES") or {}).items()
            ),
        )

    def amqp_queue(self, queue_name: str) -> str:
        """The queue (and routing key) of the task queue ``queue_name``."""
        return f"{self.prefix}{queue_name}"

    def consumer_name(self, queue_name: str) -> str:
        """The consumer of ``queue_name``: the inbox's deduplication scope, the dead letter's
        consumer."""
        return task_consumer_name(self.alias, queue_name)


def task_consumer_name(alias: str, queue_name: str) -> str:
    """The consumer of the tasks of backend ``alias`` on its queue ``queue_name``."""
    return f"{TASK_CONSUMER_PREFIX}{alias}:{queue_name}"


def is_task_consumer(name: str) -> bool:
    return name.startswith(TASK_CONSUMER_PREFIX)


def is_task_id(value: Any) -> bool:
    """Whether a row could have ``value`` as its id: printable ASCII, up to 64 characters (a
    NUL or a lone surrogate would fail every statement it went into)."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TASK_ID_LENGTH:
        return False
    return value.isascii() and value.isprintable()


def task_id_of(message: Message) -> str | None:
    """The task a message of the task queues runs (its payload's ``task_id``), if a row could
    have that id (:func:`is_task_id`: a foreign producer's other text would hold the queue)."""
    payload = message.payload
    task_id = payload.get("task_id") if isinstance(payload, dict) else None
    return task_id if is_task_id(task_id) else None


def delays_of(delays: Any) -> tuple[float, ...] | None:
    return None if delays is None else tuple(float(d) for d in delays)


OPTIONS = {"QUEUE_PREFIX", "MAX_ATTEMPTS", "RETRY_DELAYS", "TASK_RETRIES"}
POLICY_KEYS = {"MAX_ATTEMPTS", "RETRY_DELAYS"}


def policy_problems(
    what: str,
    max_attempts: Any,
    delays: Any,
    names: tuple[str, str] = ("MAX_ATTEMPTS", "RETRY_DELAYS"),
) -> list[str]:
    """What is wrong with a retry policy (``what`` names where it was given, with ``{}`` for
    the value's name of ``names``)."""
    found: list[str] = []
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        found.append(f"{what.format(names[0])} must be an integer >= 1, got {max_attempts!r}.")
    if delays is None:
        return found
    if (
        not isinstance(delays, list | tuple)
        or not all(isinstance(d, int | float) and not isinstance(d, bool) and d > 0 for d in delays)
        or list(delays) != sorted(delays)
    ):
        found.append(
            f"{what.format(names[1])} must be positive seconds in increasing order, got {delays!r}."
        )
    return found


def _unknown_keys(where: str, given: Mapping[str, Any], known: set[str]) -> list[str]:
    return [
        f"{where} has an unknown key {key!r} (known: {', '.join(sorted(known))})."
        for key in sorted(set(given) - known)
    ]


def problems(alias: str, params: Mapping[str, Any]) -> list[str]:
    """What makes ``TASKS[alias]`` unusable by our backend, each said as a sentence."""
    found: list[str] = []
    queues = params.get("QUEUES")
    if not queues or isinstance(queues, str) or not isinstance(queues, list | tuple):
        found.append(
            f"TASKS[{alias!r}]['QUEUES'] must list the task queues (e.g. ['default']): each "
            f"gets a queue on the broker that `manage.py consume` consumes, got {queues!r}."
        )
        queues = []
    options = params.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        return [*found, f"TASKS[{alias!r}]['OPTIONS'] must be a dict, got {options!r}."]
    found.extend(_unknown_keys(f"TASKS[{alias!r}]['OPTIONS']", options, OPTIONS))
    prefix = options.get("QUEUE_PREFIX", DEFAULT_QUEUE_PREFIX)
    if not isinstance(prefix, str):
        found.append(f"TASKS[{alias!r}]['OPTIONS']['QUEUE_PREFIX'] must be a string.")
        prefix = ""
    for queue in queues:
        name = f"{prefix}{queue}" if isinstance(queue, str) else ""
        if (
            not isinstance(queue, str)
            or not queue
            or "*" in name
            or "#" in name
            or len(name.encode()) > _MAX_NAME_BYTES
        ):
            found.append(
                f"TASKS[{alias!r}]['QUEUES'] holds {queue!r}: a queue name must be a non-empty "
                f"string without '*' or '#' (it is a routing key), at most "
                f"{_MAX_NAME_BYTES} bytes with the prefix {prefix!r}."
            )
    found.extend(
        policy_problems(
            f"TASKS[{alias!r}]['OPTIONS'][{{!r}}]",
            options.get("MAX_ATTEMPTS"),
            options.get("RETRY_DELAYS"),
        )
    )
    retries = options.get("TASK_RETRIES")
    if retries is None:
        return found
    if not isinstance(retries, Mapping):
        return [
            *found,
            f"TASKS[{alias!r}]['OPTIONS']['TASK_RETRIES'] must be a dict of task paths to "
            f"their MAX_ATTEMPTS and RETRY_DELAYS, got {retries!r}.",
        ]
    for path, own in retries.items():
        where = f"TASKS[{alias!r}]['OPTIONS']['TASK_RETRIES'][{path!r}]"
        if not isinstance(own, Mapping) or not own:
            found.append(f"{where} must be a dict of MAX_ATTEMPTS and/or RETRY_DELAYS.")
            continue
        found.extend(_unknown_keys(where, own, POLICY_KEYS))
        found.extend(
            policy_problems(
                f"{where}[{{!r}}]",
                own.get("MAX_ATTEMPTS"),
                own.get("RETRY_DELAYS"),
            )
        )
    return found
