"""The whole bad-input corpus against ONE real ``manage.py consume`` process.

Every kind of bad message is published raw (bytes and properties exactly as given) to a single
running consumer, then one good message. Each bad one must end as exactly one dead letter with
its clear reason, its raw body kept byte for byte and its message_id named in the log, while
the consumer keeps going: the good message sent after all of them takes effect, once, and the
process is still running.

The corpus runs once (a module fixture); each test below checks one item of it, so an item the
product does not handle yet fails (or is marked xfail) alone. Single kinds are also covered by
tests/integration/consuming/test_consumer_service.py (an in-process service) and
tests/unit/core/test_envelope.py (the decoding); this is the same corpus end to end, all at once,
through the real command.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.core.envelope import ATTEMPT_HEADER
from tests import support
from tests.support import ConsumeProcess, Publisher, WaitTimeout, wait_until

# django_db makes pytest-django create the test database; the corpus itself runs once, in a
# module fixture, and each test reads what it recorded.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

MAX_BODY = 64 * 1024  # MAX_BODY_BYTES in tests/settings.py
CONSUMER = "tests.alpha"
GOOD_ID = "corpus-good-after"


@dataclass(frozen=True)
class Item:
    """One bad message: what to publish and what its dead letter must say."""

    name: str
    message_id: str | None
    body: bytes
    reason: str
    says: tuple[str, ...]  # fragments the dead letter's exception message must contain
    content_type: str | None = "application/json"
    headers: dict[str, Any] | None = None
    exchange: str | None = None  # None: the test's topic exchange
    routing_key: str = "order.placed"
    attempts: int = 1
    exception_type: str = ""


def corpus(ns: str) -> list[Item]:
    queue = f"{ns}.alpha"
    return [
        Item("invalid_json", "corpus-json", b'{"order": ', "invalid_json", ("not valid JSON",)),
        Item(
            "invalid_utf8",
            "corpus-utf8",
            b'{"name": "\xff\xfe"}',
            "invalid_utf8",
            ("not valid UTF-8",),
        ),
        Item("empty_body", "corpus-empty", b"", "empty_body", ("empty",)),
        Item("no_message_id", None, b'{"order": 4}', "missing_message_id", ("no message_id",)),
        Item(
            "body_too_large",
            "corpus-large",
            b'{"pad": "' + b"x" * MAX_BODY + b'"}',
            "body_too_large",
            ("MAX_BODY_BYTES", str(MAX_BODY)),
        ),
        Item(
            "wrong_content_type",
            "corpus-ctype",
            b"order=4",
            "unsupported_content_type",
            ("text/plain",),
            content_type="text/plain",
        ),
        Item(
            "attempt_header_not_a_number",
            "corpus-attempt-text",
            b'{"order": 5}',
            "invalid_headers",
            (ATTEMPT_HEADER, "'abc'"),
            headers={ATTEMPT_HEADER: "abc"},
        ),
        Item(
            "attempt_header_of_the_wrong_type",
            "corpus-attempt-list",
            b'{"order": 6}',
            "invalid_headers",
            (ATTEMPT_HEADER, "list"),
            headers={ATTEMPT_HEADER: [1, 2]},
        ),
        Item(
            "attempt_header_negative",
            "corpus-attempt-negative",
            b'{"order": 7}',
            "invalid_headers",
            (ATTEMPT_HEADER, "-3"),
            headers={ATTEMPT_HEADER: -3},
        ),
        Item(
            # The handler reads payload["fields"]["order_id"]: a KeyError, retried like any
            # other error, then dead-lettered after MAX_ATTEMPTS (3 in tests/settings.py).
            "payload_missing_a_field",
            "corpus-missing-field",
            b'{"require": "order_id", "fields": {"amount": "9.99"}}',
            "retries_exhausted",
            ("order_id",),
            attempts=3,
            exception_type="builtins.KeyError",
        ),
        Item(
            # Straight into the consumer's queue through the default exchange: the routing key
            # (the queue's name) matches none of its bindings ("order.*").
            "unknown_routing_key",
            "corpus-routing-key",
            b'{"order": 8}',
            "unexpected_routing_key",
            (queue, "order.*"),
            exchange="",
            routing_key=queue,
        ),
    ]


@dataclass
class CorpusRun:
    """What the one consumer did with the corpus, read once everything settled."""

    items: list[Item]
    queue: str
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    effects: list[tuple[str, str, int]] = field(default_factory=list)
    log: str = ""
    returncode: int | None = None
    drained: bool = False
    timeout: str = ""

    def letters_of(self, item: Item) -> list[dict[str, Any]]:
        message_id = item.message_id or ""
        return [d for d in self.dead_letters if d["message_id"] == message_id]


def _terminal(items: list[Item], good: str) -> bool:
    from reliable_messaging.models import DeadLetter
    from tests.testapp.models import Effect

    dead = set(DeadLetter.objects.filter(consumer=CONSUMER).values_list("message_id", flat=True))
    done = set(Effect.objects.filter(consumer="alpha").values_list("message_id", flat=True))
    return good in done and all((i.message_id or "") in dead | done for i in items)


@pytest.fixture(scope="module")
def corpus_run(
    django_db_setup: None,
    django_db_blocker: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[CorpusRun]:
    from reliable_messaging.models import DeadLetter, ProcessedMessage
    from tests.conftest import database_url
    from tests.testapp.models import Effect

    ns = support.new_namespace()
    queue = f"{ns}.alpha"
    log_path: Path = tmp_path_factory.mktemp("corpus") / "consume.log"
    items = corpus(ns)
    run = CorpusRun(items, queue)
    env = {
        **os.environ,
        "RM_TEST_NAMESPACE": ns,
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    env.pop("RM_TEST_CACHE_ALIAS", None)
    publisher = Publisher()
    proc: ConsumeProcess | None = None
    try:
        with django_db_blocker.unblock():
            env["DATABASE_URL"] = database_url()
            # Only alpha's queue: each bad message has exactly one consumer to refuse it.
            proc = ConsumeProcess(["--queue", queue], env, log_path)
            proc.wait_consuming()
            for item in items:
                publisher.publish(
                    f"rmtest.{ns}" if item.exchange is None else item.exchange,
                    item.routing_key,
                    body=item.body,
                    message_id=item.message_id,
                    content_type=item.content_type,
                    headers=item.headers,
                )
            publisher.publish(f"rmtest.{ns}", "order.placed", {"order": 9}, message_id=GOOD_ID)
            try:
                wait_until(
                    lambda: _terminal(items, GOOD_ID),
                    timeout=60,
                    interval=0.2,
                    message="every corpus item dead-lettered or handled, and the good message",
                )
                wait_until(
                    lambda: support.drained(queue),
                    timeout=30,
                    interval=0.3,
                    message="the queue drained",
                )
                run.drained = True
            except WaitTimeout as exc:
                run.timeout = str(exc)
            run.dead_letters = list(DeadLetter.objects.filter(consumer=CONSUMER).values())
            run.effects = list(
                Effect.objects.filter(consumer="alpha").values_list(
                    "message_id", "consumer", "attempt"
                )
            )
            run.returncode = proc.returncode
            run.log = proc.log()
        yield run
    finally:
        publisher.close()
        if proc is not None:
            proc.close()
        with django_db_blocker.unblock():
            # The module ran outside pytest-django's per-test flush: clean up after it.
            DeadLetter.objects.all().delete()
            ProcessedMessage.objects.all().delete()
            Effect.objects.all().delete()
        with contextlib.suppress(Exception):
            support.delete_broker_objects(ns)


def _item(run: CorpusRun, name: str) -> Item:
    return next(i for i in run.items if i.name == name)


NAMES = [i.name for i in corpus("tns")]


@pytest.mark.parametrize("name", NAMES)
def test_each_bad_message_ends_as_exactly_one_dead_letter_with_its_reason(
    corpus_run: CorpusRun, name: str
) -> None:
    item = _item(corpus_run, name)
    letters = corpus_run.letters_of(item)
    assert len(letters) == 1, (
        f"{name}: expected one dead letter for message_id={item.message_id!r}, got "
        f"{len(letters)}; effects: {[e for e in corpus_run.effects if e[0] == item.message_id]}"
        f"{'; ' + corpus_run.timeout if corpus_run.timeout else ''}"
    )
    (letter,) = letters
    assert letter["reason"] == item.reason, letter["exception_message"]
    for fragment in item.says:
        assert fragment in letter["exception_message"], (fragment, letter["exception_message"])
    assert bytes(letter["body"]) == item.body  # byte for byte
    assert letter["queue"] == corpus_run.queue
    assert letter["attempts"] == item.attempts
    assert letter["exception_type"] == item.exception_type
    assert letter["status"] == "dead"
    # Nothing of a refused message took effect.
    assert not [e for e in corpus_run.effects if e[0] == (item.message_id or "")]
    # The log line that dead-lettered it names it.
    if item.message_id:
        assert f"dead-lettering message_id={item.message_id} " in corpus_run.log


def test_the_consumer_keeps_going_after_the_whole_corpus(corpus_run: CorpusRun) -> None:
    assert corpus_run.returncode is None, corpus_run.log
    assert [e for e in corpus_run.effects if e[0] == GOOD_ID] == [(GOOD_ID, "alpha", 1)]
    assert not [d for d in corpus_run.dead_letters if d["message_id"] == GOOD_ID]
    assert corpus_run.drained, corpus_run.timeout
    # One dead letter per bad message, no more.
    assert len(corpus_run.dead_letters) == len(corpus_run.items)
    assert "unexpected error" not in corpus_run.log, corpus_run.log
