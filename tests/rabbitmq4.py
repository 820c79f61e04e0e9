"""The RabbitMQ 4 nodes beside the system's 3.10 one (``scripts/rabbitmq4.sh``): 4.0.5 from
Debian trixie and 4.3.x from Debian sid.

One node of each release per machine, shared by every test and session that asks for it: built
once into a cache directory outside the checkout, started on first use, left running (it costs
nothing idle and starts in about 15 s). Tests reach a node through its :class:`Node` in
:data:`NODES` (the ``rabbitmq4`` and ``rabbitmq43`` fixtures), never the system node on 5672.
"""

from __future__ import annotations

import functools
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rabbitmq4.sh"


@dataclass(frozen=True)
class Node:
    """One node of ``scripts/rabbitmq4.sh``: its ``--release`` and the ports the script gives
    it."""

    release: str
    amqp_port: int
    management_port: int

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    @property
    def script(self) -> tuple[str, ...]:
        """The script's command line for this node; ``(*script, "ctl")`` is its rabbitmqctl."""
        return (str(SCRIPT), "--release", self.release)

    def ensure_started(self) -> str:
        """Build (first time on this machine) and start the node; return its version line."""
        return _start(self)

    def restart(self, timeout: float = 120) -> None:
        """Stop the node's Erlang VM (not only its app), wait until it is down, start it again:
        everything it knows comes back from its disk."""
        subprocess.run([*self.script, "stop"], capture_output=True, timeout=timeout, check=True)
        deadline = time.monotonic() + timeout
        while _answers(self):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the RabbitMQ {self.release} node did not stop")
            time.sleep(0.5)
        done = subprocess.run(
            [*self.script, "start"], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the RabbitMQ {self.release} node did not start again: {done}")

    def ctl(self, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl -q ARGS`` against the node; raises on failure."""
        done = subprocess.run(
            [*self.script, "ctl", "-q", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")
        return done.stdout


def _answers(node: Node) -> bool:
    done = subprocess.run(
        [*node.script, "ctl", "-q", "status"], capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


@functools.cache
def _start(node: Node) -> str:
    done = subprocess.run(
        [*node.script, "start"], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the RabbitMQ {node.release} node did not start:\n{done.stdout}{done.stderr}"
        )
    return done.stdout.strip().splitlines()[-1]


# By the name RM_TEST_BROKER and the fixtures give them (tests/support.py, tests/conftest.py).
NODES = {
    "rabbitmq4": Node("4.0", amqp_port=5782, management_port=15782),
    "rabbitmq43": Node("4.3", amqp_port=5783, management_port=15783),
}
