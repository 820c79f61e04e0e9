"""The version matrix: the suite's version-sensitive slice on each supported (Python, Django)
pair, and once on the lowest versions ``setup.cfg`` admits, against the real services.

    .venv/bin/nox -l                                   # the sessions
    .venv/bin/nox -s "matrix(python='3.13', django='6.1')"   # one pair
    .venv/bin/nox -s matrix lowest                     # everything (about 15 minutes here)
    .venv/bin/nox -s ci                                # what `make test` adds: newest + lowest

``make test`` runs the whole suite on the default pair (requirements.txt); these sessions run
what depends on the versions: unit tests, the admin (in a browser too, but for the lowest
versions), publish and the relay, the consumer end to end, replay, the Celery integration, the
django.tasks backend, declared payloads (pydantic), status and health, and the migrations. Each
session has a virtualenv of its own under ``.nox/``; the services are the ones ``make
services`` starts. The Python versions come from this machine's pyenv (``~/.pyenv/versions``)
when they are not on PATH.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["matrix", "lowest"]

ROOT = Path(__file__).resolve().parent

# Supported upstream today: Django 5.2 LTS (Python 3.10-3.14), 6.0 and 6.1 (Python 3.12+).
DJANGO_PYTHONS = {"5.2": ("3.11", "3.12", "3.13"), "6.0": ("3.12", "3.13"), "6.1": ("3.12", "3.13")}
PYTHONS = ("3.11", "3.12", "3.13")
NEWEST = ("3.13", "6.1")

# The lowest version of every runtime requirement and extra that setup.cfg admits.
LOWEST = (
    "Django==5.2",
    "pika==1.3.0",
    "prometheus-client==0.24.1",
    "psycopg[binary]==3.1.8",
    "celery==5.3.0",
    "django-redis==5.4.0",
    "django-health-check==4.8.0",
    # The otel extra's floor, and the SDK of the same release for the tests that record spans.
    "opentelemetry-api==1.20.0",
    "opentelemetry-sdk==1.20.0",
    # The django.tasks backport, the framework on Django 5.2 (the "tasks" extra's floor).
    "django-tasks==0.12.0",
    # The contracts extra's floor (declared payloads as pydantic models).
    "pydantic==2.0",
)

# The version-sensitive slice (see the docstring).
SLICE = (
    "tests/unit",
    "tests/integration/admin",
    "tests/browser",
    "tests/integration/publishing/test_publish.py",
    "tests/integration/publishing/test_relay.py",
    "tests/integration/publishing/test_scheduled_rows.py",
    "tests/integration/consuming/test_deliver.py",
    "tests/integration/broker/test_write_coalescing.py",
    "tests/integration/test_migrations.py",
    "tests/e2e/test_consume_command.py",
    "tests/e2e/test_replay_end_to_end.py",
    # Spans recorded by real processes: the OpenTelemetry API and SDK of each end.
    "tests/e2e/test_tracing.py",
    "tests/integration/celery_tasks/test_idempotent_task.py",
    # The django.tasks backend: the backport on Django 5.2, the framework itself on 6.0 and 6.1.
    "tests/integration/tasks",
    "tests/integration/ops/test_command_progress.py",
    "tests/integration/ops/test_health.py",
    "tests/integration/ops/test_messaging_status.py",
    "tests/integration/ops/test_verdicts.py",
    "tests/integration/ops/test_views.py",
    # Declared payloads: pydantic's errors and serializer, and Django's admin and replay pages.
    "tests/integration/contracts/test_declared_payloads.py",
    "tests/integration/contracts/test_versions.py",
    # The AsyncAPI document: each payload's JSON Schema is pydantic's (the demo's committed
    # document is checked against what this session's pydantic writes), the task message's is
    # the task backend's.
    "tests/integration/contracts/test_asyncapi.py",
)

# What the slice needs beside the package's own requirements: requirements.txt less the pins
# a session sets itself and the tools it does not run (linters, type stubs, packaging).
NOT_IN_SESSIONS = re.compile(
    r"^(django|pika|prometheus-client|psycopg|celery|django-redis|django-health-check|"
    r"opentelemetry-.*|pydantic|ruff|mypy|django-stubs|types-.*|build|nox|asyncapi3)\b",
    re.IGNORECASE,
)


# Printed by every session, so that its log says what it ran on.
VERSIONS = (
    "import sys; from importlib.metadata import version; print('Python', sys.version.split()[0], "
    "*(f'{name} {version(name)}' for name in ('Django', 'pika', 'prometheus-client', 'psycopg', "
    "'celery', 'django-redis', 'django-health-check')))"
)


def _pyenv_on_path() -> None:
    versions = Path.home() / ".pyenv" / "versions"
    if not versions.is_dir():
        return
    wanted = [str(p / "bin") for v in PYTHONS for p in sorted(versions.glob(f"{v}.*"))]
    os.environ["PATH"] = os.pathsep.join([*wanted, os.environ.get("PATH", "")])


_pyenv_on_path()


def _test_requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [
        line.strip()
        for line in lines
        if line.strip() and not line.startswith("#") and not NOT_IN_SESSIONS.match(line.strip())
    ]


def _run_slice(session: nox.Session, leave_out: tuple[str, ...] = ()) -> None:
    session.run("python", "-m", "pip", "check")
    session.run("python", "-c", VERSIONS)
    session.run("python", "-m", "django", "check", "--settings", "tests.settings")
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        # Three workers on two cores, scheduled as make test's parallel part: much of the slice
        # waits on real processes and the broker.
        "-n",
        "3",
        "--dist",
        "worksteal",
        "-m",
        "not serial",
        *(path for path in SLICE if path not in leave_out),
        *session.posargs,
        env={"RM_MATRIX_SESSION": session.name},
    )


@nox.session
@nox.parametrize(
    "python,django",
    [(python, django) for django, pythons in DJANGO_PYTHONS.items() for python in pythons],
)
def matrix(session: nox.Session, django: str) -> None:
    """The slice on one (Python, Django) pair, with the newest release of that Django."""
    session.install(*_test_requirements(), f"Django~={django}.0")
    # The package itself with the newest versions its requirements admit (its extras too).
    # Django 6.0 and later have the task framework; 5.2 takes the backport (the "tasks" extra).
    extras = "postgres,celery,redis,health,otel,contracts" + (",tasks" if django == "5.2" else "")
    session.install("-e", f".[{extras}]", "opentelemetry-sdk")
    _run_slice(session)


@nox.session(python=PYTHONS[0])
def lowest(session: nox.Session) -> None:
    """The slice on the oldest Python with the lowest version of every requirement."""
    session.install(*_test_requirements(), *LOWEST)
    session.install("--no-deps", "-e", ".")
    # The browser tests drive Django's admin, the one requirement whose lowest version (5.2.0)
    # differs from the default pair's (the newest 5.2) by patch releases only.
    _run_slice(session, leave_out=("tests/browser",))


@nox.session(python=False)
def ci(session: nox.Session) -> None:
    """The newest pair and the lowest versions: the matrix's two ends, run by `make test`."""
    session.notify(f"matrix(python='{NEWEST[0]}', django='{NEWEST[1]}')")
    session.notify("lowest")
