"""Write the settings table of ``docs/reference/settings.md`` from the declarations in
``reliable_messaging/conf.py``.

Only the part between the two marker comments is generated; the prose around it is written by
hand. ``tests/unit/test_settings_reference.py`` fails when the committed page differs from what
the declarations give, so a new or changed setting reaches the reference in the same commit.

Usage: ``python scripts/settings_reference.py`` rewrites the page;
``python scripts/settings_reference.py --check`` only says whether it is current (exit 1 if not).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reliable_messaging.conf import Setting

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "settings.md"
START = (
    "<!-- settings table: generated from reliable_messaging/conf.py by "
    "scripts/settings_reference.py; edit the declarations, not this table -->"
)
END = "<!-- end of the generated settings table -->"


def _shown_default(value: Any) -> str:
    if isinstance(value, timedelta):
        if not value.seconds and not value.microseconds:
            return f"timedelta(days={value.days})"
        return f"timedelta(seconds={value.total_seconds():g})"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return repr(list(value))
    return str(value)


def reference_table(settings: Sequence[Setting[Any]]) -> str:
    """The settings reference's Markdown table, one row per declaration."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for setting in settings:
        # A "|" would end the cell; escaped, it shows (also inside a code span).
        default, doc = (
            text.replace("|", "\\|") for text in (_shown_default(setting.default), setting.doc)
        )
        rows.append(f"| `{setting.key}` | `{default}` | {doc} |")
    return "\n".join(rows) + "\n"


def rendered(page: str) -> str:
    """``page`` with the text between the markers replaced by the table of the declarations."""
    # The checkout's package, not an installed copy of another version.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from reliable_messaging.conf import SETTINGS

    before, found, rest = page.partition(START)
    _, found_end, after = rest.partition(END)
    if not found or not found_end:
        raise SystemExit(f"{PAGE}: the markers {START!r} and {END!r} are missing")
    return f"{before}{START}\n{reference_table(SETTINGS)}{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether it is current")
    args = parser.parse_args(argv)
    current = PAGE.read_text(encoding="utf-8")
    wanted = rendered(current)
    if current == wanted:
        return 0
    if args.check:
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                wanted.splitlines(keepends=True),
                "committed",
                "declared",
            )
        )
        print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/settings_reference.py")
        return 1
    PAGE.write_text(wanted, encoding="utf-8")
    print(f"rewrote the settings table of {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
