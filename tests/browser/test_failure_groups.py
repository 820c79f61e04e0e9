"""The failure groups page in a real headless browser: each group's state badge, and the
Acknowledge button with a note, through the real form (its CSRF token included).

Also renders the screenshot of the page in the docs; ``RM_UPDATE_SCREENSHOTS=1`` writes it to
docs/images/failure-groups.png (otherwise only to the test's temporary directory).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import Page

from reliable_messaging.models import FailureGroupState

from .test_dead_letter_console import dead_letter

pytestmark = pytest.mark.slow

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "failure-groups.png"


def test_acknowledge_a_group_and_screenshot_the_page(page: Page, tmp_path: Path) -> None:
    # The demo shop's consumers (demo_project/shop/consumers.py).
    billing = ("billing.charge-order", "shop.billing")
    shipping = ("shipping.ship-order", "shop.shipping")
    receipts = ("receipts.send-receipt", "shop.receipts")
    inventory = ("inventory.reserve-stock", "shop.inventory")

    def failures(where: tuple[str, str], count: int, minutes_ago: float, **fields: Any) -> str:
        consumer, queue = where
        letter = None
        for n in range(count):
            letter = dead_letter(
                consumer, queue, {"order_id": 1000 + n}, minutes_ago=minutes_ago + n, **fields
            )
        assert letter is not None
        return letter.fingerprint

    retried = {"reason": "retries_exhausted", "attempts": 5}
    failures(shipping, 4, 3, exception_type="builtins.KeyError", exception_message="'postcode'")
    card = failures(billing, 2, 20, exception_message="card declined")
    smtp = failures(
        receipts,
        3,
        40,
        exception_type="smtplib.SMTPServerDisconnected",
        exception_message="Connection unexpectedly closed",
        **retried,
    )
    stock = failures(
        inventory,
        1,
        90,
        exception_type="builtins.LookupError",
        exception_message="SKU MUG-OLD is discontinued",
    )
    states = FailureGroupState.objects
    an_hour_ago = timezone.now() - dt.timedelta(hours=1)
    # Resolved an hour ago, failed again since: regressed.
    states.resolve(
        (receipts[0], smtp, "retries_exhausted"),
        by="bob (admin)",
        at=an_hour_ago,
        note="SMTP relay moved",
    )
    states.acknowledge(
        (inventory[0], stock, "permanent"),
        by="bob (admin)",
        at=an_hour_ago,
        note="catalogue clean-up",
    )
    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    page.goto(page.url + "groups/")
    badges = page.locator("#result_list tbody .rm-state")
    assert badges.all_inner_texts() == ["new", "regressed", "new", "acknowledged"]

    row = page.locator("#result_list tbody tr", has_text="card declined")
    row.locator("input[name=note]").fill("gateway ticket #4411")
    row.locator("button.rm-acknowledge").click()

    page.locator(".messagelist .success").wait_for()
    assert page.locator(".messagelist .success").inner_text().startswith("Acknowledged")
    row = page.locator("#result_list tbody tr", has_text="card declined")
    assert row.locator(".rm-state").inner_text() == "acknowledged"
    assert "gateway ticket #4411" in row.inner_text()
    assert states.get(fingerprint=card).changed_by == "alice (admin)"

    target = tmp_path / "failure-groups.png"
    page.screenshot(path=str(target), full_page=True)

    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("RM_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, SCREENSHOT)
