"""docs/design.md stays true to the code it names, and module docstrings stay summaries.

Every dotted ``reliable_messaging.…`` name on the page must resolve: a renamed or removed module,
class or function fails here, so the page cannot describe code that is gone. The design essays
live on that page; a module's docstring says what the module does and why, in a few lines.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reliable_messaging"
DESIGN = ROOT / "docs" / "design.md"

# A module docstring longer than this is an essay: its explanation belongs on docs/design.md.
MAX_DOCSTRING_WORDS = 150

DOTTED = re.compile(r"`(reliable_messaging(?:\.\w+)+)`")


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted`` and getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            found: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # this prefix is not a module: try a shorter one
            raise
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def named_in_design_doc() -> list[str]:
    return sorted(set(DOTTED.findall(DESIGN.read_text())))


def test_every_name_the_design_page_gives_exists() -> None:
    names = named_in_design_doc()
    assert len(names) > 50, names  # the pattern still finds the page's names
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "docs/design.md names what the package does not have:\n" + "\n".join(
        missing
    )


def test_a_name_that_does_not_exist_is_caught() -> None:
    for name in (
        "reliable_messaging.publishing.relay.Relay",
        "reliable_messaging.no_such_module",
        "reliable_messaging.consuming.no_such_module.Thing",
    ):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            continue
        raise AssertionError(f"{name} resolved")


def docstring_words() -> dict[str, int]:
    words = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "migrations":
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text()))
        words[relative.as_posix()] = len(docstring.split()) if docstring else 0
    return words


def test_every_module_docstring_is_a_summary() -> None:
    words = docstring_words()
    too_long = {module: count for module, count in words.items() if count > MAX_DOCSTRING_WORDS}
    assert not too_long, (
        f"module docstrings over {MAX_DOCSTRING_WORDS} words (say what the module does and "
        f"why; move the design explanation to docs/design.md): {too_long}"
    )
