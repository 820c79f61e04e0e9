"""The functions ``bench/cpu_budget.py`` charges each part of a process to exist: a renamed
function would otherwise break the CPU budget's benchmark only when someone runs it."""

from __future__ import annotations

import ast
import importlib
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
