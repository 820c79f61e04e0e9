"""Bodies no page can show whole, in a real browser: JSON nested 5,000 deep (Python's parser
and pretty-printer give up on it) and 8 MiB of JSON, on a dead letter's page and an outbox
row's. Each page opens, shows the start of the body and its full size, and its Download link
saves the exact bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from reliable_messaging.models import OutboxMessage
from reliable_messaging.testing import find_consumer
from tests.browser.test_dead_letter_console import dead_letter

pytestmark = pytest.mark.slow

DEEP = b"[" * 5000 + b"]" * 5000
LARGE = json.dumps({"rows": ["x" * 1000] * 8 * 1024}).encode()  # 8 MiB and a bit
PAGE_LIMIT = 400_000  # bytes of HTML: the start of the body and the page around it


def open_and_download(page: Page, url: str, tmp_path: Path) -> tuple[int, bytes]:
    """Open ``url`` (its HTTP status and its HTML's size), then click Download."""
    response = page.goto(url)
    assert response is not None
    size = len(response.body())
    assert response.status == 200
    assert size < PAGE_LIMIT, f"the page is {size:,} bytes"
    with page.expect_download() as download:
        page.get_by_role("link", name="Download").first.click()
    target = tmp_path / download.value.suggested_filename
    download.value.save_as(target)
    return size, target.read_bytes()


def test_a_dead_letter_nested_5000_deep_and_one_of_8_mib(
    page: Page, live_server: object, tmp_path: Path
) -> None:
    alpha = find_consumer("tests.alpha")
    deep = dead_letter(
        alpha.name,
        alpha.queue,
        None,
        body=DEEP,
        reason="invalid_json",
        exception_type="",
        exception_message="body is not JSON: maximum recursion depth exceeded",
    )
    large = dead_letter(alpha.name, alpha.queue, None, body=LARGE, reason="invalid_json")
    base = f"{live_server.url}/admin/reliable_messaging/deadletter"  # type: ignore[attr-defined]

    _, deep_saved = open_and_download(page, f"{base}/{deep.pk}/change/", tmp_path)
    expect(page.locator(".field-raw_body")).to_contain_text("10,000 bytes")
    expect(page.locator(".field-raw_body pre")).to_contain_text("[[[[[[[[")
    _, large_saved = open_and_download(page, f"{base}/{large.pk}/change/", tmp_path)
    expect(page.locator(".field-raw_body")).to_contain_text(
        f"The first 65,536 bytes of {len(LARGE):,} bytes are shown."
    )

    assert deep_saved == DEEP
    assert large_saved == LARGE


def test_an_outbox_row_of_8_mib(page: Page, live_server: object, tmp_path: Path) -> None:
    row = OutboxMessage.objects.create(
        message_id="o-large", routing_key="order.placed", body=LARGE.decode()
    )
    base = f"{live_server.url}/admin/reliable_messaging/outboxmessage"  # type: ignore[attr-defined]

    _, saved = open_and_download(page, f"{base}/{row.pk}/change/", tmp_path)

    expect(page.locator(".field-body_block")).to_contain_text(
        f"The first 65,536 bytes of {len(LARGE):,} bytes are shown."
    )
    assert saved == LARGE
