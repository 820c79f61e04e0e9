"""The other way to reach a cluster: one address, a TCP load balancer (HAProxy) in front of the
nodes, as ``BROKER_URL``. The same pipeline and verdict as test_cluster_faults.py; the fault is
kill -9 of the node a consumer reaches through the balancer, whose connection the balancer then
closes, and the consumer connects again through it, to a node that is up."""

from __future__ import annotations

import subprocess
import textwrap
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import RelayProcess
from tests.support import ConsumeProcess, wait_until

from .rabbit_cluster import RabbitCluster, free_ports, port_free
from .rig import ClusterRig
from .test_cluster_faults import node_down_for, run_fault

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]


@pytest.fixture
def balancer(rabbit_cluster: RabbitCluster, tmp_path: Path) -> Iterator[int]:
    """HAProxy in TCP mode on a free port, round robin over the three nodes, each checked
    every 0.5 s; a connect to a node that is down is tried on another (redispatch)."""
    port = free_ports(1, 5790)[0]
    servers = "\n".join(
        f"  server n{i} 127.0.0.1:{node.port} check inter 500 fall 1 rise 2"
        for i, node in enumerate(rabbit_cluster.nodes)
    )
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        textwrap.dedent(
            f"""\
            global
              maxconn 2000
            defaults
              mode tcp
              retries 3
              option redispatch
              timeout connect 2s
              timeout client 120s
              timeout server 120s
            frontend amqp
              bind 127.0.0.1:{port}
              default_backend nodes
            backend nodes
              balance roundrobin
            """
        )
        + servers
        + "\n"
    )
    proc = subprocess.Popen(
        ["haproxy", "-f", str(config), "-db"],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "haproxy.log").open("w"),
    )
    try:
        wait_until(lambda: not port_free(port), timeout=15, message="haproxy listening")
        yield port
    finally:
        proc.kill()
        proc.wait(10)


def test_consumer_behind_a_load_balancer_whose_node_is_killed(
    cluster_rig: ClusterRig, balancer: int
) -> None:
    rig = cluster_rig
    url = f"amqp://guest:guest@127.0.0.1:{balancer}/{urllib.parse.quote(rig.vhost, safe='')}"
    victims: list[ConsumeProcess] = []

    def through_the_balancer(rig: ClusterRig) -> tuple[list[ConsumeProcess], RelayProcess]:
        with rig.starting_together():
            consumers = [rig.consumer(RM_BROKER_URL=url), rig.consumer(RM_BROKER_URL=url)]
        name = rig._app_name("relay")
        relay = RelayProcess([], rig.env(name, RM_BROKER_URL=url), rig.tmp_path / f"{name}.log")
        rig.app_names[relay.pid] = name
        rig.processes.append(relay)
        return consumers, relay.wait_connected(60)

    def fault() -> str:
        consumer = next(p for p in rig.processes if isinstance(p, ConsumeProcess))
        node = rig.cluster.node_of_process(consumer.pid, rig.vhost)
        victims.append(consumer)
        started = time.monotonic()
        node_down_for(rig.cluster, node, 8)
        return f"killed {node}, reached by consumer {consumer.pid} through the balancer " + (
            f"({time.monotonic() - started:.1f}s)"
        )

    run_fault(rig, "balancer: consumer's node kill -9", fault, pipeline=through_the_balancer)
    # Its connection was closed by the balancer, and it consumes again through it.
    assert victims[0].log().count("consuming ") >= 2, victims[0].log()[-3000:]
