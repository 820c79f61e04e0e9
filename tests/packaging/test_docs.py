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


# Links that land on a heading: `page.md#anchor` must name a heading of that page, with the ids
# MkDocs gives headings (its Markdown toc extension: lowercase, spaces to hyphens, punctuation
# dropped, a repeated title suffixed _1, _2...). MkDocs itself only reports a wrong anchor at the
# INFO level, and reads neither the README, the CHANGELOG nor the package's strings.
DOCS = ROOT / "docs"
MARKDOWN_EXTENSIONS = ["tables", "admonition", "toc", "pymdownx.superfences"]
HREF = re.compile(r'<a [^>]*href="(?P<href>[^"]+)"')


def _render(page: Path) -> tuple[set[str], list[str]]:
    """The heading ids of a Markdown page, and the targets of its links, as MkDocs reads them
    (fenced code shows no heading or link)."""
    import markdown  # type: ignore[import-untyped]

    md = markdown.Markdown(extensions=MARKDOWN_EXTENSIONS)
    html = md.convert(page.read_text())
    ids: set[str] = set()
    pending = list(md.toc_tokens)
    while pending:
        token = pending.pop()
        ids.add(token["id"])
        pending.extend(token["children"])
    return ids, [m["href"].replace("&amp;", "&") for m in HREF.finditer(html)]


def _headings() -> dict[Path, set[str]]:
    return {page: _render(page)[0] for page in DOCS.rglob("*.md")}


def _broken(source: str, target: str, base: Path, headings: dict[Path, set[str]]) -> str | None:
    """Why the link `target`, found in `source` and read relative to `base`, lands nowhere, or
    None when it lands on a page of the docs (and on its heading, when it names one)."""
    path, _, anchor = target.partition("#")
    if "://" in path or path.startswith("mailto:") or not (path.endswith(".md") or not path):
        return None
    page = (base / path).resolve() if path else base
    if path and page not in headings:
        return f"{source}: {target} names no page of docs/"
    if anchor and anchor not in headings[page]:
        return f"{source}: {target} names no heading of {page.relative_to(ROOT)}"
    return None


def test_every_link_into_the_docs_lands_on_a_page_and_heading() -> None:
    headings = _headings()
    assert "ordered-consumers" in headings[DOCS / "concepts.md"]  # the ids are MkDocs' own
    problems = []
    for page in sorted(headings):
        for target in _render(page)[1]:
            # A link within the page (`#anchor`) is read against the page itself.
            base = page if target.startswith("#") else page.parent
            problems.append(_broken(str(page.relative_to(ROOT)), target, base, headings))
    for name in ("README.md", "CHANGELOG.md"):
        for target in _render(ROOT / name)[1]:
            if target.startswith("docs/"):
                problems.append(_broken(name, target, ROOT, headings))
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)


# A test the docs cite as the proof of what they say: `tests/path.py::test_name`.
CITED_TEST = re.compile(r"(?P<path>tests/[\w/]+\.py)::(?P<name>test_\w+)")


def test_every_test_the_docs_cite_exists() -> None:
    """A test renamed or removed leaves no claim of the docs without its proof."""
    missing = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for cited in CITED_TEST.finditer(page.read_text()):
            path = ROOT / cited["path"]
            if not path.exists() or not re.search(
                rf"^\s*(?:async )?def {cited['name']}\(", path.read_text(), re.MULTILINE
            ):
                missing.append(f"{page.relative_to(ROOT)}: {cited[0]}")
    assert not missing, "\n".join(missing)


# The package's messages, hints and docstrings that send a reader to the docs: `docs/page.md`,
# or `../page.md` in the settings' descriptions (written into docs/reference/settings.md).
PACKAGE_LINK = re.compile(r"(?:docs/|\.\./)(?P<page>[\w/-]+\.md)(?:#(?P<anchor>[\w-]+))?")


def test_every_link_of_the_package_into_the_docs_lands_on_a_page_and_heading() -> None:
    headings = _headings()
    problems, found = [], 0
    package = ROOT / "reliable_messaging"
    for source in sorted(package.rglob("*")):
        if source.suffix not in {".py", ".yml", ".html", ".txt"}:
            continue
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for link in PACKAGE_LINK.finditer(line):
                found += 1
                target = link["page"] + (f"#{link['anchor']}" if link["anchor"] else "")
                where = f"{source.relative_to(ROOT)}:{number}"
                problems.append(_broken(where, target, DOCS, headings))
    assert found, "no link of the package into the docs found: is the pattern still right?"
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
