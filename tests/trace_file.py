"""The demo's trace-file tools (``demo_project/tracing.py``), loaded from their file: importing
the ``demo_project`` package would create the demo's Celery app and make it Celery's current app,
which the suite's Celery tests and workers must not find there."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "demo_project" / "tracing.py"
    spec = importlib.util.spec_from_file_location("tests_trace_file_tools", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tools = _load()
configure_from_env = tools.configure_from_env
read_spans = tools.read_spans
render_tree = tools.render_tree
