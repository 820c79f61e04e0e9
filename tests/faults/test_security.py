"""Security checks not covered elsewhere: no pickle, no credentials in the processes' logs nor
anywhere a malformed broker URL is shown (redact_url, the system check, the settings' repr,
messaging_status, consume and relay refusing to start), and the replay command refusing to act
on everything unless told so.

Covered elsewhere (not repeated here): admin permissions and CSRF in
tests/integration/admin/test_dead_letter_actions.py, escaping in
tests/integration/admin/test_dead_letter_detail.py, redacted well-formed URLs in reprs, checks and
an in-process consumer in tests/unit/test_conf.py, tests/unit/test_checks.py and
tests/integration/consuming/test_consumer_service.py.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from reliable_messaging.checks import check_settings
from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.conf import messaging_settings, redact_url
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.models import DeadLetter, OutboxMessage
from tests.conftest import database_url
from tests.support import (
    BROKER,
    MANAGE,
    ROOT,
    ConsumeProcess,
    WaitTimeout,
    broker_connection,
    fast_path_key,
    wait_until,
)

from .harness import RelayProcess

PACKAGE = ROOT / "reliable_messaging"

# --------------------------------------------------------------------------- no pickle

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "jsonpickle", "shelve"}


def unsafe_uses(source: str, name: str) -> list[str]:
    """Imports of pickle-like modules, and serializers chosen by name, in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=name)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            # __import__("pickle"), importlib.import_module("pickle")
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in {"__import__", "import_module"}:
                modules = [str(node.args[0].value)]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value == "pickle" or "PickleSerializer" in node.value)
        ):
            # A serializer chosen by name (Celery's "pickle", django-redis' PickleSerializer).
            found.append(f"{name}:{node.lineno}: {node.value!r}")
        found += [
            f"{name}:{getattr(node, 'lineno', '?')}: {module}"
            for module in modules
            if module.split(".")[0] in UNSAFE_MODULES
        ]
    return found


def test_no_pickle_anywhere_in_the_package() -> None:
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20  # the scan really looks at the package
    found = [
        use
        for path in sources
        for use in unsafe_uses(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_scan_sees_every_way_of_bringing_pickle_in() -> None:
    sample = (
        "import pickle\n"
        "from shelve import open\n"
        "import importlib\n"
        "m = importlib.import_module('dill')\n"
        "n = __import__('cloudpickle')\n"
        "CACHES = {'OPTIONS': {'SERIALIZER': 'django_redis.serializers.pickle.PickleSerializer'}}\n"
        "CELERY_TASK_SERIALIZER = 'pickle'\n"
    )
    assert len(unsafe_uses(sample, "sample.py")) == 6


# What a planted pickle does when it is loaded: records that it was.
_DETONATED: list[str] = []


def _detonate() -> str:
    _DETONATED.append("unpickled")
    return "boom"


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_detonate, ())


def test_the_duplicate_fast_path_never_unpickles_what_redis_holds() -> None:
    """The fast path's cache is a django-redis cache, whose default serializer is pickle: the
    fast path must read and write its keys as plain bytes, never through that serializer, or
    whoever can write to Redis could run code in every consumer."""
    fastpath = pytest.importorskip("reliable_messaging.consuming.fastpath")
    from django_redis import get_redis_connection

    duplicates = fastpath.DuplicateCache("messaging")
    done = fast_path_key(duplicates, "done", "tests.alpha", "pickle-1")
    lease = fast_path_key(duplicates, "lease", "tests.alpha", "pickle-2")
    remembered = fast_path_key(duplicates, "done", "tests.alpha", "pickle-3")
    redis = get_redis_connection("messaging")
    # Someone who can write to Redis plants a pickle where the fast path looks.
    redis.set(done, pickle.dumps(_Payload()), ex=60)
    try:
        seen = duplicates.check([("tests.alpha", "pickle-1")])[0]
        duplicates.check([("tests.alpha", "pickle-2")], {("tests.alpha", "pickle-2")})[1]
        duplicates.remember([("tests.alpha", "pickle-3")], [])
        duplicates.flush()
        written = [redis.get(lease) or b"", redis.get(remembered) or b""]
    finally:
        redis.delete(done, lease, remembered)
    assert not _DETONATED, "a value read from Redis was unpickled"
    assert seen == {("tests.alpha", "pickle-1")}  # the key's presence is all that counts
    assert all(value and not value.startswith(b"\x80") for value in written), written


# --------------------------------------------------------------------------- credentials

PASSWORD = "Sup3r-S3cret!pw"


def _process_env(ns: str, broker_url: str) -> dict[str, str]:
    env = {
        **os.environ,
        "RM_TEST_NAMESPACE": ns,
        "DATABASE_URL": database_url(),
        "RM_BROKER_URL": broker_url,
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    env.pop("RM_TEST_CACHE_ALIAS", None)
    return env


def logs_of_failing_connections(ns: str, tmp_path: Path, broker_url: str) -> list[str]:
    """The logs of ``consume`` and ``relay`` (stdout and stderr, every logger, tracebacks
    included) after each failed to connect to ``broker_url`` twice and stopped on SIGTERM."""
    env = _process_env(ns, broker_url)
    consume = ConsumeProcess([], env, tmp_path / "consume.log")
    relay = RelayProcess([], env, tmp_path / "relay.log")
    try:
        wait_until(
            lambda: (
                consume.log().count("reconnecting") >= 2 and relay.log().count("reconnecting") >= 2
            ),
            timeout=60,
            interval=0.2,
            message=lambda: f"two failed connections each:\n{consume.log()}\n{relay.log()}",
        )
        for proc in (consume, relay):
            proc.send(signal.SIGTERM)
        codes = [consume.wait(30), relay.wait(30)]
    finally:
        consume.close()
        relay.close()
    assert codes == [0, 0]
    return [consume.log(), relay.log()]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "after_password"),
    [
        pytest.param("127.0.0.1:1", "", id="broker-unreachable"),
        pytest.param(
            urllib.parse.urlsplit(BROKER.url).netloc.rpartition("@")[2], "", id="password-refused"
        ),
        # An "@" left unquoted in the password: pika still reads it (the last "@" ends it).
        pytest.param("127.0.0.1:1", "@x", id="unquoted-at-in-password"),
    ],
)
def test_the_broker_password_never_reaches_the_logs(
    ns: str, tmp_path: Path, where: str, after_password: str
) -> None:
    quoted = urllib.parse.quote(PASSWORD, safe="")
    url = f"amqp://guest:{quoted}{after_password}@{where}/%2F"
    for log in logs_of_failing_connections(ns, tmp_path, url):
        assert PASSWORD not in log and quoted not in log, log
        assert "guest:***@" in log, log  # the URL was logged, redacted


# A secret whose URL-quoted form differs ("!" becomes "%21"), in URLs that urllib and pika
# misread: the password lands in the host, the port or the vhost, or the URL is refused whole.
SECRET = "Hush!9f3K"
MALFORMED_URLS = {
    "missing-colon": f"amqps//app:{SECRET}@mq.example.com/%2F",
    "no-scheme": f"app:{SECRET}@127.0.0.1:1/%2F",
    "slash-in-password": f"amqp://app:{SECRET}/x@127.0.0.1:1/%2F",
    "at-in-password": f"amqp://app:{SECRET}@x@127.0.0.1:1/%2F",
    "hash-in-password": f"amqp://app:{SECRET}#x@127.0.0.1:1/%2F",
    "question-mark-in-password": f"amqp://app:{SECRET}?x@127.0.0.1:1/%2F",
    "several-at": f"amqp://a@b:{SECRET}@c@127.0.0.1:1/%2F",
    "third-slash": f"amqp:///app:{SECRET}@127.0.0.1:1/%2F",
    "bad-port": f"amqp://app:{SECRET}@127.0.0.1:notaport/%2F",
    "unclosed-ipv6": f"amqp://app:{SECRET}@[::1/%2F",
    "ipv6": f"amqp://app:{SECRET}@[::1]:1/%2F",
    "percent-encoded": f"amqp://app:{urllib.parse.quote(SECRET, safe='')}@127.0.0.1:1/%2F",
}
malformed = pytest.mark.parametrize("url", list(MALFORMED_URLS.values()), ids=list(MALFORMED_URLS))


def assert_no_secret(text: str) -> None:
    assert SECRET not in text and urllib.parse.quote(SECRET, safe="") not in text, text


def _with_broker_url(url: Any) -> Any:
    return override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, "BROKER_URL": url})


@malformed
def test_redact_url_hides_the_password_of_malformed_urls(url: str) -> None:
    shown = redact_url(url)
    assert_no_secret(shown)
    assert "***" in shown


@malformed
@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_the_broker_url_check_never_shows_the_password(url: str, as_bytes: bool) -> None:
    with _with_broker_url(url.encode() if as_bytes else url):
        messages = check_settings()
    assert_no_secret(" ".join(f"{m.msg} {m.hint}" for m in messages))


def test_the_check_refuses_credentials_taken_for_the_vhost() -> None:
    """pika reads "amqp:///user:pw@mq" as localhost with the vhost "user:pw@mq", which the
    broker quotes back in its refusal: refused before any process logs it."""
    with _with_broker_url(MALFORMED_URLS["third-slash"]):
        messages = [m for m in check_settings() if m.id == "reliable_messaging.E001"]
    assert len(messages) == 1 and "has no host" in messages[0].msg, messages


@malformed
def test_the_settings_repr_never_shows_the_password(url: str) -> None:
    with _with_broker_url(url):
        assert_no_secret(repr(messaging_settings))


@malformed
@pytest.mark.django_db
def test_messaging_status_never_shows_the_password(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    out, err = io.StringIO(), io.StringIO()
    with _with_broker_url(url), caplog.at_level(logging.DEBUG):
        try:
            call_command(
                "messaging_status",
                "--management-url",
                "",
                "--timeout",
                "3",
                stdout=out,
                stderr=err,
            )
            outcome = "exited 0"
        except (SystemExit, CommandError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    # Our loggers only: pika's debug lines name the vhost, which in "amqp:///user:pw@mq" holds
    # the password; the system check refuses that URL before a process logs anything.
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("reliable_messaging")]
    assert_no_secret("\n".join([out.getvalue(), err.getvalue(), outcome, *ours]))
    assert "cannot" in out.getvalue() + outcome  # the broker part did fail, and said so


@pytest.mark.django_db
@pytest.mark.parametrize(
    "management_url",
    [f"http://mon:{SECRET}@127.0.0.1:1", f"ftp://mon:{SECRET}@127.0.0.1:1"],
    ids=["unreachable", "not-http"],
)
def test_messaging_status_never_shows_the_password_of_a_management_url(
    ns: str, management_url: str
) -> None:
    """A --management-url typed by hand may carry credentials; the API is only asked about
    queues that exist, so one is declared."""
    spec = ConsumerSpec(
        name="tests.security.mgmt", queue=f"rmtest.{ns}.mgmt", handler=lambda m: None
    )
    connection = broker_connection()
    try:
        connection.channel().queue_declare(spec.queue, durable=False)
    finally:
        connection.close()
    out = io.StringIO()
    with registry.isolated():
        registry.register(spec)
        try:
            call_command(
                "messaging_status",
                "--management-url",
                management_url,
                "--timeout",
                "3",
                stdout=out,
            )
            outcome = "exited 0"
        except (SystemExit, CommandError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    assert_no_secret(out.getvalue() + outcome)
    assert "the management API at" in out.getvalue() and "mon:***@" in out.getvalue()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "url",
    [MALFORMED_URLS["slash-in-password"], MALFORMED_URLS["third-slash"]],
    ids=["slash-in-password", "third-slash"],
)
def test_processes_refuse_a_malformed_url_without_showing_the_password(
    ns: str, tmp_path: Path, url: str
) -> None:
    """The system checks stop consume and relay before they connect; what they print about
    the URL is redacted."""
    env = _process_env(ns, url)
    consume = ConsumeProcess([], env, tmp_path / "consume.log")
    relay = RelayProcess([], env, tmp_path / "relay.log")
    codes: list[int | None] = []
    try:
        for proc in (consume, relay):
            try:
                codes.append(proc.wait(30))
            except WaitTimeout:
                codes.append(None)  # it went on (with the password in the vhost): stop it
                proc.send(signal.SIGTERM)
                proc.wait(30)
    finally:
        consume.close()
        relay.close()
    for proc in (consume, relay):
        assert_no_secret(proc.log())
        assert "BROKER_URL" in proc.log() and "***" in proc.log(), proc.log()
    assert all(code not in (0, None) for code in codes), codes


# --------------------------------------------------------------------------- replay command


@pytest.fixture
def dead_letter(db: None) -> DeadLetter:
    return DeadLetter.objects.create(
        message_id="sec-1",
        consumer="tests.alpha",
        queue="q.alpha",
        routing_key="order.placed",
        body=b'{"n": 1}',
        payload={"n": 1},
        reason="retries_exhausted",
    )


def test_replay_without_a_filter_or_all_is_refused(dead_letter: DeadLetter) -> None:
    with pytest.raises(CommandError, match=r"No filter given: .* or --all to replay every"):
        call_command("replay_dead_letters", stdout=io.StringIO(), stderr=io.StringIO())
    with pytest.raises(CommandError, match=r"No filter given"):
        call_command("replay_dead_letters", "--force", stdout=io.StringIO())
    dead_letter.refresh_from_db()
    assert dead_letter.status == DeadLetterStatus.DEAD and dead_letter.replay_count == 0
    assert not OutboxMessage.objects.exists()

    # --all is the explicit way to mean everything (a dry run here: nothing changes).
    out = io.StringIO()
    call_command("replay_dead_letters", "--all", "--dry-run", stdout=out)
    assert "dry run: 1 dead letter(s) match; nothing replayed" in out.getvalue()
    assert not OutboxMessage.objects.exists()


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--all", "--limit", "0"], "--limit must be at least 1"),
        (["--all", "--batch-size", "0"], "--batch-size must be at least 1"),
    ],
)
def test_replay_refuses_nonsense_limits(
    dead_letter: DeadLetter, args: list[str], text: str
) -> None:
    with pytest.raises(CommandError, match=text):
        call_command("replay_dead_letters", *args, stdout=io.StringIO())
    assert not OutboxMessage.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_replay_without_a_filter_is_a_clear_error_on_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, str(MANAGE), "replay_dead_letters", "--settings", "tests.settings"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url()},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "CommandError: No filter given" in result.stderr
    assert "--all" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
