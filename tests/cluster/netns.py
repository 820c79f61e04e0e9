"""A consumer host of its own: a network namespace joined to this machine by a veth pair.

:func:`consumer_host` creates a namespace (a unique name), a veth pair (host side
``10.213.A.B+1/30``, namespace side ``+2``, a /30 no interface of this machine uses yet), brings
``lo`` up inside, and starts a TCP forwarder (``forward.py``, a process of its own) from the
host's veth address, port 15432, to PostgreSQL on 127.0.0.1:5432 (which listens on localhost
only). The RabbitMQ cluster's nodes listen on 0.0.0.0, so the namespace reaches them at the
host's veth address directly. Everything is removed in a ``finally``.

:meth:`ConsumerHost.partition` cuts the namespace off: an nftables table *inside the
namespace* drops every packet in and out except on loopback (a black hole, not a reject: the
peers see silence, as with a pulled cable). :meth:`ConsumerHost.heal` deletes the table.
:class:`NetnsConsumeProcess` runs ``manage.py consume`` inside with ``ip netns exec`` (which
execs the command: the process keeps the pid the test sees).
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support import MANAGE, ROOT, ConsumeProcess, wait_until

FORWARDER = Path(__file__).with_name("forward.py")
SUBNET = ipaddress.ip_network("10.213.0.0/16")
TABLE = "rm_partition"


def run(*args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def _addresses_in_use() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = run("ip", "-o", "-4", "addr", "show").stdout
    used = set()
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            used.add(ipaddress.ip_interface(fields[fields.index("inet") + 1]).ip)
    return used


def _free_slash30() -> ipaddress.IPv4Network:
    used = _addresses_in_use()
    for _ in range(200):
        block = secrets.randbelow(SUBNET.num_addresses // 4) * 4
        net = ipaddress.ip_network(f"{SUBNET.network_address + block}/30")
        if not any(address in net for address in used):
            return net  # type: ignore[return-value]
    raise RuntimeError(f"no free /30 in {SUBNET}")


@dataclass
class ConsumerHost:
    """A namespace and its veth pair; see the module's docstring."""

    name: str
    host_veth: str
    host_ip: str
    ns_ip: str
    pg_port: int
    forwarder: subprocess.Popen[str] | None = None
    partitioned: bool = False

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def ns_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(*self.exec_prefix(), *args, check=check)

    def database_url(self, name: str, user: str = "postgres") -> str:
        """The test database, as the namespace reaches it (through the forwarder)."""
        return f"postgres://{user}@{self.host_ip}:{self.pg_port}/{name}"

    def partition(self) -> None:
        """Drop every packet into and out of the namespace but loopback's (a black hole)."""
        rules = (
            f"add table inet {TABLE}\n"
            f"add chain inet {TABLE} input {{ type filter hook input priority -300; "
            "policy drop; }\n"
            f"add chain inet {TABLE} output {{ type filter hook output priority -300; "
            "policy drop; }\n"
            f'add rule inet {TABLE} input iifname "lo" accept\n'
            f'add rule inet {TABLE} output oifname "lo" accept\n'
        )
        result = subprocess.run(
            [*self.exec_prefix(), "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nft -f in {self.name} failed: {result.stderr.strip()}")
        self.partitioned = True

    def heal(self) -> None:
        """Remove the black hole."""
        if self.ns_run("nft", "list", "table", "inet", TABLE, check=False).returncode == 0:
            self.ns_run("nft", "delete", "table", "inet", TABLE)
        self.partitioned = False

    @contextlib.contextmanager
    def partitioned_for_body(self) -> Iterator[None]:
        """:meth:`partition` for the body of the ``with``, :meth:`heal` in a ``finally``."""
        try:
            self.partition()
            yield
        finally:
            self.heal()

    def reaches(self, host: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from inside the namespace to ``host:port`` opens."""
        code = (
            "import socket,sys\n"
            f"s=socket.create_connection(({host!r},{port}),timeout={timeout})\n"
            "s.close()\n"
        )
        result = subprocess.run(
            [*self.exec_prefix(), sys.executable, "-c", code],
            capture_output=True,
            timeout=timeout + 10,
            check=False,
        )
        return result.returncode == 0


def _start_forwarder(host: ConsumerHost) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(FORWARDER), host.host_ip, str(host.pg_port), "127.0.0.1", "5432"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )

    def listening() -> bool:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the forwarder exited with {proc.returncode}: {out}")
        with contextlib.suppress(OSError):
            socket.create_connection((host.host_ip, host.pg_port), timeout=1).close()
            return True
        return False

    wait_until(listening, timeout=20, interval=0.1, message="the PostgreSQL forwarder listening")
    return proc


@contextlib.contextmanager
def consumer_host(pg_port: int = 15432) -> Iterator[ConsumerHost]:
    """A namespace with a veth pair and a PostgreSQL forwarder; all removed in a ``finally``."""
    tag = secrets.token_hex(3)
    net = _free_slash30()
    host_ip, ns_ip = (str(a) for a in list(net.hosts())[:2])
    host = ConsumerHost(
        name=f"rmns{tag}", host_veth=f"rmh{tag}", host_ip=host_ip, ns_ip=ns_ip, pg_port=pg_port
    )
    ns_veth = f"rmn{tag}"
    created_ns = False
    try:
        run("ip", "netns", "add", host.name)
        created_ns = True
        run("ip", "link", "add", host.host_veth, "type", "veth", "peer", "name", ns_veth)
        run("ip", "link", "set", ns_veth, "netns", host.name)
        run("ip", "addr", "add", f"{host_ip}/30", "dev", host.host_veth)
        run("ip", "link", "set", host.host_veth, "up")
        host.ns_run("ip", "addr", "add", f"{ns_ip}/30", "dev", ns_veth)
        host.ns_run("ip", "link", "set", ns_veth, "up")
        host.ns_run("ip", "link", "set", "lo", "up")
        host.forwarder = _start_forwarder(host)
        yield host
    finally:
        if host.forwarder is not None:
            host.forwarder.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.forwarder.wait(10)
            if host.forwarder.stdout is not None:
                host.forwarder.stdout.close()
        # Deleting the namespace deletes its end of the veth pair, and with it the host's end.
        run("ip", "link", "del", host.host_veth, check=False)
        if created_ns:
            run("ip", "netns", "del", host.name, check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            links = run("ip", "-o", "link", "show", check=False).stdout
            if host.host_veth not in links:
                break
            time.sleep(0.1)


class NetnsConsumeProcess(ConsumeProcess):
    """``manage.py consume`` run inside a namespace (``ip netns exec NS python manage.py``)."""

    def __init__(
        self,
        host: ConsumerHost,
        args: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        settings: str = "tests.settings",
    ) -> None:
        # ManageProcess.__init__ builds its command line itself; this is it, with the prefix.
        self.args = list(args)
        self.log_path = log_path
        self.host = host
        self._log_file = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            [
                *host.exec_prefix(),
                sys.executable,
                str(MANAGE),
                self.command,
                "--settings",
                settings,
                *self.args,
            ],
            cwd=ROOT,
            env=dict(env),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
