"""Security checks not covered elsewhere: no pickle, no credentials in the processes' logs, and
the replay command refusing to act on everything unless told so.

Covered elsewhere (not repeated here): admin permissions and CSRF in
tests/admin/test_dead_letter_actions.py, escaping in tests/admin/test_dead_letter_detail.py,
redacted URLs in reprs, checks and an in-process consumer in tests/unit/test_conf.py,
tests/unit/test_checks.py and tests/integration/test_consumer_service.py.
"""

from __future__ import annotations

import ast
import io
import os
import pickle
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from reliable_messaging.models import DeadLetter, DeadLetterStatus, OutboxMessage
from tests.conftest import database_url
from tests.support import MANAGE, ROOT, ConsumeProcess, wait_until

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
    fastpath = pytest.importorskip("reliable_messaging.fastpath")
    from django_redis import get_redis_connection

    duplicates = fastpath.DuplicateCache("messaging")
    done = duplicates.done_key("tests.alpha", "pickle-1")
    lease = duplicates.lease_key("tests.alpha", "pickle-2")
    remembered = duplicates.done_key("tests.alpha", "pickle-3")
    redis = get_redis_connection("messaging")
    # Someone who can write to Redis plants a pickle where the fast path looks.
    redis.set(done, pickle.dumps(_Payload()), ex=60)
    try:
        seen = duplicates.processed([("tests.alpha", "pickle-1")])
        duplicates.lease([("tests.alpha", "pickle-2")])
        duplicates.remember([("tests.alpha", "pickle-3")], [])
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


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("127.0.0.1:1", id="broker-unreachable"),
        pytest.param("127.0.0.1:5672", id="password-refused"),
    ],
)
def test_the_broker_password_never_reaches_the_logs(ns: str, tmp_path: Path, where: str) -> None:
    quoted = urllib.parse.quote(PASSWORD, safe="")
    url = f"amqp://guest:{quoted}@{where}/%2F"
    env = _process_env(ns, url)
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
    for proc in (consume, relay):
        log = proc.log()  # stdout and stderr, every logger, tracebacks included
        assert PASSWORD not in log and quoted not in log, log
        assert "guest:***@" in log, log  # the URL was logged, redacted


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
