"""Shared set-up of the benchmarks: a dedicated database and exchange, and small helpers."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DB = os.environ.get("RM_BENCH_DB", "rm_bench")
# Another PostgreSQL server than the shared one on 5432: one with autovacuum on, say, whose
# settings a benchmark needs without changing everyone's.
PG_PORT = os.environ.get("RM_BENCH_PG_PORT", "5432")
DATABASE_URL = f"postgres://postgres@127.0.0.1:{PG_PORT}/{BENCH_DB}"
BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def psql(sql: str, *, check: bool = False) -> None:
    """Run ``sql`` with psql as postgres on the bench's server (its output kept quiet)."""
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", PG_PORT, "-U", "postgres", "-qc", sql],
        capture_output=True,
        check=check,
    )


@dataclass(frozen=True)
class Build:
    """A source tree to benchmark; with ``database``, on a database of its own that its own
    migrations make (an older build's schema is not this checkout's), named ``bench_*``."""

    root: Path
    database: str | None = None


def parse_build_list(spec: str | None) -> dict[str, Build]:
    """``--builds NAME=PATH[@DATABASE],...``: source trees to run in turn, each on the bench
    database or on its own; this checkout alone when None."""
    if not spec:
        return {"this checkout": Build(ROOT)}
    builds = {}
    for item in spec.split(","):
        name, _, where = item.partition("=")
        path, _, database = where.partition("@")
        if database and not database.startswith("bench_"):
            raise SystemExit(
                f"{database}: a build's own database is dropped and made again, "
                "so its name must start with bench_"
            )
        builds[name] = Build(Path(path), database or None)
    return builds


def parse_builds(spec: str | None) -> dict[str, Path]:
    """``--builds NAME=PATH,NAME=PATH`` for the benchmarks that run every build on the bench
    database (so on this checkout's schema)."""
    builds = parse_build_list(spec)
    if any(build.database for build in builds.values()):
        raise SystemExit("this benchmark runs every build on the bench database: no @DATABASE")
    return {name: build.root for name, build in builds.items()}


def build_side(build: Build, namespace: str, *args: str) -> dict[str, Any]:
    """Run bench/_build_side.py's ``args`` in ``build``'s tree on its own database; its
    answer."""
    assert build.database is not None
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "_build_side.py"), *args],
        env={
            **os.environ,
            "RM_TEST_NAMESPACE": namespace,
            "DATABASE_URL": database_url_for(build.database),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(build.root),
            "RM_LOG_LEVEL": "WARNING",
        },
        cwd="/tmp",  # not this checkout: the build's own package must be the one imported
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{build.root}: _build_side.py {' '.join(args)}: {result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def prepare_build_databases(builds: dict[str, Build], namespace: str) -> None:
    """Each build with a database of its own gets it afresh, migrated by its own tree."""
    for build in builds.values():
        if build.database is not None:
            recreate_database(build.database)
            build_side(build, namespace, "migrate")


def setup_django(namespace: str | None = None) -> str:
    """Point Django at the bench database with a fresh exchange; returns the namespace."""
    namespace = namespace or f"bench{uuid.uuid4().hex[:8]}"
    os.environ["RM_TEST_NAMESPACE"] = namespace
    os.environ["DATABASE_URL"] = DATABASE_URL
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    sys.path.insert(0, str(ROOT))
    psql(f"CREATE DATABASE {BENCH_DB}")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    return namespace


def subprocess_env(namespace: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "RM_TEST_NAMESPACE": namespace,
        "DATABASE_URL": DATABASE_URL,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(pct / 100 * (len(ordered) - 1))))
    return ordered[index]


def describe_machine() -> str:
    cores = os.cpu_count()
    rabbit = subprocess.run(["rabbitmqctl", "-q", "version"], capture_output=True, text=True)
    pg = subprocess.run(["psql", "--version"], capture_output=True, text=True)
    return (
        f"{cores} cores, Python {sys.version.split()[0]}, RabbitMQ "
        f"{rabbit.stdout.strip() or '?'} (loopback), {pg.stdout.strip()} (local)"
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# --------------------------------------------------------------------------- soak helpers


def database_url_for(name: str) -> str:
    return f"postgres://postgres@127.0.0.1:{PG_PORT}/{name}"


def recreate_database(name: str) -> str:
    """Drop database ``name`` if it exists and create it empty; returns its URL."""
    for sql in (f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}"):
        psql(sql, check=True)
    return database_url_for(name)


def drop_database(name: str) -> None:
    psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def setup_django_on(database_url: str, namespace: str) -> None:
    """Like :func:`setup_django`, on ``database_url`` (already created) with the suite's
    settings (tests.settings, so tests.testapp's consumers) and ``namespace``; migrates."""
    os.environ["RM_TEST_NAMESPACE"] = namespace
    os.environ["DATABASE_URL"] = database_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def vm_rss_kib(pid: int) -> int | None:
    """Resident memory of process ``pid`` in KiB (VmRSS of /proc/<pid>/status), or None."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rabbitmqctl(*args: str, timeout: float = 150) -> str:
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"rabbitmqctl {' '.join(args)} failed: {result.stderr.strip() or result.stdout}"
        )
    return result.stdout


def declare_sink(exchange: str, queue: str, binding: str = "bench.#") -> None:
    """The bench's topic ``exchange`` and a durable ``queue`` bound to it by ``binding``,
    emptied."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    channel.exchange_declare(exchange, "topic", durable=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_bind(queue, exchange, binding)
    channel.queue_purge(queue)
    connection.close()


def drop_sink(exchange: str | None, queue: str) -> None:
    """Delete ``queue``, and ``exchange`` unless None."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(BROKER_URL))
    channel = connection.channel()
    channel.queue_delete(queue)
    if exchange is not None:
        channel.exchange_delete(exchange)
    connection.close()


# --------------------------------------------------------------------------- CPU time


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has spent, all its threads (``utime`` and
    ``stime`` of /proc/<pid>/stat), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The command name may hold spaces: the fields after its closing parenthesis.
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def backend_pids(cursor: object, application_name: str) -> list[int]:
    """The pids of the PostgreSQL backends serving connections opened with
    ``application_name`` (a process given ``PGAPPNAME`` names every libpq connection it opens)."""
    cursor.execute(  # type: ignore[attr-defined]
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [application_name]
    )
    return [row[0] for row in cursor.fetchall()]  # type: ignore[attr-defined]
