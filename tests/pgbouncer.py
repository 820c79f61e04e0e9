"""A PgBouncer of the suite's own, in transaction pooling mode, in front of the local PostgreSQL.

Debian's ``pgbouncer`` (``make test`` installs it), run as the ``postgres`` user (it refuses
root) with an ini, a pid file, a log and a unix-socket directory of its own under a temporary
directory, on a free port (another when a process takes it before pgbouncer binds it); killed
with the process that started it.
``* = host=127.0.0.1 port=5432`` lets any database name through; ``pools`` adds entries of their
own (``default_pool_size`` per entry, e.g. a pool of one server connection). Used by the session
fixture of ``tests/conftest.py`` and by ``bench/pgbouncer.py``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

RUN_AS = "postgres"


def binary() -> str | None:
    """The pgbouncer executable, or None: Debian puts it in /usr/sbin, not always on PATH."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


class PortTaken(RuntimeError):
    """pgbouncer could not bind its port: another process took it after it was found free."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One pgbouncer process; :meth:`url` gives a DSN through it. Stop it with :meth:`stop`."""

    # Ports tried: one found free may be taken by another process before pgbouncer binds it.
    PORT_TRIES = 3

    def __init__(self, pools: Mapping[str, str] | None = None, pool_size: int = 40) -> None:
        self.exe = binary()
        if self.exe is None:
            raise RuntimeError("pgbouncer is not installed: apt-get install pgbouncer")
        self.pools = dict(pools or {})
        self.pool_size = pool_size
        self.dir = Path(tempfile.mkdtemp(prefix="rm-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"
        for attempt in range(1, self.PORT_TRIES + 1):
            self.port = free_port()
            self.process = self._start()
            try:
                self._wait_listening(20)
                return
            except PortTaken:
                self._end_process()
                if attempt == self.PORT_TRIES:
                    self.stop()
                    raise
            except BaseException:
                self.stop()
                raise

    def _start(self) -> subprocess.Popen[bytes]:
        entries = [f"{name} = {spec}" for name, spec in self.pools.items()]
        entries.append("* = host=127.0.0.1 port=5432")
        (self.dir / "pgbouncer.ini").write_text(
            "\n".join(
                [
                    "[databases]",
                    *entries,
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    f"unix_socket_dir = {self.dir}",
                    f"pidfile = {self.dir / 'pgbouncer.pid'}",
                    f"logfile = {self.log}",
                    "auth_type = trust",
                    f"auth_file = {self.dir / 'users.txt'}",
                    "pool_mode = transaction",
                    f"default_pool_size = {self.pool_size}",
                    "max_client_conn = 500",
                    # The pooler as most deploy it: nothing reset between clients in
                    # transaction mode (server_reset_query applies to session mode only).
                    "ignore_startup_parameters = extra_float_digits,options",
                    # Idle server connections handed out oldest first: a client's successive
                    # transactions move between them, as on a busy pooler.
                    "server_round_robin = 1",
                    "",
                ]
            )
        )
        (self.dir / "users.txt").write_text('"postgres" ""\n"root" ""\n')
        self.log.unlink(missing_ok=True)
        user = pwd.getpwnam(RUN_AS)
        for path in [self.dir, *self.dir.iterdir()]:
            os.chown(path, user.pw_uid, user.pw_gid)
        # setpriv (util-linux) makes the kernel kill pgbouncer when the process that started
        # it dies, even by SIGKILL, so no pytest leaves one behind. The user is changed before
        # (a change of user clears that signal: pgbouncer's own -u would).
        root = os.geteuid() == 0
        return subprocess.Popen(
            ["setpriv", "--pdeathsig=KILL", str(self.exe), str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=self.dir,
            user=user.pw_uid if root else None,
            group=user.pw_gid if root else None,
            extra_groups=[] if root else None,
        )

    def _wait_listening(self, timeout: float) -> None:
        """Until pgbouncer says it listens on its port (a connection alone could reach another
        process that took the port); :class:`PortTaken` if it says it cannot (it then goes on,
        on its unix socket alone)."""
        deadline = time.monotonic() + timeout
        listening = f"listening on 127.0.0.1:{self.port}"
        taken = f"cannot listen on 127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            logs = self.logs()
            if taken in logs:
                raise PortTaken(f"pgbouncer: {taken}")
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited ({self.process.returncode}): {logs[-2000:]}")
            if listening in logs:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", self.port), timeout=1),
                ):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen on {self.port} in {timeout}s")

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgres://{user}@127.0.0.1:{self.port}/{database}"

    def logs(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop it (its server connections close with it) and remove its directory."""
        self._end_process()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _end_process(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # immediate shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextlib.contextmanager
def running(pools: Mapping[str, str] | None = None) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(pools)
    try:
        yield bouncer
    finally:
        bouncer.stop()


@contextlib.contextmanager
def routed(host: str, port: int, name: str, alias: str = "default") -> Iterator[None]:
    """Send this process's connections to ``alias`` (and the subprocesses' whose URL the tests
    build from it) to ``host:port/name`` until the block ends: every connection of the alias
    opened after this point, on any thread, goes there."""
    from django.db import connections

    from reliable_messaging.publishing.wake_after_commit import sender

    settings_dict = connections[alias].settings_dict
    saved = {key: settings_dict.get(key) for key in ("HOST", "PORT", "NAME")}

    def reconnect() -> None:
        connections[alias].close()
        sender.flush(timeout=5)
        sender.close()  # it reads the connection parameters afresh

    reconnect()
    settings_dict.update(HOST=host, PORT=port, NAME=name)
    try:
        yield
    finally:
        reconnect()
        settings_dict.update(saved)
