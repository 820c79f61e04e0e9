"""Edit, then replay, in a real headless browser: the diff against the original, the reason the
page requires, what it refuses (JSON that does not parse, a payload over MAX_BODY_BYTES, headers
that would route the copy elsewhere or pass for ours), and the permission per consumer.

Also renders the screenshot of the edit page in the docs; ``RM_UPDATE_SCREENSHOTS=1`` writes it
to docs/images/edit-replay.png (otherwise only to the test's temporary directory).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from playwright.sync_api import Browser, Page, expect

from reliable_messaging.choices import ReplayKind, ReplayOutcome
from reliable_messaging.dead_letters.permissions import consumer_codename
from reliable_messaging.models import DeadLetter, OutboxMessage, Replay
from reliable_messaging.testing import find_consumer, run_outbox
from tests.testapp.models import Effect

from .test_dead_letter_console import PASSWORD, TIMEOUT_MS, dead_letter

pytestmark = pytest.mark.slow

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "edit-replay.png"
BASE = "/admin/reliable_messaging/deadletter"
ORIGINAL = {"order_id": 1042, "require": "sku", "fields": {"colour": "blue"}}
HEADERS = {
    "x-rm-attempt": 3,
    "tenant": "acme",
    "x-death": [{"count": 1, "queue": "q"}],
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}


def failed_for_sku(**fields: Any) -> DeadLetter:
    alpha = find_consumer("tests.alpha")
    values: dict[str, Any] = {
        "message_id": "order-1042",
        "headers": HEADERS,
        "reason": "retries_exhausted",
        "exception_type": "builtins.KeyError",
        "exception_message": "'sku'",
        "attempts": 3,
        **fields,
    }
    return dead_letter(alpha.name, alpha.queue, ORIGINAL, **values)


def edit_page(page: Page, letter: DeadLetter) -> None:
    page.goto(page.url.split("/admin/")[0] + f"{BASE}/{letter.pk}/change/")
    page.locator("#rm-edit-replay").click()
    page.wait_for_url(f"**/deadletter/{letter.pk}/edit-replay/")


def edited(payload: Any) -> str:
    return json.dumps(payload, indent=2)


def problems(page: Page) -> str:
    return page.locator("#rm-edit-problems").inner_text()


def test_preview_shows_the_diff_a_reason_is_required_and_the_copy_is_processed(
    page: Page,
) -> None:
    letter = failed_for_sku()
    edit_page(page, letter)
    payload_box = page.locator("#id_payload")
    assert json.loads(payload_box.input_value()) == ORIGINAL
    # The user's headers only: not ours, the broker's or the trace context.
    assert json.loads(page.locator("#id_headers").input_value()) == {"tenant": "acme"}

    fixed = {**ORIGINAL, "fields": {"colour": "blue", "sku": "TSHIRT-BLU-M"}}
    payload_box.fill(edited(fixed))
    page.locator("#id_headers").fill('{"tenant": "acme", "fixed-by": "ops"}')
    page.get_by_role("button", name="Preview").click()

    diff = page.locator("#rm-edit-diff")
    expect(diff.locator(".rm-diff-added")).to_contain_text(['"sku": "TSHIRT-BLU-M"'])
    expect(diff.locator(".rm-diff-removed").first).to_contain_text('"colour": "blue"')
    expect(diff).to_contain_text('"fixed-by": "ops"')
    assert "a reason is required" in problems(page)

    page.get_by_role("button", name="Replay edited copy").click()  # still no reason
    assert "a reason is required" in problems(page)
    assert not Replay.objects.exists()
    assert json.loads(page.locator("#id_payload").input_value()) == fixed  # the edit is kept

    page.locator("#id_reason").fill("the shop sent no SKU for T-shirts; added it by hand")
    page.get_by_role("button", name="Replay edited copy").click()

    page.wait_for_url(f"**/deadletter/{letter.pk}/change/")
    replay = Replay.objects.get()
    success = page.locator(".messagelist .success")
    expect(success).to_contain_text(f"replayed as message {replay.message_id}")
    assert replay.kind == ReplayKind.EDITED
    assert replay.message_id != letter.message_id
    assert replay.replayed_by.startswith("alice")
    assert replay.reason == "the shop sent no SKU for T-shirts; added it by hand"
    assert replay.edit["payload"] == fixed
    assert replay.edit["headers"] == {"tenant": "acme", "fixed-by": "ops"}
    assert '+    "sku": "TSHIRT-BLU-M"' in replay.edit["diff"]
    row = OutboxMessage.objects.get(message_id=replay.message_id)
    assert (row.exchange, row.routing_key) == ("", letter.queue)
    assert json.loads(row.body) == fixed
    assert row.headers["x-rm-replay-id"] == replay.pk
    assert row.headers["tenant"] == "acme" and row.headers["fixed-by"] == "ops"
    assert "x-death" not in row.headers and row.headers["x-rm-dead-letter-id"] == letter.pk
    original = DeadLetter.objects.get(pk=letter.pk)
    assert original.payload == ORIGINAL and json.loads(bytes(original.body)) == ORIGINAL
    assert original.headers == HEADERS
    assert original.status == "replayed"
    event = original.history[-1]
    assert event["event"] == "edited_replay"
    assert event["message_id"] == replay.message_id and event["reason"] == replay.reason
    replays = page.locator(".rm-replays")
    expect(replays).to_contain_text("edited replay")
    expect(replays).to_contain_text(replay.message_id)
    expect(replays).to_contain_text("in flight")

    run_outbox()  # what the relay and the consumer would do

    assert Effect.objects.filter(consumer="alpha", message_id=replay.message_id).exists()
    replay.refresh_from_db()
    assert replay.outcome == ReplayOutcome.PROCESSED
    assert DeadLetter.objects.get(pk=letter.pk).status == "resolved"
    page.reload()
    expect(page.locator(".rm-replays")).to_contain_text("processed")


def test_a_refusal_is_shown_and_nothing_is_sent(page: Page) -> None:
    """How the page shows what the edit refuses; each refusal is a test of the admin's pages
    (tests/integration/admin/test_edit_replay.py)."""
    letter = failed_for_sku()
    edit_page(page, letter)
    page.locator("#id_payload").fill("{}")
    page.locator("#id_headers").fill('{"CC": ["other-queue"]}')
    page.locator("#id_reason").fill("trying")
    page.get_by_role("button", name="Replay edited copy").click()

    expect(page.locator("#rm-edit-problems")).to_contain_text("header 'CC' is refused")
    assert not Replay.objects.exists() and not OutboxMessage.objects.exists()
    assert DeadLetter.objects.get(pk=letter.pk).status == "dead"


def test_the_position_of_a_json_error_is_named(page: Page) -> None:
    letter = failed_for_sku()
    edit_page(page, letter)
    page.locator("#id_payload").fill('{\n  "order_id": 1042\n  "sku": "A"\n}')
    page.get_by_role("button", name="Preview").click()
    expect(page.locator("#rm-edit-problems")).to_contain_text(
        "Expecting ',' delimiter at line 3 column 3"
    )


def test_an_already_processed_original_needs_force(page: Page) -> None:
    from reliable_messaging.models import ProcessedMessage

    letter = failed_for_sku()
    ProcessedMessage.objects.create(consumer=letter.consumer, message_id=letter.message_id)
    edit_page(page, letter)
    page.locator("#id_reason").fill("run it once more, corrected")
    page.get_by_role("button", name="Replay edited copy").click()
    expect(page.locator("#rm-edit-problems")).to_contain_text("already processed the original")
    assert not Replay.objects.exists()

    page.locator("#id_force").check()
    page.get_by_role("button", name="Replay edited copy").click()
    page.wait_for_url(f"**/deadletter/{letter.pk}/change/")
    assert Replay.objects.get().kind == ReplayKind.EDITED
    # The original's inbox row stays: the copy has its own message_id.
    assert ProcessedMessage.objects.filter(message_id=letter.message_id).exists()


def log_in(browser: Browser, live_server: Any, username: str) -> Page:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{live_server.url}/admin/login/?next={BASE}/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{BASE}/")
    return page


def test_the_permission_is_per_consumer(page: Page, browser: Browser, live_server: Any) -> None:
    """Bob may edit tests.alpha's dead letters, not tests.beta's: no button on beta's page,
    403 on its edit page, while alpha's edit goes through."""
    beta = find_consumer("tests.beta")
    alpha_letter = failed_for_sku()
    beta_letter = dead_letter(beta.name, beta.queue, {"order_id": 8}, message_id="beta-1")
    bob = User.objects.create_user("bob", password=PASSWORD, is_staff=True)
    bob.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="reliable_messaging",
            codename__in=["view_deadletter", "replay_deadletter", consumer_codename("tests.alpha")],
        )
    )
    assert bob.user_permissions.count() == 3  # the per-consumer permission exists (migrate)
    as_bob = log_in(browser, live_server, "bob")

    as_bob.goto(f"{live_server.url}{BASE}/{beta_letter.pk}/change/")
    expect(as_bob.get_by_role("button", name="Replay", exact=True)).to_be_visible()  # replay: yes
    expect(as_bob.locator("#rm-edit-replay")).to_have_count(0)  # edit: no
    response = as_bob.goto(f"{live_server.url}{BASE}/{beta_letter.pk}/edit-replay/")
    assert response is not None and response.status == 403
    edit_page(as_bob, alpha_letter)
    as_bob.locator("#id_reason").fill("bob fixes alpha")
    as_bob.get_by_role("button", name="Replay edited copy").click()
    as_bob.wait_for_url(f"**/deadletter/{alpha_letter.pk}/change/")
    assert Replay.objects.get().dead_letter_id == alpha_letter.pk
    assert DeadLetter.objects.get(pk=beta_letter.pk).status == "dead"


def test_without_the_edit_permission_the_page_is_403(
    page: Page, browser: Browser, live_server: Any
) -> None:
    letter = failed_for_sku()
    carol = User.objects.create_user("carol", password=PASSWORD, is_staff=True)
    carol.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="reliable_messaging",
            codename__in=["view_deadletter", "replay_deadletter"],
        )
    )
    as_carol = log_in(browser, live_server, "carol")
    as_carol.goto(f"{live_server.url}{BASE}/{letter.pk}/change/")
    expect(as_carol.locator("#rm-edit-replay")).to_have_count(0)
    response = as_carol.goto(f"{live_server.url}{BASE}/{letter.pk}/edit-replay/")
    assert response is not None and response.status == 403


def test_screenshot_of_the_edit_page(page: Page, tmp_path: Path) -> None:
    # A consumer of the demo shop (demo_project/shop/consumers.py), as the list's screenshot.
    letter = dead_letter(
        "shipping.ship-order",
        "shop.shipping",
        ORIGINAL,
        message_id="0193a4c2-7d1e-7c3a-9f51-2b8e4d6a1c07",
        headers=HEADERS,
        reason="retries_exhausted",
        exception_type="builtins.KeyError",
        exception_message="'sku'",
    )
    # The navigation sidebar collapsed, as the admin remembers it per browser: more room.
    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    edit_page(page, letter)
    fixed = {**ORIGINAL, "fields": {"colour": "blue", "sku": "TSHIRT-BLU-M"}}
    page.locator("#id_payload").fill(edited(fixed))
    page.locator("#id_reason").fill("the shop sent no SKU for T-shirts; added it by hand")
    page.get_by_role("button", name="Preview").click()
    page.locator("#rm-edit-ready").wait_for()
    expect(page.locator("#rm-edit-diff .rm-diff-added")).to_contain_text(['"sku"'])

    target = tmp_path / "edit-replay.png"
    page.screenshot(path=str(target), full_page=True)

    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("RM_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, SCREENSHOT)
