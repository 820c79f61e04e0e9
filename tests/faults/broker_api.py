"""The broker acting on its own, as fault tests need it: RabbitMQ's management HTTP API and
``rabbitmqctl eval`` calls aimed at one test's queues and channels, never at the whole node, on
the broker under test (``RM_TEST_BROKER``, tests/support.py).

- :func:`fail_consuming_channels` makes the broker close, with ``406 PRECONDITION_FAILED``, every
  channel that consumes a given queue. It is what a client sees when RabbitMQ's
  ``consumer_timeout`` fires (a delivery held unacked too long) or when anything else on the
  channel breaks a precondition: a ``channel.close`` from the broker, the connection staying
  open. The node's ``consumer_timeout`` is global (3.10 has no per-queue or per-vhost one), so
  instead the channel process is handed an ack of a delivery tag it never issued, exactly as if
  the client had sent it; the broker answers it the way it answers a timeout. The ``eval``
  expressions work unchanged on 3.10, 4.0 and 4.3 (``rabbit_amqqueue:consumers/1`` still lists
  the channel pid first, ``rabbit_channel_common:do/2`` feeds a method to the channel on each;
  4.3 removed the ``rabbit_channel:do/2`` that 4.0 delegated to it).
- :func:`delete_queue` deletes a queue under its consumers: the broker sends each of them a
  ``basic.cancel``.
- :func:`queue_crashed` makes one queue answer its declarations with ``404`` for a while, as a
  classic queue that crashed (or whose node is down) does.
- :func:`reads_refused` takes the ``read`` permission of a test's own vhost away for a while, so
  nothing can subscribe (or bind) there until it is given back; what is consumed already keeps
  flowing. Only for a vhost of the test's own (``FaultRig.vhost``).

Names are checked before they go into Erlang source: only a test's own, plain names pass.
"""

from __future__ import annotations

import contextlib
import re
import urllib.error
import urllib.parse
from collections.abc import Iterator

from tests import support

# A delivery tag no channel hands out in a test's lifetime: acking it is a 406 on the channel.
UNKNOWN_DELIVERY_TAG = 987_654_321
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.:-]{8,200}$")
_LOCAL_PID = re.compile(r"<\d+\.\d+\.\d+>")


def _plain(name: str) -> str:
    if not _PLAIN_NAME.fullmatch(name):
        raise ValueError(f"refusing to act on broker object {name!r}: not a test's own name")
    return name


def _erlang_binary(name: str) -> str:
    return f'<<"{_plain(name)}">>'


# --------------------------------------------------------------------------- management API


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def delete_queue(vhost: str, queue: str) -> None:
    """Delete ``queue`` whatever it holds and whoever consumes it (each consumer gets a
    ``basic.cancel`` from the broker)."""
    support.management("DELETE", f"/queues/{_quote(_plain(vhost))}/{_quote(_plain(queue))}")


def set_permissions(vhost: str, user: str, configure: str, write: str, read: str) -> None:
    support.management(
        "PUT",
        f"/permissions/{_quote(_plain(vhost))}/{_quote(user)}",
        {"configure": configure, "write": write, "read": read},
    )


@contextlib.contextmanager
def reads_refused(vhost: str, user: str = "guest") -> Iterator[None]:
    """``user`` may not read in ``vhost`` (no ``basic.consume``, no ``queue.bind``: 403) for the
    body of the ``with``; full permissions again on the way out, even when the body fails."""
    try:
        set_permissions(vhost, user, ".*", ".*", "^$")
        yield
    finally:
        set_permissions(vhost, user, ".*", ".*", ".*")


# --------------------------------------------------------------------------- exact broker state


def queue_consumers(vhost: str) -> dict[str, int]:
    """{queue: consumers attached now} for every queue of ``vhost`` (rabbitmqctl: exact, not
    the management plugin's sampled statistics)."""
    out = support.rabbitmqctl("list_queues", "-p", vhost, "name", "consumers", "--no-table-headers")
    counts: dict[str, int] = {}
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) == 2 and fields[1].isdigit():  # blank while a 4.0 queue starts
            counts[fields[0]] = int(fields[1])
    return counts


def _eval(expression: str) -> str:
    return support.rabbitmqctl("eval", expression, attempts=2)


def _set_queue_state(vhost: str, queue: str, state: str) -> None:
    # The default vhost, or a test's own; the queue is always a test's own.
    where = '<<"/">>' if vhost == "/" else _erlang_binary(vhost)
    out = _eval(
        f"{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r({where}, queue, "
        f"{_erlang_binary(queue)})), rabbit_misc:execute_mnesia_transaction(fun() -> "
        f"mnesia:write(rabbit_queue, amqqueue:set_state(Q, {state}), write) end)."
    )
    assert out.strip().endswith("ok"), out


@contextlib.contextmanager
def queue_crashed(vhost: str, queue: str) -> Iterator[None]:
    """For the body of the ``with``, the broker answers a declaration or binding of ``queue``
    (which must exist) with ``404 NOT_FOUND ... has crashed and failed to restart``, as for a
    classic queue whose process could not be restarted; it serves again after it (its process
    never stopped: only its record says crashed), even when the body fails."""
    _set_queue_state(vhost, queue, "crashed")
    try:
        yield
    finally:
        _set_queue_state(vhost, queue, "live")


def consuming_channels(vhost: str, queue: str) -> list[str]:
    """Pids (node-local ``<0.N.M>`` form) of the channels consuming ``queue`` now."""
    out = _eval(
        f"case rabbit_amqqueue:lookup(rabbit_misc:r({_erlang_binary(vhost)}, queue, "
        f"{_erlang_binary(queue)})) of "
        f"{{ok, Q}} -> lists:usort([pid_to_list(element(1, C)) || "
        f"C <- rabbit_amqqueue:consumers(Q)]); _ -> [] end."
    )
    return _LOCAL_PID.findall(out)


def fail_consuming_channels(vhost: str, queue: str) -> list[str]:
    """Make the broker close every channel consuming ``queue`` with ``406 PRECONDITION_FAILED``
    (``unknown delivery tag``); the pids of those channels. Their unacked deliveries go back
    to their queues, as after a ``consumer_timeout``."""
    pids = consuming_channels(vhost, queue)
    for pid in pids:
        # rabbit_channel_common:do/2 feeds a method to the channel as if its client had sent it.
        _eval(
            f'rabbit_channel_common:do(list_to_pid("{pid}"), '
            f"{{'basic.ack', {UNKNOWN_DELIVERY_TAG}, false}})."
        )
    return pids


def alive(pids: list[str]) -> list[str]:
    """Those of ``pids`` whose process still runs (a channel the broker closed ends once its
    client answered the ``channel.close``)."""
    if not pids:
        return []
    listed = ", ".join(f'"{pid}"' for pid in pids if _LOCAL_PID.fullmatch(pid))
    out = _eval(f"[P || P <- [{listed}], is_process_alive(list_to_pid(P))].")
    return _LOCAL_PID.findall(out)


def management_available() -> bool:
    try:
        support.management("GET", "/overview", timeout=3)
    except (OSError, urllib.error.URLError):
        return False
    return True
