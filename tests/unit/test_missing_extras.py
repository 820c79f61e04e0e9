"""An optional feature imported without its extra says which extra to install.

Each case runs in a fresh interpreter where the optional package cannot be imported
(``sys.modules[name] = None`` makes ``import name`` raise ImportError), as on a machine that
installed the package without that extra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None
import django
django.setup()
try:
    {statement}
except ImportError as exc:
    print(type(exc).__name__, "|", exc)
else:
    print("imported")
"""


def import_without(hidden: list[str], statement: str) -> str:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.setdefault("RM_TEST_NAMESPACE", "extras")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(hidden=hidden, statement=statement)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("hidden", "statement", "extra", "missing"),
    [
        (["celery"], "from reliable_messaging import idempotent_task", "celery", "celery"),
        (["celery"], "import reliable_messaging.contrib.celery", "celery", "celery"),
        (["celery"], "import reliable_messaging.tasks", "celery", "celery"),
        (
            ["health_check", "health_check.base"],
            "from reliable_messaging.contrib.health_check import MessagingHealthCheck",
            "health",
            "django-health-check",
        ),
    ],
)
def test_the_error_names_the_extra_to_install(
    hidden: list[str], statement: str, extra: str, missing: str
) -> None:
    said = import_without(hidden, statement)
    assert said.startswith("MissingExtra |"), said
    assert f'pip install "reliable-messaging[{extra}]"' in said
    assert missing in said


def test_with_the_extra_installed_the_same_imports_work() -> None:
    assert import_without([], "from reliable_messaging import idempotent_task") == "imported"
    assert (
        import_without(
            [], "from reliable_messaging.contrib.health_check import MessagingHealthCheck"
        )
        == "imported"
    )
