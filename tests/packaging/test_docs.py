"""The documentation site builds with warnings as errors: a broken link, a page missing from the
navigation or a public API whose docstring cannot be read fails here, not on a reader. The
testing guide's code is the code a test runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly_with_every_page_and_the_api(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    pages = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in (".", "getting-started", "concepts", "reference/settings", "reference/api"):
        assert page in pages, sorted(pages)
    api = (site / "reference" / "api" / "index.html").read_text()
    # Rendered from the docstrings, not only listed.
    assert "Write a message to the outbox" in api
    assert "Register" in api and "deliver" in api


# A block of tests/integration/test_testing_guide.py, and the guide's block that shows it.
MARKED = re.compile(
    r"^# --8<-- \[start:(?P<name>\w+)\]\n(?P<code>.*?)^# --8<-- \[end:(?P=name)\]$",
    re.MULTILINE | re.DOTALL,
)
SHOWN = re.compile(
    r"^<!-- tested: (?P<name>\w+) -->\n```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL
)


def test_every_code_block_of_the_testing_guide_is_code_a_test_runs() -> None:
    guide = (ROOT / "docs" / "testing-handlers.md").read_text()
    module = (ROOT / "tests" / "integration" / "test_testing_guide.py").read_text()
    tested = {m["name"]: textwrap.dedent(m["code"]).strip() for m in MARKED.finditer(module)}
    shown = [(m["name"], m["code"].strip()) for m in SHOWN.finditer(guide)]
    # Every code block of the guide says which tested block it is, and shows each one once.
    assert guide.count("```") == 2 * len(shown), (
        "a code block of docs/testing-handlers.md is not a ```python block preceded by "
        "<!-- tested: NAME -->"
    )
    assert sorted(name for name, _ in shown) == sorted(tested)
    for name, code in shown:
        assert code == tested[name], (
            f"docs/testing-handlers.md's block {name!r} is not the code of "
            f"tests/integration/test_testing_guide.py between its {name} markers"
        )


def test_the_benchmarks_summary_only_copies_figures_of_its_sections() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    start = page.index("## Summary")
    end = page.index("\n## ", start + 1)
    summary, sections = page[start:end], page[:start] + page[end:]
    rows = [line for line in summary.splitlines() if line.startswith("| [")]
    headings = set(re.findall(r"^## (.+)$", sections, re.MULTILINE))
    assert len(rows) == len(headings), "one summary row per section"
    for row in rows:
        link = re.match(r"\| \[(?P<title>[^\]]+)\]\(#[\w-]+\)", row)
        assert link and link["title"] in headings, row
        for figure in re.findall(r"\d[\d,.]*\d|\d", row):
            assert re.search(rf"(?<![\d,.]){re.escape(figure)}(?![\d,]|\.\d)", sections), (
                f"{figure} in the summary row {link['title']!r} is in no section"
            )
