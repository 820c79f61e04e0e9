"""The documentation site builds with warnings as errors: a broken link, a page missing from the
navigation or a public API whose docstring cannot be read fails here, not on a reader."""

from __future__ import annotations

import os
import subprocess
import sys
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
