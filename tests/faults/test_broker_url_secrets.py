"""Broker passwords holding the characters URLs and our own list syntax use (``;``, ``@``, ``:``,
``%``, ``/``) never shown: not by ``manage.py check``, the settings' repr, ``messaging_status``
(text and ``--json``), nor by the consume and relay processes while the broker refuses them.

``BROKER_URL`` joins several URLs with ``;``: a password holding one, written as is, was once cut
there into two "URLs" (``amqp://app:Hush1k`` and ``Kept2q@host``), which redaction could not
recognise as holding a password, and each piece was printed whole.
"""

from __future__ import annotations

import io
import json
import logging
import re
import urllib.parse
from pathlib import Path
from typing import Any

import pika.exceptions
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from reliable_messaging.broker.queues import describe_broker_error
from reliable_messaging.conf import messaging_settings, redact_url, split_broker_urls

from .test_security import logs_of_failing_connections

# Each piece between the special characters is distinctive, so a password shown cut in two is
# caught as surely as one shown whole.
PASSWORDS = {
    "semicolon": "Hush1k;Kept2q",
    "semicolon-at-colon-percent": "Hush1k;Kept2q@Mute3z:Quiet4w%Zip5",
    "semicolon-slash": "Hush1k;Kept2q/Mute3z",
    "percent-encoded": urllib.parse.quote("Hush1k;Kept2q@Mute3z:Quiet4w%Zip5/Nil6", safe=""),
}
passwords = pytest.mark.parametrize("password", list(PASSWORDS.values()), ids=list(PASSWORDS))


def url_with(password: str, where: str = "127.0.0.1:1") -> str:
    return f"amqp://guest:{password}@{where}/%2F"


def assert_hidden(text: str, password: str) -> None:
    plain = urllib.parse.unquote(password)
    pieces = [p for p in re.split(r"[;@:%/]", plain) if len(p) >= 4]
    pieces += [password, plain, urllib.parse.quote(plain, safe="")]
    shown = [piece for piece in pieces if piece in text]
    assert not shown, f"{shown} shown in:\n{text}"


def _with_broker_url(url: Any) -> Any:
    return override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "BROKER_URL": url})


@passwords
def test_a_password_is_never_cut_into_urls(password: str) -> None:
    other = "amqps://app:x@mq2.example.com/%2F"
    assert split_broker_urls(url_with(password)) == [url_with(password)]
    assert split_broker_urls(f" {url_with(password)} ;{other}; ") == [url_with(password), other]
    assert_hidden(redact_url(url_with(password)), password)


@passwords
def test_check_and_repr_never_show_the_password(password: str) -> None:
    with _with_broker_url(url_with(password)):
        try:
            call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
            shown = ""
        except SystemCheckError as exc:
            shown = str(exc)
        shown += repr(messaging_settings) + messaging_settings.broker_shown
    assert_hidden(shown, password)


@passwords
@pytest.mark.django_db
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_messaging_status_never_shows_the_password(
    password: str, as_json: bool, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.StringIO()
    args = ["--management-url", "", "--timeout", "3", *(["--json"] if as_json else [])]
    with _with_broker_url(url_with(password)), caplog.at_level(logging.DEBUG):
        try:
            call_command("messaging_status", *args, stdout=out, stderr=io.StringIO())
            outcome = "exited 0"
        except (SystemExit, CommandError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("reliable_messaging")]
    assert_hidden("\n".join([out.getvalue(), outcome, *ours]), password)
    if as_json:
        json.loads(out.getvalue())  # still one document


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "password",
    [PASSWORDS["semicolon-at-colon-percent"], PASSWORDS["percent-encoded"]],
    ids=["as-written", "percent-encoded"],
)
def test_a_refused_login_never_logs_the_password(ns: str, tmp_path: Path, password: str) -> None:
    """The real broker refuses guest with this password (ACCESS_REFUSED); consume and relay
    keep trying, and log each refusal."""
    for log in logs_of_failing_connections(ns, tmp_path, url_with(password, "127.0.0.1:5672")):
        assert "ACCESS_REFUSED" in log or "AuthenticationError" in log, log
        assert "guest:***@127.0.0.1:5672" in log, log
        assert_hidden(log, password)


@passwords
def test_a_broker_error_quoting_the_password_is_scrubbed_for_the_logs(password: str) -> None:
    """What consume, the relay and the retry publisher log of a client error: a refusal that
    quotes a vhost holding the password (a URL whose password pika read as the vhost)."""
    plain = urllib.parse.unquote(password)
    refusal = pika.exceptions.ConnectionClosedByBroker(
        530, f"NOT_ALLOWED - vhost {plain} not found"
    )
    with _with_broker_url(url_with(password)):
        shown = describe_broker_error(refusal)
    assert "NOT_ALLOWED" in shown
    assert_hidden(shown, password)
