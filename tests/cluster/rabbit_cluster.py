"""A 3-node RabbitMQ cluster of the test run's own, beside the node on 5672 (never touched).

:class:`RabbitCluster` starts three extra nodes with ``rabbitmq-server -detached``, each with a
node name, AMQP port, distribution port, data, log and config directory of its own under one
run directory (``/tmp/rm-cluster/<prefix>``), and one ``HOME`` for all three (so they share an
Erlang cookie of their own). Nodes 2 and 3 are joined to node 1 (``stop_app``,
``join_cluster``, ``start_app``). Every ``rabbitmqctl`` call names its node with ``-n`` and runs
with that ``HOME``, and every one has a timeout.

The nodes listen for AMQP on 0.0.0.0 (so a consumer inside a network namespace reaches them at
the host's veth address) and let ``guest`` log in from other hosts than localhost (only on these
nodes). Distribution stays on 127.0.0.1, registered with the machine's epmd (shared with the
main node; the names differ).

A run writes its pytest pid to ``owner.pid``; the next run kills the nodes of a run directory
whose owner is gone (found through the processes' own environment, ``RABBITMQ_MNESIA_BASE``
inside that directory) and removes it. Nothing else is ever killed.

Helpers for the fault tests: :meth:`RabbitCluster.urls`, :meth:`~RabbitCluster.kill_9`,
:meth:`~RabbitCluster.start`, :meth:`~RabbitCluster.stop`,
:meth:`~RabbitCluster.rolling_restart`, :meth:`~RabbitCluster.memory_alarm`,
:meth:`~RabbitCluster.quorum_leader`, :meth:`~RabbitCluster.node_of_process`,
:meth:`~RabbitCluster.add_vhost`, :meth:`~RabbitCluster.delete_vhost` and
:meth:`~RabbitCluster.queue_depths`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tests.support import cli_env, wait_until

RUN_ROOT = Path(tempfile.gettempdir()) / "rm-cluster"
PREFIX = "rmc"
HOST = "localhost"  # the node names' host part (short names, as the main node's)


def _rabbit_bin(name: str) -> str:
    """The real script, not the /usr/sbin wrapper (which ``su``s to the rabbitmq user and so
    would use that user's HOME and cookie, the main node's)."""
    direct = Path("/usr/lib/rabbitmq/bin") / name
    if direct.exists():
        return str(direct)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: is RabbitMQ installed?")
    return found


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(count: int, start: int, taken: set[int] | None = None) -> list[int]:
    """``count`` ports from ``start`` up that nothing listens on (nor is in ``taken``)."""
    taken = set(taken or ())
    found: list[int] = []
    port = start
    while len(found) < count:
        if port > start + 2000:
            raise RuntimeError(f"no {count} free ports from {start} up")
        if port not in taken and port_free(port):
            found.append(port)
        port += 1
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is as good as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return False
    return True


def _processes_under(directory: Path) -> list[int]:
    """Pids whose environment puts their RabbitMQ data under ``directory`` (our beams)."""
    marker = f"RABBITMQ_MNESIA_BASE={directory}/".encode()
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(marker) for item in environ.split(b"\0")):
            pids.append(int(entry.name))
    return pids


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)


def clean_stale_runs(root: Path = RUN_ROOT) -> list[str]:
    """Kill the nodes of earlier runs whose pytest is gone, and remove their directories."""
    cleaned: list[str] = []
    if not root.is_dir():
        return cleaned
    for run_dir in root.iterdir():
        if not (run_dir.is_dir() and run_dir.name.startswith(PREFIX)):
            continue
        try:
            owner = int((run_dir / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            owner = 0
        if owner and owner != os.getpid() and _pid_alive(owner):
            continue  # another run, still going
        _kill_all(_processes_under(run_dir))
        shutil.rmtree(run_dir, ignore_errors=True)
        cleaned.append(run_dir.name)
    return cleaned


@dataclass
class Node:
    index: int  # 0-based: nodes[index], urls()[index]
    name: str  # e.g. rmc1a2b3n1@localhost
    port: int  # AMQP
    dist_port: int
    base: Path

    @property
    def pid_file(self) -> Path:
        return self.base / "rabbit.pid"

    @property
    def short(self) -> str:
        return self.name.split("@", 1)[0]

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def __str__(self) -> str:
        return self.name


# A node, its position in ``RabbitCluster.nodes`` (0-based), or its name (with or without @host).
NodeRef = Node | int | str


class Depth(NamedTuple):
    """What a queue holds. ``messages`` is more than ready + unacked when a quorum queue keeps
    expired or rejected messages for at-least-once dead-lettering: those count in no other
    column."""

    ready: int
    unacked: int
    messages: int

    @property
    def empty(self) -> bool:
        return self.ready == self.unacked == self.messages == 0


class RabbitCluster:
    """Three RabbitMQ nodes clustered together; see the module's docstring."""

    def __init__(self, size: int = 3, first_port: int = 5681, first_dist_port: int = 25681) -> None:
        self.prefix = f"{PREFIX}{secrets.token_hex(3)}"
        self.run_dir = RUN_ROOT / self.prefix
        self.home = self.run_dir / "home"
        self.env_file = self.run_dir / "rabbitmq-env.conf"
        ports = free_ports(size, first_port)
        dist_ports = free_ports(size, first_dist_port, set(ports))
        self.nodes = [
            Node(
                index=i,
                name=f"{self.prefix}n{i + 1}@{HOST}",
                port=ports[i],
                dist_port=dist_ports[i],
                base=self.run_dir / f"n{i + 1}",
            )
            for i in range(size)
        ]
        self.started_in: float | None = None
        self._down: set[str] = set()  # nodes a test stopped or killed on purpose

    # -- environment and commands ------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        # rabbitmq-env also honours the unprefixed names of rabbitmq-env.conf (NODENAME...).
        unprefixed = {"NODENAME", "NODE_IP_ADDRESS", "NODE_PORT", "CONFIG_FILE", "MNESIA_BASE"}
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k not in unprefixed
        }
        env.update(
            HOME=str(self.home),
            # Our own (empty) env file: /etc/rabbitmq/rabbitmq-env.conf names the main node.
            RABBITMQ_CONF_ENV_FILE=str(self.env_file),
            ERL_EPMD_ADDRESS="127.0.0.1",
            LC_ALL="C.UTF-8",
        )
        return env

    def node_env(self, node: Node) -> dict[str, str]:
        env = self._base_env()
        env.update(
            RABBITMQ_NODENAME=node.name,
            RABBITMQ_NODE_IP_ADDRESS="0.0.0.0",
            RABBITMQ_NODE_PORT=str(node.port),
            RABBITMQ_DIST_PORT=str(node.dist_port),
            RABBITMQ_MNESIA_BASE=str(node.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(node.base / "log"),
            RABBITMQ_CONFIG_FILE=str(node.base / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(node.base / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(node.base / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(node.pid_file),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    def _node(self, ref: NodeRef) -> Node:
        if isinstance(ref, Node):
            return ref
        if isinstance(ref, int):
            # A position in ``nodes``, 0-based, as in ``urls()`` and ``urls(first=...)``.
            return self.nodes[ref]
        for node in self.nodes:
            if ref in (node.name, node.short):
                return node
        raise KeyError(f"no node {ref!r} in {[n.name for n in self.nodes]}")

    def run(
        self,
        tool: str,
        node: NodeRef,
        *args: str,
        timeout: float = 60,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """``TOOL -n NODE -q ARGS`` (rabbitmqctl, rabbitmq-queues, rabbitmq-diagnostics ...)."""
        target = self._node(node)
        try:
            result = subprocess.run(
                [_rabbit_bin(tool), "-n", target.name, "-q", *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=cli_env(self._base_env()),
                cwd=self.run_dir,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"{tool} -n {target.name} {' '.join(args)} timed out after {timeout}s"
            ) from exc
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{tool} -n {target.name} {' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def ctl(self, node: NodeRef, *args: str, timeout: float = 60, attempts: int = 1) -> str:
        """``rabbitmqctl -n NODE -q ARGS``, retried ``attempts`` times; raises on failure."""
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                return self.run("rabbitmqctl", node, *args, timeout=timeout).stdout
            except RuntimeError as exc:
                last = exc
                if attempt + 1 < attempts:
                    time.sleep(1.0)
        assert last is not None
        raise last

    def running(self) -> list[Node]:
        """The nodes we have not stopped or killed on purpose (the ones that should answer)."""
        return [n for n in self.nodes if n.name not in self._down]

    def any_ctl(self, *args: str, timeout: float = 30) -> str:
        """``rabbitmqctl ARGS`` against the first node that answers (of those meant to run)."""
        errors: list[str] = []
        for node in self.running() or self.nodes:
            try:
                return self.ctl(node, *args, timeout=timeout)
            except RuntimeError as exc:
                errors.append(str(exc))
        raise RuntimeError("no node of the cluster answered: " + " | ".join(errors))

    # -- lifecycle ---------------------------------------------------------------------------

    def _write_files(self) -> None:
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "owner.pid").write_text(str(os.getpid()))
        self.home.mkdir()
        cookie = self.home / ".erlang.cookie"
        cookie.write_text("".join(secrets.choice(string.ascii_uppercase) for _ in range(20)))
        cookie.chmod(0o400)
        self.env_file.write_text("# the rm-cluster test nodes: everything is in the environment\n")
        for node in self.nodes:
            (node.base / "mnesia").mkdir(parents=True)
            (node.base / "log").mkdir()
            (node.base / "enabled_plugins").write_text("[rabbitmq_consistent_hash_exchange].\n")
            # Queue lengths (list_queues) are sampled: by default every 5 s, and a quorum
            # queue's only on its Ra tick, also 5 s. Half a second keeps "every queue is
            # empty" and the depth before and after a fault close to the truth. Nothing else:
            # the app asks no broker setting of a cluster (a retry waits in the outbox).
            (node.base / "advanced.config").write_text(
                "[{rabbit, [{quorum_tick_interval, 500}, {collect_statistics_interval, 500}]}].\n"
            )
            (node.base / "rabbitmq.conf").write_text(
                "\n".join(
                    [
                        # guest may log in from the namespace's address (these nodes only).
                        "loopback_users.guest = false",
                        "cluster_partition_handling = pause_minority",
                        "log.console = false",
                        "log.file.level = info",
                        "",
                    ]
                )
            )

    def _launch(self, node: Node) -> None:
        node.pid_file.unlink(missing_ok=True)
        with open(node.base / "log" / "startup.log", "ab") as log:
            subprocess.run(
                [_rabbit_bin("rabbitmq-server"), "-detached"],
                env=self.node_env(node),
                cwd=node.base,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=60,
                check=True,
                close_fds=True,
            )

    def _await_booted(self, node: Node, timeout: float = 90) -> None:
        """The node's pid file written and the rabbit app running (``rabbitmqctl wait``)."""
        try:
            self.run(
                "rabbitmqctl",
                node,
                "wait",
                str(node.pid_file),
                "--timeout",
                str(int(timeout)),
                timeout=timeout + 15,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self.log_tail(node)}") from None

    def log_tail(self, node: NodeRef, lines: int = 30) -> str:
        target = self._node(node)
        parts = []
        for path in sorted((target.base / "log").glob("*.log")):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def cluster_status(self, node: NodeRef | None = None) -> dict[str, Any]:
        args = ("cluster_status", "--formatter", "json")
        out = self.ctl(node, *args, timeout=30) if node is not None else self.any_ctl(*args)
        return dict(json.loads(out))

    def running_members(self, node: NodeRef | None = None) -> set[str]:
        return set(self.cluster_status(node).get("running_nodes") or [])

    def _await_in_cluster(self, node: Node, timeout: float = 60) -> None:
        def member() -> bool:
            try:
                return node.name in self.running_members()
            except RuntimeError:
                return False

        wait_until(member, timeout=timeout, interval=0.5, message=f"{node} running in the cluster")

    def start_all(self) -> None:
        """Start the three nodes and cluster them; the time it took is in ``started_in``."""
        began = time.monotonic()
        cleaned = clean_stale_runs()
        if cleaned:
            print(f"rabbit_cluster: removed stale runs {cleaned}")
        self._write_files()
        self._parallel(self._launch, self.nodes)
        self._parallel(self._await_booted, self.nodes)
        first, *others = self.nodes
        for node in others:
            self.ctl(node, "stop_app", timeout=60)
            self.ctl(node, "join_cluster", first.name, timeout=60)
            self.ctl(node, "start_app", timeout=90)
        members = self.running_members(first)
        expected = {n.name for n in self.nodes}
        if members != expected:
            raise RuntimeError(f"cluster_status shows {sorted(members)}, not {sorted(expected)}")
        self.started_in = time.monotonic() - began
        print(
            f"rabbit_cluster: {len(self.nodes)} nodes {[n.name for n in self.nodes]} on ports "
            f"{[n.port for n in self.nodes]} clustered in {self.started_in:.1f}s"
        )

    @staticmethod
    def _parallel(action: Callable[[Node], None], nodes: Sequence[Node]) -> None:
        errors: list[BaseException] = []

        def run(node: Node) -> None:
            try:
                action(node)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)  # every action has its own, shorter timeout
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop every node (``rabbitmqctl stop``), SIGKILL what is left, remove the run dir."""

        def stop(node: Node) -> None:
            if node.pid() is not None and _pid_alive(node.pid() or 0):
                with contextlib.suppress(Exception):
                    self.run("rabbitmqctl", node, "stop", timeout=30, check=False)

        try:
            if self.run_dir.exists():
                self._parallel(stop, self.nodes)
        finally:
            _kill_all(_processes_under(self.run_dir))
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- faults ------------------------------------------------------------------------------

    def kill_9(self, ref: NodeRef) -> None:
        """SIGKILL the node's beam (from its pid file) and wait until it is gone."""
        node = self._node(ref)
        pid = node.pid()
        if pid is None:
            raise RuntimeError(f"{node} has no pid file: is it running?")
        self._down.add(node.name)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _pid_alive(pid), timeout=30, message=f"{node} (pid {pid}) gone")

    def start(self, ref: NodeRef, timeout: float = 90) -> None:
        """Start a stopped or killed node again (unless it runs) and wait until it runs in the
        cluster."""
        node = self._node(ref)
        pid = node.pid()
        if pid is None or not _pid_alive(pid):
            self._launch(node)
        self._await_booted(node, timeout)
        self._down.discard(node.name)
        self._await_in_cluster(node, timeout)

    def ensure_all_running(self) -> None:
        """Start every node a test left stopped or killed, and lift any memory alarm."""
        for node in self.nodes:
            pid = node.pid()
            if pid is None or not _pid_alive(pid):
                print(f"rabbit_cluster: {node} was down; starting it again")
                self.start(node)
            self._down.discard(node.name)
        # Every node is asked (one rabbitmqctl each, side by side: they are independent).
        alarmed: list[Node] = []

        def check_alarm(node: Node) -> None:
            if self.memory_alarm_on(node):
                alarmed.append(node)

        self._parallel(check_alarm, self.nodes)
        for node in alarmed:
            self.ctl(node, "set_vm_memory_high_watermark", "0.4", timeout=30)
        expected = {n.name for n in self.nodes}
        wait_until(
            lambda: self.running_members() == expected,
            timeout=60,
            interval=0.5,
            message="every node running in the cluster",
        )

    def stop(self, ref: NodeRef, timeout: float = 60) -> None:
        """Stop the node cleanly (``rabbitmqctl stop``, which waits for the process to exit)."""
        node = self._node(ref)
        pid = node.pid()
        self._down.add(node.name)
        self.run("rabbitmqctl", node, "stop", str(node.pid_file), timeout=timeout)
        if pid is not None:
            wait_until(
                lambda: not _pid_alive(pid), timeout=timeout, message=f"{node} (pid {pid}) exited"
            )

    def await_not_quorum_critical(self, ref: NodeRef, timeout: float = 60) -> None:
        """Wait until stopping the node would leave every quorum queue a majority (the rolling
        restart's safety check)."""
        node = self._node(ref)

        def safe() -> bool:
            result = self.run(
                "rabbitmq-queues",
                node,
                "check_if_node_is_quorum_critical",
                timeout=30,
                check=False,
            )
            return result.returncode == 0

        wait_until(safe, timeout=timeout, interval=1.0, message=f"{node} not quorum critical")

    def rolling_restart(
        self, pause: float = 0.0, on_step: Callable[[Node, str], None] | None = None
    ) -> None:
        """Stop and start every node, one after the other, as an operator would: each node only
        once no quorum queue depends on it, the next only once it is back in the cluster."""
        for node in self.nodes:
            self.await_not_quorum_critical(node)
            if on_step is not None:
                on_step(node, "stopping")
            self.stop(node)
            time.sleep(pause)
            if on_step is not None:
                on_step(node, "starting")
            self.start(node)
            if on_step is not None:
                on_step(node, "back")

    def alarms(self, ref: NodeRef) -> list[Any]:
        status = json.loads(self.ctl(ref, "status", "--formatter", "json", timeout=30))
        return list(status.get("alarms") or [])

    def memory_alarm_on(self, ref: NodeRef) -> bool:
        return "memory" in json.dumps(self.alarms(ref))

    @contextlib.contextmanager
    def memory_alarm(self, ref: NodeRef) -> Iterator[Node]:
        """A memory alarm on one node (its watermark far below what it uses) for the body of the
        ``with``: RabbitMQ blocks publishing connections cluster-wide. The default watermark
        (0.4) comes back in a ``finally`` and the alarm is awaited to clear."""
        node = self._node(ref)
        try:
            self.ctl(node, "set_vm_memory_high_watermark", "absolute", "1MB", timeout=30)
            wait_until(
                lambda: self.memory_alarm_on(node),
                timeout=30,
                interval=0.3,
                message=f"a memory alarm on {node}",
            )
            yield node
        finally:
            self.ctl(node, "set_vm_memory_high_watermark", "0.4", timeout=30, attempts=3)
            wait_until(
                lambda: not self.memory_alarm_on(node),
                timeout=60,
                interval=0.3,
                message=f"the memory alarm on {node} to clear",
            )

    # -- what the cluster holds ----------------------------------------------------------------

    def urls(self, vhost: str, host: str = "127.0.0.1", first: int = 0) -> list[str]:
        """One amqp URL per node for ``vhost`` (reached at ``host``), starting with node
        ``first`` (0-based) and going round (a client that tries them in order lands there)."""
        quoted = urllib.parse.quote(vhost, safe="")
        ordered = self.nodes[first:] + self.nodes[:first]
        return [f"amqp://guest:guest@{host}:{n.port}/{quoted}" for n in ordered]

    def url_list(self, vhost: str, host: str = "127.0.0.1", first: int = 0) -> str:
        """:meth:`urls` joined by ``;`` (the form ``BROKER_URL`` takes from an environment)."""
        return ";".join(self.urls(vhost, host, first))

    def add_vhost(self, vhost: str) -> None:
        self.any_ctl("add_vhost", vhost)
        self.any_ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def delete_vhost(self, vhost: str) -> None:
        self.any_ctl("delete_vhost", vhost, timeout=60)

    def queue_depths(self, vhost: str) -> dict[str, Depth]:
        """{queue: Depth(ready, unacked, messages)} for every queue of ``vhost``."""
        out = self.any_ctl(
            "list_queues",
            "-p",
            vhost,
            "name",
            "messages_ready",
            "messages_unacknowledged",
            "messages",
            "--formatter",
            "json",
        )
        return {
            row["name"]: Depth(
                int(row["messages_ready"] or 0),
                int(row["messages_unacknowledged"] or 0),
                int(row["messages"] or 0),
            )
            for row in json.loads(out or "[]")
        }

    def queues(self, vhost: str) -> list[dict[str, Any]]:
        """Every queue of ``vhost`` with its type, leader (quorum) or node (classic), members."""
        out = self.any_ctl(
            "list_queues",
            "-p",
            vhost,
            "name",
            "type",
            "leader",
            "members",
            "online",
            "state",
            "--formatter",
            "json",
        )
        return list(json.loads(out or "[]"))

    def quorum_leader(self, vhost: str, queue: str) -> Node:
        """The node that leads quorum queue ``queue`` now."""
        return self.quorum_leaders(vhost, [queue])[queue]

    def quorum_leaders(self, vhost: str, queues: Sequence[str]) -> dict[str, Node]:
        """{queue: the node that leads it now} for quorum queues ``queues`` (one listing)."""
        rows = {row["name"]: row for row in self.queues(vhost)}
        leaders: dict[str, Node] = {}
        for queue in queues:
            if queue not in rows:
                raise KeyError(f"no queue {queue!r} in vhost {vhost!r}")
            leader = rows[queue].get("leader")
            if not leader:
                raise RuntimeError(f"{queue} has no leader now: {rows[queue]}")
            leaders[queue] = self._node(str(leader))
        return leaders

    def connections(self, vhost: str | None = None) -> list[dict[str, Any]]:
        """Client connections (connection_name, node, port, peer), of ``vhost`` if given."""
        out = self.any_ctl(
            "list_connections",
            "name",
            "vhost",
            "port",
            "peer_host",
            "peer_port",
            "state",
            "client_properties",
            "--formatter",
            "json",
        )
        rows = []
        by_port = {n.port: n for n in self.nodes}
        for row in json.loads(out or "[]"):
            if vhost is not None and row.get("vhost") != vhost:
                continue
            node = by_port.get(int(row.get("port") or 0))
            row["node"] = node.name if node else None
            # ``name`` is the broker's ("peer -> local"); the client's is a client property.
            properties = {item[0]: item[-1] for item in row.pop("client_properties") or []}
            row["connection_name"] = str(properties.get("connection_name", ""))
            rows.append(row)
        return rows

    def node_of_process(self, pid: int, vhost: str | None = None, timeout: float = 30) -> Node:
        """The node the ``manage.py consume`` of ``pid`` consumes through: its connection is
        named ``consume pid=<pid>`` (a connection named with more after that, such as a
        publishing connection of its own, counts only when there is no plain one)."""
        return self.nodes_of_processes([pid], vhost, timeout)[pid]

    def nodes_of_processes(
        self, pids: Sequence[int], vhost: str | None = None, timeout: float = 30
    ) -> dict[int, Node]:
        """:meth:`node_of_process` for several processes, from one connection listing per
        look (waiting until each of them has a connection)."""

        def node_of(rows: list[dict[str, Any]], pid: int) -> Node | None:
            name = f"consume pid={pid}"
            found = [r for r in rows if r["connection_name"].startswith(name)]
            found.sort(key=lambda r: r["connection_name"] != name)
            for row in found:
                if row["node"]:
                    return self._node(row["node"])
            return None

        def find() -> dict[int, Node] | None:
            rows = self.connections(vhost)
            placed = {pid: node_of(rows, pid) for pid in pids}
            if any(node is None for node in placed.values()):
                return None
            return {pid: node for pid, node in placed.items() if node is not None}

        names = ", ".join(f"'consume pid={pid}'" for pid in pids)
        nodes = wait_until(find, timeout=timeout, interval=0.5, message=f"a connection {names}")
        assert isinstance(nodes, dict)
        return nodes


@contextlib.contextmanager
def rabbit_cluster_running(size: int = 3) -> Iterator[RabbitCluster]:
    """A started cluster for the body of the ``with``; torn down in a ``finally``."""
    cluster = RabbitCluster(size)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.close()
