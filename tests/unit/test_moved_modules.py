"""Old import paths that users typed keep working, with one ``DeprecationWarning`` that names
the new path and points at the importing line; in-repo code imports the new paths only.

Each case runs in a subprocess: a module is imported once per process, so the warning (and its
absence on a second import) can only be seen in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SHIMS = [
    (
        "reliable_messaging.health",
        "reliable_messaging.contrib.health_check",
        ["MessagingHealthCheck"],
    ),
    (
        "reliable_messaging.tasks",
        "reliable_messaging.contrib.celery",
        [
            "P",
            "R",
            "KEY_MAX_LENGTH",
            "HASHED_KEY_PREFIX",
            "CELERY_TASK_ID_HEADER",
            "relay_outbox",
            "inbox_key",
            "UnsafeTask",
            "unsafe_idempotent_tasks",
            "idempotent_task",
        ],
    ),
    (
        "reliable_messaging.views",
        "reliable_messaging.ops.views",
        [
            "MAX_OUTBOX_LAG",
            "BROKER_TIMEOUT",
            "BROKER_CHECK_MAX_AGE",
            "ops_access",
            "BROKER_COLLECTOR",
            "SYSTEM_REGISTRY",
            "SystemMetricsView",
            "metrics",
            "check_database",
            "check_broker",
            "RECENT_BROKER_CHECK",
            "check_outbox_lag",
            "healthz",
        ],
    ),
]
QUIET: list[tuple[str, str, str]] = [
    ("reliable_messaging.tasks", "reliable_messaging.contrib.celery", "celery"),
]


def run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(("old", "new", "names"), SHIMS)
def test_old_path_warns_once_at_the_importer(old: str, new: str, names: list[str]) -> None:
    result = run(
        f"""
        import warnings
        import django

        django.setup()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import {old}
            import {old}
        ours = [
            w for w in caught
            if issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message)
        ]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert ours[0].filename == "<string>", ours[0].filename
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("old", "new", "names"), SHIMS)
def test_old_path_is_an_error_under_error_filter(old: str, new: str, names: list[str]) -> None:
    result = run(
        f"""
        import warnings
        import django

        django.setup()
        warnings.simplefilter("error", DeprecationWarning)
        try:
            import {old}
        except DeprecationWarning as exc:
            assert {new!r} in str(exc), str(exc)
        else:
            raise SystemExit("no DeprecationWarning")
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("old", "new", "quiet"), QUIET)
def test_discovery_by_name_is_quiet_and_registers(old: str, new: str, quiet: str) -> None:
    # A framework importing the old path during discovery (Celery's autodiscover_tasks imports
    # <app>.tasks) is not a user typing it: no warning, and the new module is imported.
    code = f"import importlib; importlib.import_module({old!r})"
    result = run(
        f"""
        import sys
        import warnings
        import django

        django.setup()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec({code!r}, {{"__name__": "{quiet}.discovery"}})
        ours = [str(w.message) for w in caught if {new!r} in str(w.message)]
        assert not ours, ours
        assert {new!r} in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("old", "new", "names"), SHIMS)
def test_old_path_names_are_the_new_objects(old: str, new: str, names: list[str]) -> None:
    result = run(
        f"""
        import importlib
        import warnings
        import django

        django.setup()
        warnings.simplefilter("ignore", DeprecationWarning)
        old_module = importlib.import_module({old!r})
        new_module = importlib.import_module({new!r})
        for name in {names!r}:
            assert getattr(old_module, name) is getattr(new_module, name), name
        """
    )
    assert result.returncode == 0, result.stderr
