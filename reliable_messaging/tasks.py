"""Moved to :mod:`reliable_messaging.contrib.celery`.

This import path keeps working for a while. Importing it warns once per process
(``DeprecationWarning``, pointing at the importing line) and imports the new module at once: a
framework imports this path by name during discovery (celery) and expects what the module registers
(tasks) to be registered; that import does not warn, since the user typed nothing.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

_NEW = "reliable_messaging.contrib.celery"


def _importer_is_quiet() -> bool:
    frame = sys._getframe(2)  # 0: this function, 1: the module body
    # importlib's frames (import machinery, importlib.import_module) are not the importer.
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen")
        or str(frame.f_globals.get("__name__", "")).split(".")[0] == "importlib"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return False
    top = str(frame.f_globals.get("__name__", "")).split(".")[0]
    return top in ("celery",)


if not _importer_is_quiet():
    warnings.warn(
        f"reliable_messaging.tasks moved to {_NEW}; import from there",
        DeprecationWarning,
        stacklevel=2,
    )

importlib.import_module(_NEW)


def __getattr__(name: str) -> Any:
    value = getattr(importlib.import_module(_NEW), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(sys.modules.get(_NEW) or importlib.import_module(_NEW))))
