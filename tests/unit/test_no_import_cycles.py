"""No import circles in ``reliable_messaging``, read from the source with :mod:`ast`.

Every ``import`` and ``from ... import`` counts, wherever it is written: at module level, inside
a function or method (an import hidden in a method is how the metrics ⇄ status circle stayed
out of sight), and under ``if TYPE_CHECKING:`` (a dependency for the type checker is still a
dependency of the design). An import names the module it loads: ``from .status import x`` is an
edge to ``status``, ``from . import collectors`` an edge to ``collectors``; the packages on the
way (``reliable_messaging/__init__.py``) are not counted, or every module would be in a circle
with its package.

:data:`CHECKED` lists the modules whose circles fail the test; ``None``, as now, is the
whole package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import reliable_messaging

PACKAGE = "reliable_messaging"
ROOT = Path(reliable_messaging.__file__).resolve().parent

CHECKED: frozenset[str] | None = None  # the whole package

# The one circle allowed, typing-only: a Django model owns its manager, and the manager's
# methods are typed with the model (``DeadLetter.objects.mark_replayed(dead_letter)``), which
# ``managers`` imports under ``TYPE_CHECKING`` only (checked below).
TYPING_ONLY = frozenset({f"{PACKAGE}.managers", f"{PACKAGE}.models"})


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package, *parts])] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: Iterable[str]) -> set[str]:
    """The modules of ``known`` that one import statement in ``module`` loads."""
    known = set(known)
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        # Relative: from the module's own package, one level up per extra dot.
        base_parts = module.split(".") if is_package else module.split(".")[:-1]
        if node.level > 1:
            base_parts = base_parts[: -(node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in known:  # from package import module
            found.add(submodule)
        elif base in known:  # from module import name
            found.add(base)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _imported(node, module, is_package, modules)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion), each sorted; every import circle lies within one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def circles_through(
    graph: Mapping[str, Iterable[str]], checked: frozenset[str] | None
) -> list[list[str]]:
    """The cycles with at least one module of ``checked`` in them (all of them for None)."""
    return [c for c in cycles(graph) if checked is None or checked.intersection(c)]


def test_no_import_circle_through_the_checked_modules() -> None:
    graph = import_graph()
    if CHECKED is not None:
        missing = CHECKED - graph.keys()
        assert not missing, f"not modules of {PACKAGE}: {sorted(missing)}"
    found = [c for c in circles_through(graph, CHECKED) if frozenset(c) != TYPING_ONLY]
    assert not found, "import circles (each a set of modules importing each other): " + "; ".join(
        " ⇄ ".join(c) for c in found
    )


def test_the_graph_sees_imports_inside_functions_and_relative_forms(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import x\n    return x\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nx = 1\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("from ..c import y\n")
    graph = import_graph(pkg, "pkg")
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.sub": {"pkg.a", "pkg.sub.d"},
        "pkg.sub.d": {"pkg.c"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert circles_through(graph, frozenset({"pkg.sub.d"})) == []
    assert circles_through(graph, frozenset({"pkg.b"})) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_metrics_status_circle_would_be_found() -> None:
    graph = import_graph()
    graph[f"{PACKAGE}.ops.collectors"] = {
        *graph[f"{PACKAGE}.ops.collectors"],
        f"{PACKAGE}.ops.status",
    }
    assert circles_through(graph, CHECKED), "a planted circle went unseen"


def test_the_managers_import_the_models_for_the_type_checker_only() -> None:
    tree = ast.parse((ROOT / "managers.py").read_text(encoding="utf-8"))
    at_runtime = [
        node
        for node in tree.body  # module level, outside ``if TYPE_CHECKING:``
        if isinstance(node, ast.ImportFrom) and node.module == "models" and node.level == 1
    ]
    inside_functions = [
        node
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and node.module == "models"
    ]
    assert not at_runtime and not inside_functions
