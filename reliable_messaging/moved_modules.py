"""The old import paths of modules that moved when the package was put in layers.

Each old path (``reliable_messaging.health``, ``.tasks``, ``.views``) is a module of two lines
that calls :func:`forward`: importing it warns ``DeprecationWarning`` once per process, pointing
at the importing line, and every name is looked up in the new module when it is first used, so
nothing optional (Celery, django-health-check) is imported before a name is asked for.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any


def _importer(depth: int) -> str:
    """The top-level package of the code importing the old path (importlib's frames aside)."""
    frame = sys._getframe(depth)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen")
        or str(frame.f_globals.get("__name__", "")).split(".")[0] == "importlib"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    return "" if frame is None else str(frame.f_globals.get("__name__", "")).split(".")[0]


def forward(
    old: str, new: str, *, eager: bool = False, quiet_importers: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Called from the body of module ``old``: warn, and return the module's ``__getattr__``
    and ``__dir__``, which look names up in ``new``.

    ``eager`` imports ``new`` at once, for an old path a framework imports by name during
    discovery and expects what the module registers to be registered (Celery's tasks); an
    import by a package of ``quiet_importers`` (that framework) does not warn, since the user
    typed nothing."""
    # 0: _importer, 1: forward, 2: the old module's body, 3: its importer.
    if _importer(3) not in quiet_importers:
        warnings.warn(
            f"{old} moved to {new}; import from there",
            DeprecationWarning,
            stacklevel=3,  # the warnings module skips importlib's frames: this is the importer
        )
    if eager:
        importlib.import_module(new)
    namespace = sys.modules[old].__dict__

    def __getattr__(name: str) -> Any:
        value = getattr(importlib.import_module(new), name)
        namespace[name] = value  # the next lookup does not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(dir(importlib.import_module(new))))

    return __getattr__, __dir__
