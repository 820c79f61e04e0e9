"""An operation's page in a real headless browser: its replays' outcomes come in while the page
is open (it refreshes itself until none is in flight), and the dead letters that failed again
are listed with links to their pages. And the confirmation page's "Dry run" button.

Also renders the screenshot of the page in the docs; ``RM_UPDATE_SCREENSHOTS=1`` writes it to
docs/images/replay-ledger.png (otherwise only to the test's temporary directory).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from reliable_messaging.choices import ReplayOutcome
from reliable_messaging.dead_letters import ledger
from reliable_messaging.dead_letters.operations import run_pending_operations
from reliable_messaging.dead_letters.selection import selection_from_query
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
    Replay,
)

from .test_dead_letter_console import TIMEOUT_MS, dead_letter

pytestmark = pytest.mark.slow

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "replay-ledger.png"


def settle(rows: list[Replay], outcome: ReplayOutcome, failed: bool = False) -> None:
    """What the consumer records as it decides the copies (``ledger.settle``, once it found
    the row a copy names): the row's outcome and its operation's tally."""
    for row in rows:
        failed_as = row.dead_letter if failed else None
        ledger.settle_row(row, outcome, using="default", failed_as=failed_as)


def test_the_operation_page_shows_the_replays_outcomes_as_they_come_in(
    page: Page, tmp_path: Path
) -> None:
    billing = ("billing.charge-order", "shop.billing")
    for n in range(24):
        dead_letter(
            *billing,
            {"order_id": 1100 + n, "amount": "19.90"},
            message_id=f"order-{1100 + n}",
            minutes_ago=30 + n,
            exception_type="builtins.ConnectionError",
            exception_message="payment gateway timed out",
        )
    top = DeadLetter.objects.order_by("-pk").values_list("pk", flat=True).first()
    selection = selection_from_query({"consumer": billing[0]})
    selection["description"] = f"consumer = {billing[0]}"
    operation = DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection,
        requested_by="alice (admin)",
        force=False,
        matched=24,
        max_pk=top or 0,
    )
    run_pending_operations()
    rows = list(Replay.objects.filter(operation=operation).order_by("pk"))
    assert len(rows) == 24

    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    page.goto(f"{page.url}operations/{operation.pk}/")
    expect(page.locator("#rm-ledger-in-flight")).to_have_text("24")
    expect(page.locator("#rm-ledger-processed")).to_have_text("0")

    # The consumers decide the copies while the page is open: it refreshes itself.
    settle(rows[:10], ReplayOutcome.PROCESSED)
    expect(page.locator("#rm-ledger-processed")).to_have_text("10", timeout=TIMEOUT_MS)
    expect(page.locator("#rm-ledger-in-flight")).to_have_text("14")

    settle(rows[10:19], ReplayOutcome.PROCESSED)
    settle(rows[19:21], ReplayOutcome.DUPLICATE)
    settle(rows[21:], ReplayOutcome.FAILED_AGAIN, failed=True)
    for row in rows[21:]:  # they failed again, as the consumer records it
        DeadLetter.objects.filter(pk=row.dead_letter_id).update(
            status="dead",
            replay_count=1,
            exception_message="payment gateway timed out (again)",
        )
    expect(page.locator("#rm-ledger-in-flight")).to_have_text("0", timeout=TIMEOUT_MS)
    expect(page.locator("#rm-ledger-processed")).to_have_text("19")
    expect(page.locator("#rm-ledger-duplicate")).to_have_text("2")
    expect(page.locator("#rm-ledger-failed-again")).to_have_text("3")
    links = page.locator("#rm-ledger-failed-again-list a")
    expect(links).to_have_count(3)

    target = tmp_path / "replay-ledger.png"
    page.screenshot(path=str(target))

    # A failed-again letter's link opens its page.
    first = rows[21].dead_letter_id
    expect(links.first).to_have_text(f"#{first}")
    links.first.click()
    page.wait_for_url(f"**/deadletter/{first}/change/")

    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("RM_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, SCREENSHOT)


def test_the_dry_run_button_shows_what_a_replay_would_do(page: Page) -> None:
    shipping = ("shipping.ship-order", "shop.shipping")
    for n in range(3):
        dead_letter(*shipping, {"order_id": 1200 + n}, message_id=f"ship-{1200 + n}")
    ProcessedMessage.objects.create(consumer=shipping[0], message_id="ship-1202")
    page.goto(f"{page.url}replay-matching/?consumer={shipping[0]}")

    page.get_by_role("button", name="Dry run").click()
    expect(page.locator("#rm-dry-run-done")).to_have_text("2")
    expect(page.locator("#rm-dry-run-refused")).to_have_text("1")
    expect(page.locator("#rm-dry-run-reasons")).to_contain_text("already processed")

    # Forced, the processed one would run again; still nothing is written.
    page.get_by_label("Force").check()
    page.get_by_role("button", name="Dry run").click()
    expect(page.locator("#rm-dry-run-done")).to_have_text("3")
    expect(page.locator("#rm-dry-run-refused")).to_have_text("0")
    assert Replay.objects.count() == OutboxMessage.objects.count() == 0
    assert set(DeadLetter.objects.values_list("status", flat=True)) == {"dead"}
