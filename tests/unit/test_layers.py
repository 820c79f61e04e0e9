"""The package's layers, as ``docs/development.md`` draws them, checked on its import graph.

Read with :mod:`ast` from the source (see :mod:`tests.unit.test_no_import_cycles`), so an import
inside a function or under ``TYPE_CHECKING`` counts too:

- ``core/`` imports neither Django nor pika, and nothing of the package outside ``core/`` but
  ``exceptions``;
- only ``broker/`` imports pika;
- ``consuming/``, ``publishing/`` and ``ops/`` never import each other;
- a tier imports only tiers below it: nothing below tier 5 (admin, management commands, contrib,
  tasks, urls, testing, apps) imports tier 5; nothing in tiers 1 to 3 imports ``consuming/``,
  ``publishing/`` or ``ops/``; ``broker/``, ``dead_letters/`` and the other tier-3 modules
  import no ORM layer above the models;
- no import circles anywhere (:mod:`tests.unit.test_no_import_cycles`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.unit.test_no_import_cycles import PACKAGE, ROOT, import_graph, module_names

P = PACKAGE

# Tier 5: what nothing else in the package may import.
TOP = (
    f"{P}.admin",
    f"{P}.management",
    f"{P}.contrib",
    f"{P}.urls",
    f"{P}.testing",
    f"{P}.testing_broker",
    f"{P}.apps",
    f"{P}.checks",
    f"{P}.tasks",
)
# Tier 4: siblings.
SIBLINGS = (f"{P}.consuming", f"{P}.publishing", f"{P}.ops")
CORE_MAY_IMPORT = (f"{P}.core", f"{P}.exceptions")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file (``django``, ``pika``, ...)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


GRAPH = import_graph()
FILES = module_names(ROOT, PACKAGE)


def _violations(rule: str) -> list[str]:
    found = []
    for module, imported in sorted(GRAPH.items()):
        for target in sorted(imported):
            if rule == "core" and _within(module, (f"{P}.core",)):
                if not _within(target, CORE_MAY_IMPORT):
                    found.append(f"{module} -> {target}")
            elif rule == "siblings":
                for sibling in SIBLINGS:
                    if (
                        _within(module, (sibling,))
                        and _within(target, SIBLINGS)
                        and not _within(target, (sibling,))
                    ):
                        found.append(f"{module} -> {target}")
            elif rule == "top" and not _within(module, TOP) and _within(target, TOP):
                if module != PACKAGE:  # the package's lazy public names (publish, ...)
                    found.append(f"{module} -> {target}")
            elif (
                rule == "below-siblings"
                and not _within(module, TOP + SIBLINGS)
                and module != PACKAGE
                and _within(target, SIBLINGS)
            ):
                found.append(f"{module} -> {target}")
    return found


@pytest.mark.parametrize(
    ("rule", "what"),
    [
        ("core", "core/ imports only core/ and exceptions"),
        ("siblings", "consuming/, publishing/ and ops/ never import each other"),
        ("top", "nothing imports admin, management, contrib, urls, testing, apps or a shim"),
        ("below-siblings", "tiers 1 to 3 never import consuming/, publishing/ or ops/"),
    ],
)
def test_layer_rule(rule: str, what: str) -> None:
    found = _violations(rule)
    assert not found, f"{what}; broken by: " + ", ".join(found)


def test_core_imports_neither_django_nor_pika() -> None:
    found = [
        f"{module} imports {name}"
        for module, path in sorted(FILES.items())
        if _within(module, (f"{P}.core",))
        for name in sorted(_third_party_imports(path) & {"django", "pika"})
    ]
    assert not found, found


def test_only_broker_imports_pika() -> None:
    found = [
        module
        for module, path in sorted(FILES.items())
        if "pika" in _third_party_imports(path) and not _within(module, (f"{P}.broker",))
    ]
    assert not found, f"pika imported outside broker/: {found}"


def test_the_rules_see_a_planted_breach() -> None:
    """The checks above can fail: a sibling import and a core import of Django are found."""
    GRAPH[f"{P}.consuming.service"] = {*GRAPH[f"{P}.consuming.service"], f"{P}.publishing.relay"}
    GRAPH[f"{P}.core.envelope"] = {*GRAPH[f"{P}.core.envelope"], f"{P}.models"}
    try:
        assert _violations("siblings") == [f"{P}.consuming.service -> {P}.publishing.relay"]
        assert f"{P}.core.envelope -> {P}.models" in _violations("core")
    finally:
        GRAPH[f"{P}.consuming.service"].discard(f"{P}.publishing.relay")
        GRAPH[f"{P}.core.envelope"].discard(f"{P}.models")


# What Django, Celery or a user looks for at the package root; everything else has a tier's home.
ROOT_MODULES = {
    "__init__",
    "apps",
    "checks",
    "choices",
    "conf",
    "exceptions",
    "managers",
    "metrics",
    "models",
    "tasks",
    "testing",
    "testing_broker",
    "tracing",
    "urls",
}


def test_the_package_root_holds_only_what_is_looked_for_there() -> None:
    found = {path.stem for path in ROOT.glob("*.py")}
    assert found - ROOT_MODULES == set(), "a new module at the root: give it a tier's home"
    assert ROOT_MODULES - found == set()


def test_the_reading_guide_names_modules_that_exist() -> None:
    """docs/development.md's "where to start reading" table names real modules."""
    text = (ROOT.parent / "docs" / "development.md").read_text(encoding="utf-8")
    text = text.split("Where to start reading", 1)[1].split("[How it is built]", 1)[0]
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)`", text))
    assert "consuming/retries.py" in named and "publishing/sent.py" in named
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"docs/development.md names modules that do not exist: {missing}"
