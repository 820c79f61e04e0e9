"""Fixtures of the cluster fault tests (see rabbit_cluster.py, netns.py and rig.py).

- ``rabbit_cluster``: three RabbitMQ nodes of this session, clustered, beside the node on 5672
  (never touched); stopped and removed in a ``finally``.
- ``cluster_rig``: a :class:`~tests.cluster.rig.ClusterRig`: a vhost of its own on the cluster,
  real ``manage.py relay``/``consume`` processes (SIGKILLed in teardown, their logs attached to
  the report of a failed test), traffic and the exactly-once verdict. Every node is running
  again before each test, whatever the last one did.

Run: ``RM_TEST_DB_NAME=rm_cluster_$$ .venv/bin/pytest tests/cluster -s -p no:cacheprovider``
(root: the namespace test needs ``ip netns`` and ``nft``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import database_url

from .rabbit_cluster import RabbitCluster, rabbit_cluster_running
from .rig import ClusterRig


@pytest.fixture(scope="session")
def rabbit_cluster() -> Iterator[RabbitCluster]:
    with rabbit_cluster_running(3) as cluster:
        yield cluster


@pytest.fixture
def cluster_rig(
    request: pytest.FixtureRequest,
    rabbit_cluster: RabbitCluster,
    transactional_db: None,
    tmp_path: Path,
) -> Iterator[ClusterRig]:
    rabbit_cluster.ensure_all_running()
    rig = ClusterRig(tmp_path=tmp_path, database_url=database_url(), cluster=rabbit_cluster)
    request.node._rm_processes = rig.processes
    try:
        yield rig
    finally:
        rig.close()
