"""The browser tests' shared fixtures: Debian's chromium driven by Playwright, and a page
logged in to the admin as a superuser."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from playwright.sync_api import Browser, Page, sync_playwright

from .test_dead_letter_console import CHROMIUM, CHROMIUM_ARGS, PASSWORD, TIMEOUT_MS


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    # Playwright's sync API keeps an event loop running in this thread; the test's own ORM
    # calls are still plain synchronous code, which Django would otherwise refuse to run.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()
            # With a loop running, Django keeps this thread's connections apart from the ones
            # it uses without: close them now, or the test database cannot be dropped at exit.
            connections.close_all()


@pytest.fixture
def page(transactional_db: None, live_server: Any, settings: Any, browser: Browser) -> Page:
    """A page logged in to the admin as a superuser, on the dead letter list."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast
    User.objects.create_superuser("alice", "alice@example.com", PASSWORD)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{live_server.url}/admin/login/?next=/admin/reliable_messaging/deadletter/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/reliable_messaging/deadletter/")
    return page
