"""Moved to :mod:`reliable_messaging.contrib.health_check`.

This import path keeps working for a while. Importing it warns once per process
(``DeprecationWarning``, pointing at the importing line); every name is looked up in the new module
when it is first used, so nothing optional is imported before a name is asked for.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

_NEW = "reliable_messaging.contrib.health_check"


warnings.warn(
    f"reliable_messaging.health moved to {_NEW}; import from there",
    DeprecationWarning,
    stacklevel=2,  # the warnings module skips importlib's frames: this is the importer
)


def __getattr__(name: str) -> Any:
    value = getattr(importlib.import_module(_NEW), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(sys.modules.get(_NEW) or importlib.import_module(_NEW))))
