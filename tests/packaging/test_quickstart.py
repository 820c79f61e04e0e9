"""The getting-started page (docs/getting-started.md), followed literally by a new user on the
newest supported versions.

The wheel is built as ``make dist`` builds it and installed with its ``postgres`` extra and
Django 6.1 into a fresh virtualenv of Python 3.13 (from this machine's pyenv). A project made by
``django-admin startproject`` gets an ``orders`` app (``startapp``), then every ``python`` code
block of that page whose first line is a comment naming its file alone (``# orders/models.py``),
as it is written: the settings and URL blocks appended to the project's files, the others as the
files they name. A block whose first line says more (``# orders/consumers.py, later: ...``) is
an illustration and is not written. Only what differs on this machine is set after them: the
database (PostgreSQL, a database of the test's own) and the broker's vhost (one of the test's
own). Then ``migrate``, ``consume``, ``relay``, and an order placed through the view; its
handler must charge it once and publish ``payment.captured``, which nothing consumes (unrouted).
Then the page's "see it fail" ending: an order over the limit is dead-lettered, the limit is
raised as the page says, and ``replay_dead_letters --consumer <queue>`` has it charged once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests import support

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
DJANGO = "Django~=6.1.0"
PYTHON = "3.13"

APPENDED = {"settings.py": "mysite/settings.py", "urls.py": "mysite/urls.py"}


def quickstart_blocks() -> dict[str, str]:
    """{file named in the block's first line: the block} of the getting-started page."""
    blocks: dict[str, str] = {}
    for code in re.findall(r"```python\n(.*?)```", GETTING_STARTED.read_text(), flags=re.DOTALL):
        first = code.splitlines()[0]
        if match := re.fullmatch(r"# (\S+\.py)", first.strip()):
            blocks[match.group(1)] = code
    return blocks


def python313() -> str:
    # The interpreter itself, not pyenv's shim (which answers only for the global version).
    installed = sorted((Path.home() / ".pyenv" / "versions").glob(f"{PYTHON}.*/bin/python3"))
    found = str(installed[-1]) if installed else shutil.which(f"python{PYTHON}")
    if found is None:
        pytest.fail(f"Python {PYTHON} is missing (this machine kind has it under ~/.pyenv)")
    return found


def run(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    result = subprocess.run(
        list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, (
        f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def place(python: str, project: Path, env: dict[str, str], amount: str) -> int:
    """Place an order through the page's view, as a browser on the developer's machine would
    (DEBUG allows localhost): the id of the order."""
    placed = run(
        python,
        "manage.py",
        "shell",
        "-c",
        "from django.test import Client; response = Client(HTTP_HOST='localhost')"
        f".post('/orders/', {{'amount': {amount!r}}}); "
        "print(response.status_code, response.content.decode()[-500:]); "
        "print(response.json()['order'])",
        cwd=project,
        env=env,
    )
    return int(last_line(placed))


def last_line(said: str) -> str:
    """What a ``shell -c`` printed last (Django 6's shell first says what it imported)."""
    return said.strip().splitlines()[-1]


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture
def database() -> Iterator[str]:
    name = f"rm_quickstart_{uuid.uuid4().hex[:10]}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as db:
        db.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(
            "postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True
        ) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def vhost() -> Iterator[str]:
    name = f"rm-quickstart-{uuid.uuid4().hex[:10]}"
    support.rabbitmqctl("add_vhost", name)
    try:
        support.rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield name
    finally:
        support.rabbitmqctl("delete_vhost", name)


def test_getting_started_works_on_django_61_and_python_313(
    tmp_path: Path, database: str, vhost: str
) -> None:
    blocks = quickstart_blocks()
    assert set(blocks) == {
        "settings.py",
        "orders/models.py",
        "orders/consumers.py",
        "orders/views.py",
        "urls.py",
    }

    dist = tmp_path / "dist"
    # The sdist, then the wheel from it, as `make dist` builds them: a wheel built straight from
    # the checkout would take whatever an earlier build left in its build/ directory.
    run(sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT), cwd=ROOT)
    (wheel,) = dist.glob("reliable_messaging-*.whl")

    venv = tmp_path / "venv"
    run(python313(), "-m", "venv", str(venv), cwd=tmp_path)
    python = str(venv / "bin" / "python")
    run(python, "-m", "pip", "install", "--quiet", f"{wheel}[postgres]", DJANGO, cwd=tmp_path)
    versions = run(
        python,
        "-c",
        "import django, sys; print(sys.version_info[:2], django.VERSION[:2])",
        cwd=tmp_path,
    )
    assert versions.split() == ["(3,", "13)", "(6,", "1)"], versions

    project = tmp_path / "project"
    project.mkdir()
    run(str(venv / "bin" / "django-admin"), "startproject", "mysite", ".", cwd=project)
    run(python, "manage.py", "startapp", "orders", cwd=project)
    for name, code in blocks.items():
        target = project / APPENDED.get(name, name)
        if name in APPENDED:
            target.write_text(target.read_text() + "\n" + code)
        else:
            target.write_text(code)
    broker = support.broker_url(vhost)
    with (project / "mysite" / "settings.py").open("a") as settings:
        settings.write(
            "\n# This machine's services (what a user sets to theirs):\n"
            "DATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {database!r}, 'USER': 'postgres', 'HOST': '127.0.0.1', 'PORT': 5432}}}}\n"
            f'RELIABLE_MESSAGING["BROKER_URL"] = {broker!r}\n'
        )

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "RM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    run(python, "manage.py", "makemigrations", "orders", cwd=project, env=env)
    run(python, "manage.py", "migrate", cwd=project, env=env)
    run(python, "manage.py", "check", cwd=project, env=env)

    processes: list[subprocess.Popen[str]] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("consume", "relay")}

    def start(name: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [python, "manage.py", name],
            cwd=project,
            env=env,
            stdout=logs[name].open("w"),
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        if name == "consume":
            support.wait_until(
                lambda: "consuming" in logs["consume"].read_text(),
                timeout=60,
                message="consume subscribed",
            )
        return process

    try:
        for name in ("consume", "relay"):  # in the order the page gives
            processes.append(start(name))
        order = place(python, project, env, "9.99")
        query = (
            "from orders.models import Payment; from reliable_messaging.models import "
            "OutboxMessage; print(list(Payment.objects.values_list('order_id', 'amount')), "
            "sorted(OutboxMessage.objects.values_list('routing_key', 'status')))"
        )
        # payment.captured has no consumer in the quickstart: sent, and marked unrouted.
        expected = (
            f"[({order}, Decimal('9.99'))] "
            "[('order.placed', 'sent'), ('payment.captured', 'unrouted')]"
        )
        deadline = time.monotonic() + 60
        seen = ""
        while time.monotonic() < deadline:
            said = run(python, "manage.py", "shell", "-c", query, cwd=project, env=env)
            seen = last_line(said)
            if seen == expected:
                break
            time.sleep(1)
        assert seen == expected, (seen, {k: v.read_text()[-3000:] for k, v in logs.items()})
        consumed = logs["consume"].read_text()
        assert "processed message_id=" in consumed and "orders.consumers.charge_order" in consumed

        # See it fail, then replay it: over the limit, the charge is dead-lettered.
        declined = place(python, project, env, "2500")
        dead = (
            "from reliable_messaging.models import DeadLetter; print(list(DeadLetter.objects"
            ".values_list('consumer', 'queue', 'reason', 'status')))"
        )
        # Known by its consumer's name, over its queue; straight from PermanentError.
        letter = "[('orders.consumers.charge_order', 'billing.charge-order', 'permanent', 'dead')]"
        support.wait_until(
            lambda: (
                last_line(run(python, "manage.py", "shell", "-c", dead, cwd=project, env=env))
                == letter
            ),
            timeout=60,
            message="the declined charge dead-lettered",
        )
        # The page's fix, then consume restarted to load it.
        consumers = project / "orders" / "consumers.py"
        fixed = consumers.read_text().replace(
            'CHARGE_LIMIT = Decimal("1000")', 'CHARGE_LIMIT = Decimal("5000")'
        )
        assert fixed != consumers.read_text()
        consumers.write_text(fixed)
        stop(processes.pop(0))
        logs["consume"] = tmp_path / "consume-fixed.log"
        processes.append(start("consume"))
        replayed = subprocess.run(
            [python, "manage.py", "replay_dead_letters", "--consumer", "billing.charge-order"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert "replayed 1 dead letter(s)" in replayed.stdout, replayed.stdout
        assert "queue of consumer orders.consumers.charge_order" in replayed.stderr
        payments = (
            "from orders.models import Payment; from reliable_messaging.models import "
            "DeadLetter; print(list(Payment.objects.order_by('pk').values_list('order_id', "
            "'amount')), list(DeadLetter.objects.values_list('status', flat=True)))"
        )
        expected = f"[({order}, Decimal('9.99')), ({declined}, Decimal('2500.00'))] ['resolved']"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen = last_line(
                run(python, "manage.py", "shell", "-c", payments, cwd=project, env=env)
            )
            if seen == expected:
                break
            time.sleep(1)
        assert seen == expected, (seen, {k: v.read_text()[-3000:] for k, v in logs.items()})
    finally:
        for process in processes:
            stop(process)
