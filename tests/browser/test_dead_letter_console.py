"""The dead letter console in a real headless browser (Debian's chromium driven by Playwright):
log in, filter, replay, read the success message, and see the consumer process the message.

Also renders the screenshot of the dead letter list in the README and the docs;
``RM_UPDATE_SCREENSHOTS=1`` writes it to docs/images/dead-letters.png (otherwise only to the
test's temporary directory, so a test run never changes the working tree).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from reliable_messaging.conf import messaging_settings
from reliable_messaging.dead_letters.operations import run_batch
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
)
from reliable_messaging.testing import find_consumer, run_outbox
from tests.testapp.models import Effect

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dead-letters.png"
PASSWORD = "correct horse battery staple"
TIMEOUT_MS = 15_000


def dead_letter(
    consumer: str,
    queue: str,
    payload: Any,
    *,
    message_id: str | None = None,
    minutes_ago: float = 5,
    **fields: Any,
) -> DeadLetter:
    at = timezone.now() - dt.timedelta(minutes=minutes_ago)
    body = fields.pop("body", None)
    values: dict[str, Any] = {
        "message_id": str(uuid.uuid4()) if message_id is None else message_id,
        "consumer": consumer,
        "queue": queue,
        "exchange": messaging_settings.exchange,
        "routing_key": "order.placed",
        "payload": payload,
        "body": body if body is not None else json.dumps(payload).encode(),
        "content_type": "application/json",
        "reason": "permanent",
        "exception_type": "reliable_messaging.exceptions.PermanentError",
        "attempts": 1,
        "first_failed_at": at,
        "last_failed_at": at,
        "fingerprint": uuid.uuid5(
            uuid.NAMESPACE_DNS, consumer + fields.get("exception_type", "")
        ).hex[:16],
        "history": [{"event": "dead_lettered", "at": at.isoformat()}],
    }
    values.update(fields)
    return DeadLetter.objects.create(**values)


def test_filter_replay_and_see_the_consumer_process_it(page: Page) -> None:
    alpha, beta = find_consumer("tests.alpha"), find_consumer("tests.beta")
    dead_letter(
        alpha.name,
        alpha.queue,
        {"order_id": 7},
        message_id="replay-me",
        exception_message="alpha refuses this message for good",
    )
    dead_letter(
        beta.name,
        beta.queue,
        {"order_id": 8},
        message_id="beta-stays",
        reason="retries_exhausted",
        exception_type="builtins.KeyError",
        exception_message="'sku'",
        attempts=3,
    )
    page.reload()
    assert page.locator("#result_list tbody tr").count() == 2

    page.locator("#changelist-filter").get_by_role("link", name="tests.alpha", exact=True).click()
    page.wait_for_url("**/deadletter/?consumer=tests.alpha")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 1
    rows.filter(has_text="replay-me").locator("input.action-select").check()
    page.select_option("select[name=action]", "replay_selected")
    # The actions bar's submit button: "Go" up to Django 6.0, "Run" from 6.1 on.
    page.locator(".actions button[type=submit]").click()

    success = page.locator(".messagelist .success")
    success.wait_for()
    assert success.inner_text().startswith("1 dead letter was replayed")

    outcomes = run_outbox()  # what the relay and the consumer would do

    assert [(name, message_id) for name, message_id, _ in outcomes] == [
        ("tests.alpha", "replay-me")
    ]
    assert ProcessedMessage.objects.filter(consumer="tests.alpha", message_id="replay-me").exists()
    assert not Effect.objects.filter(consumer="beta").exists()
    assert DeadLetter.objects.get(message_id="replay-me").status == "resolved"
    assert DeadLetter.objects.get(message_id="beta-stays").status == "dead"
    page.reload()
    status = page.locator("#result_list tbody tr .field-status_display")
    assert status.inner_text().split() == ["resolved", "replayed", "once"]


def test_a_group_replay_shows_its_progress_and_can_be_cancelled(page: Page) -> None:
    """A group replay is recorded, not done, by the request: its page follows the runner's
    batches (here stepped by the test, as a slow relay would go), and Cancel stops it between
    two batches, the dead letters not reached yet left dead."""
    alpha = find_consumer("tests.alpha")
    template = dead_letter(alpha.name, alpha.queue, {"n": -1}, message_id="group-template")
    DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=f"group-{n}",
            consumer=alpha.name,
            queue=alpha.queue,
            exchange=template.exchange,
            routing_key="order.placed",
            payload={"n": n},
            body=json.dumps({"n": n}).encode(),
            reason="permanent",
            fingerprint=template.fingerprint,
        )
        for n in range(2999)
    )
    page.goto(page.url.split("?")[0] + "groups/")
    page.locator("a.rm-replay-group").first.click()
    page.get_by_role("button", name="Yes, replay 3000 dead letters").click()

    page.wait_for_url("**/deadletter/operations/*/")
    expect(page.locator("#rm-operation-state")).to_have_attribute("data-state", "pending")
    assert run_batch(batch_size=500) is not None
    assert run_batch(batch_size=500) is not None
    # The page refreshes itself while the operation runs.
    expect(page.locator("#rm-operation-done")).to_have_text("1000", timeout=TIMEOUT_MS)
    expect(page.locator("#rm-operation-state")).to_have_attribute("data-state", "running")

    page.get_by_role("button", name="Cancel the operation").click()

    expect(page.locator("#rm-operation-state")).to_have_attribute("data-state", "cancelled")
    expect(page.locator(".messagelist .success")).to_contain_text("is cancelled")
    assert run_batch(batch_size=500) is None, "nothing left to run"
    assert DeadLetter.objects.filter(status="replayed").count() == 1000
    assert DeadLetter.objects.filter(status="dead").count() == 2000
    assert OutboxMessage.objects.count() == 1000


def test_a_bulk_replay_does_what_its_confirmation_page_said(page: Page) -> None:
    """The page said "Replay 1 dead letter?" for a search that was a message_id; it was
    replayed by someone else before the button was pressed: the page comes back with the
    figures as they are now, and nothing runs. The operation confirmed then stops, and says
    why, rather than replay a dead letter that failed again after it was announced."""
    alpha, beta = find_consumer("tests.alpha"), find_consumer("tests.beta")
    needle = dead_letter(alpha.name, alpha.queue, {"order_id": 1}, message_id="needle")
    for n in range(3):
        dead_letter(beta.name, beta.queue, {"note": f"a needle, {n}"}, message_id=f"hay-{n}")
    again = dead_letter(
        beta.name, beta.queue, {"note": "hay"}, message_id="hay-again", status="resolved"
    )
    page.goto(page.url.split("?")[0] + "?status__exact=dead&q=needle")
    assert page.locator("#result_list tbody tr").count() == 1
    page.get_by_role("link", name="Replay all matching…").click()
    expect(page.locator("#content h1")).to_have_text("Replay 1 dead letter?")
    expect(page.locator("#content-main")).to_contain_text("message_id = needle")

    DeadLetter.objects.filter(pk=needle.pk).update(status="replayed")  # someone else did
    page.get_by_role("button", name="Yes, replay 1 dead letter").click()

    expect(page.locator(".messagelist .warning")).to_contain_text(
        "changed after this page counted them (1 then, 0 now): nothing was started"
    )
    expect(page.locator("#content h1")).to_have_text("Replay 3 dead letters?")
    expect(page.locator("#content-main")).to_contain_text("words “needle”")
    assert not DeadLetterOperation.objects.exists()

    page.get_by_role("button", name="Yes, replay 3 dead letters").click()
    page.wait_for_url("**/deadletter/operations/*/")
    # The producer sends hay-again once more, now with the word, and it fails again.
    DeadLetter.objects.record_failure(
        beta.name,
        again.message_id,
        fields={"status": "dead", "payload": {"note": "needle, again"}},
        event={"event": "dead_lettered", "at": timezone.now().isoformat()},
        first_failed_at=timezone.now(),
    )
    for _ in range(5):  # two batches of the three announced, then the stop
        if run_batch(batch_size=2) is None:
            break

    expect(page.locator("#rm-operation-state")).to_have_attribute("data-state", "failed")
    expect(page.locator(".errornote")).to_contain_text(
        "Stopped after the 3 dead letter(s) its confirmation announced"
    )
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == [
        "hay-0",
        "hay-1",
        "hay-2",
    ]
    assert DeadLetter.objects.get(message_id="hay-again").status == "dead"


def test_screenshot_of_the_dead_letter_list(page: Page, tmp_path: Path) -> None:
    # The demo shop's consumers (demo_project/shop/consumers.py), and one more.
    billing = ("billing.charge-order", "shop.billing", "order.placed")
    shipping = ("shipping.ship-order", "shop.shipping", "order.placed")
    receipts = ("receipts.send-receipt", "shop.receipts", "payment.captured")
    inventory = ("inventory.reserve-stock", "shop.inventory", "order.placed")

    def failure(
        where: tuple[str, str, str], payload: Any, minutes_ago: float, **fields: Any
    ) -> None:
        consumer, queue, routing_key = where
        dead_letter(
            consumer, queue, payload, routing_key=routing_key, minutes_ago=minutes_ago, **fields
        )

    retried = {"reason": "retries_exhausted", "attempts": 5}
    failure(billing, {"order_id": 1042, "amount": "59.90"}, 2, exception_message="card declined")
    failure(
        shipping,
        {"order_id": 1040},
        7,
        exception_type="builtins.KeyError",
        exception_message="'postcode'",
        **retried,
    )
    failure(
        shipping,
        {"order_id": 1037},
        19,
        exception_type="builtins.KeyError",
        exception_message="'postcode'",
        **retried,
    )
    failure(
        billing,
        {"order_id": 1031, "amount": "12.00"},
        34,
        exception_type="builtins.ConnectionError",
        exception_message="payment gateway timed out",
        **retried,
    )
    failure(
        receipts,
        {"order_id": 1029},
        52,
        exception_type="smtplib.SMTPServerDisconnected",
        exception_message="Connection unexpectedly closed",
        status="replayed",
        replay_count=1,
        **retried,
    )
    failure(
        inventory,
        None,
        75,
        body=b'{"order_id": 1024 "sku": "TSHIRT-BLU-M"}',
        reason="invalid_json",
        exception_type="",
        exception_message="body is not JSON: Expecting ',' delimiter: line 1 column 19",
    )
    failure(
        billing,
        {"order_id": 1019, "amount": "240.00"},
        140,
        exception_message="order 1019 does not exist",
        status="resolved",
        replay_count=1,
    )
    failure(
        inventory,
        {"order_id": 1011, "sku": "MUG-OLD"},
        300,
        exception_message="SKU MUG-OLD is discontinued",
        status="discarded",
    )
    # The navigation sidebar collapsed, as the admin remembers it per browser: more room.
    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    page.reload()
    assert page.locator("#result_list tbody tr").count() == 8

    target = tmp_path / "dead-letters.png"
    page.screenshot(path=str(target))

    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("RM_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, SCREENSHOT)


def test_the_detail_pages_replay_and_discard_sit_between_the_title_and_the_form(
    page: Page, tmp_path: Path
) -> None:
    """Where a person looks for them on every supported Django: below the page's title row
    (Django 6.1 puts the title and the object tools in one flex row), above the fields."""
    alpha = find_consumer("tests.alpha")
    letter = dead_letter(alpha.name, alpha.queue, {"order_id": 9}, message_id="detail-me")
    page.goto(page.url.split("?")[0] + f"{letter.pk}/change/")
    replay = page.get_by_role("button", name="Replay")
    discard = page.get_by_role("button", name="Discard (keep for the record)")
    title = page.locator("#content h1").first
    fields = page.locator("#content-main fieldset").first
    page.screenshot(path=str(tmp_path / "dead-letter-detail.png"), full_page=True)

    title_box, fields_box = title.bounding_box(), fields.bounding_box()
    assert title_box is not None and fields_box is not None
    for button in (replay, discard):
        box = button.bounding_box()
        assert box is not None
        assert box["y"] >= title_box["y"] + title_box["height"], (box, title_box)
        assert box["y"] + box["height"] <= fields_box["y"], (box, fields_box)
    replay_box, discard_box = replay.bounding_box(), discard.bounding_box()
    assert replay_box is not None and discard_box is not None
    assert abs(replay_box["y"] - discard_box["y"]) < replay_box["height"]  # one row

    replay.click()
    page.get_by_text("was replayed").first.wait_for()
    assert DeadLetter.objects.get(pk=letter.pk).status == "replayed"
