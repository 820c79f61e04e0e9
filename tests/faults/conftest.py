"""Fixtures of the fault-injection suite (see harness.py).

- ``rig``: a :class:`~tests.faults.harness.FaultRig` with a RabbitMQ vhost of its own; its
  processes are SIGKILLed and the vhost deleted in teardown, and their logs are attached to the
  report of a failed test (by the hook in tests/conftest.py).

Every test here that stops a service, blocks the broker or closes connections must run alone:
``flock -o /tmp/rm-services.lock .venv/bin/pytest tests/faults``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import database_url

from .harness import FaultRig


@pytest.fixture
def rig(
    request: pytest.FixtureRequest, transactional_db: None, tmp_path: Path
) -> Iterator[FaultRig]:
    fault_rig = FaultRig(tmp_path=tmp_path, database_url=database_url())
    request.node._rm_processes = fault_rig.processes
    try:
        yield fault_rig
    finally:
        fault_rig.close()
