"""The benchmarks still fit the package: the functions ``bench/cpu_budget.py`` charges each
part of a process to exist, and every script type-checks against the package; a renamed
function would otherwise break a benchmark only when someone runs it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BUDGET = Path(__file__).resolve().parents[2] / "bench" / "cpu_budget.py"


def _parts() -> dict[str, dict[str, tuple[str, ...]]]:
    for node in ast.parse(BUDGET.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "PARTS" for t in targets):
                assert node.value is not None
                parts: dict[str, dict[str, tuple[str, ...]]] = ast.literal_eval(node.value)
                return parts
    raise AssertionError("bench/cpu_budget.py has no PARTS")


TARGETS = [target for kind in _parts().values() for targets in kind.values() for target in targets]


@pytest.mark.parametrize("target", TARGETS)
def test_each_charged_function_of_the_cpu_budget_exists(target: str) -> None:
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    for name in path.removesuffix("@cm").split("."):
        owner = getattr(owner, name)
    assert callable(owner), target


def test_the_benchmarks_type_check_against_the_package(tmp_path: Path) -> None:
    """Every bench/ script under mypy with the package's own types: a function renamed or a
    signature changed in the package fails here, not the next time someone runs the
    benchmark (pika's and Django's private attributes a benchmark borrows are marked)."""
    bench = BUDGET.parent
    modules = [arg for path in sorted(bench.glob("*.py")) for arg in ("-m", path.stem)]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), *modules],
        cwd=bench.parent,
        env={**os.environ, "MYPYPATH": str(bench)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
