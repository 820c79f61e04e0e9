"""The RabbitMQ 4.0 node beside the system's 3.10 one (``scripts/rabbitmq4.sh``).

One node per machine, shared by every test and session that asks for it: built once into a
cache directory outside the checkout, started on first use, left running (it costs nothing
idle and starts in about 15 s). Tests reach it with :data:`URL` and :data:`MANAGEMENT_URL`
and drive it with :func:`ctl`, never the system node on 5672.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rabbitmq4.sh"
URL = "amqp://guest:guest@127.0.0.1:5782/%2F"
MANAGEMENT_URL = "http://127.0.0.1:15782"


@functools.cache
def ensure_started() -> str:
    """Build (first time on this machine) and start the node; return its version line."""
    done = subprocess.run(
        [str(SCRIPT), "start"], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the RabbitMQ 4 node did not start:\n{done.stdout}{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def ctl(*args: str, timeout: float = 60) -> str:
    """``rabbitmqctl -q ARGS`` against the 4.0 node; raises on failure."""
    done = subprocess.run(
        [str(SCRIPT), "ctl", "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr or done.stdout}")
    return done.stdout
