"""Frames from other clients against ONE real ``manage.py consume`` process.

Node's amqplib (doubles, a JavaScript millisecond timestamp, a Java-style date before 1970, an
AMQP float), kombu (floats as doubles) and raw frames no client library writes (a routing key
and message ids that are not UTF-8, headers nested beyond Python's recursion limit, JSON too deep
or with a 5000-digit number) are published to the consumer of ``tests.foreign`` (it records the
type and repr of every header its handler gets; see tests/foreign/consumers.py), each followed by
good messages. Every bad message must end as one outcome, a dead letter with its clear reason
and raw body, or the correct value in the handler, and the good ones behind it must each be
handled exactly once, without the process dying or reconnecting.

The run happens once (a module fixture, under a minute); each test checks one part of it.
amqplib is installed with ``npm ci`` into tests/foreign/node_modules on the first run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.spec
import pytest

from tests import support
from tests.support import ConsumeProcess, Publisher, WaitTimeout, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

FOREIGN = Path(__file__).resolve().parent.parent / "foreign"
CONSUMER = "tests.foreign"
RATIO = 3.75
PI = 3.141592653589793
TINY = 0.1 + 0.2  # 0.30000000000000004: any rounding on the way would show
JS_MS = 1_700_000_000_123
JAVA_1960 = -315_619_200
LONG_BINARY_NAME = b"\xff" * 200  # escaped, it no longer fits an AMQP short string


# --------------------------------------------------------------------------- producers


def ensure_amqplib() -> None:
    """``npm ci`` into tests/foreign/node_modules unless amqplib is there (locked: two runs at
    once must not install into the same directory together)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("Node.js and npm are needed to publish as a Node service does")
    with open("/tmp/rm-foreign-npm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (FOREIGN / "node_modules" / "amqplib" / "package.json").exists():
            return
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=FOREIGN,
            check=True,
            timeout=300,
            capture_output=True,
        )


def publish_with_amqplib(exchange: str, messages: list[dict[str, Any]]) -> None:
    spec = {"url": support.broker_url(), "exchange": exchange, "messages": messages}
    result = subprocess.run(
        ["node", "publish_amqplib.js", json.dumps(spec)],
        cwd=FOREIGN,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def publish_with_kombu(exchange: str, messages: list[dict[str, Any]]) -> None:
    from kombu import Connection

    url = support.broker_url()
    with Connection(url, connect_timeout=10, transport_options={"confirm_publish": True}) as conn:
        producer = conn.Producer()
        for message in messages:
            producer.publish(
                json.dumps(message["body"]),
                exchange=exchange,
                routing_key="foreign.kombu",
                message_id=message["id"],
                headers=message.get("headers", {}),
                content_type="application/json",
                content_encoding="utf-8",
                delivery_mode=2,
                declare=[],
                retry=False,
            )


class RawProperties(pika.spec.BasicProperties):
    """Properties whose bytes go on the wire exactly as given (what no library would write)."""

    def __init__(self, raw: bytes) -> None:
        super().__init__()
        self.raw = raw

    def encode(self) -> list[bytes]:
        return [self.raw]


def _short(text: str) -> bytes:
    return struct.pack("B", len(text)) + text.encode()


def headers_nested(depth: int, message_id: str) -> bytes:
    """Properties whose header table nests ``depth`` levels: far beyond Python's recursion
    limit, and a valid frame RabbitMQ passes on."""
    table = struct.pack(">I", 3) + _short("t") + b"V"
    for _ in range(depth):
        entry = _short("k") + b"F" + table
        table = struct.pack(">I", len(entry)) + entry
    flags = (
        pika.spec.BasicProperties.FLAG_CONTENT_TYPE
        | pika.spec.BasicProperties.FLAG_HEADERS
        | pika.spec.BasicProperties.FLAG_DELIVERY_MODE
        | pika.spec.BasicProperties.FLAG_MESSAGE_ID
    )
    return (
        struct.pack(">H", flags) + _short("application/json") + table + b"\x02" + _short(message_id)
    )


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    queue: str
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    effects: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""
    returncode: int | None = None
    drained: bool = False
    timeout: str = ""

    def letter(self, message_id: str) -> dict[str, Any]:
        letters = [d for d in self.dead_letters if d["message_id"] == message_id]
        assert len(letters) == 1, (message_id, letters, self.timeout)
        return letters[0]

    def effect(self, message_id: str) -> dict[str, Any]:
        effects = [e for e in self.effects if e["message_id"] == message_id]
        assert len(effects) == 1, (message_id, effects, self.timeout)
        return effects[0]

    def refused_ids(self) -> list[dict[str, Any]]:
        return [d for d in self.dead_letters if "message_id is not UTF-8" in d["exception_message"]]


HANDLED = [
    "node-double",
    "node-ms-timestamp",
    "node-before-1970",
    "node-float",
    "node-good",
    "kombu-float",
    "kombu-good",
    "raw-long-binary-name",
    "raw-good",
]
DEAD = [
    "node-double-dead",
    "kombu-float-dead",
    "raw-routing-key",
    "raw-deep-headers",
    "raw-deep-json",
    "raw-huge-number",
    "raw-deep-payload",
]


def _settled(run: Run) -> bool:
    from reliable_messaging.models import DeadLetter
    from tests.testapp.models import Effect

    run.dead_letters = [dict(d) for d in DeadLetter.objects.filter(consumer=CONSUMER).values()]
    run.effects = [dict(e) for e in Effect.objects.filter(consumer="foreign").values()]
    dead = {d["message_id"] for d in run.dead_letters}
    done = {e["message_id"] for e in run.effects}
    return set(HANDLED) <= done and set(DEAD) <= dead and len(run.refused_ids()) == 2


def publish_everything(ns: str, queue: str) -> None:
    exchange = f"rmtest.{ns}"
    ensure_amqplib()
    publish_with_amqplib(
        exchange,
        [
            # A double, retried twice: it must survive being published again as a retry copy,
            # and so must what the first copy carried (as pika decoded it).
            {
                "routingKey": "foreign.node",
                "messageId": "node-double",
                "body": json.dumps({"fail_attempts": 2}),
                "headers": {"ratio": RATIO, "tiny": TINY},
            },
            {
                "routingKey": "foreign.node",
                "messageId": "node-double-dead",
                "body": json.dumps({"permanent": True}),
                "headers": {"ratio": RATIO},
            },
            {
                "routingKey": "foreign.node",
                "messageId": "node-ms-timestamp",
                "body": "{}",
                "headers": {"sent_at": {"$timestamp": str(JS_MS)}},
            },
            {
                "routingKey": "foreign.node",
                "messageId": "node-before-1970",
                "body": "{}",
                "headers": {"born": {"$timestamp": str(JAVA_1960)}},
            },
            {
                "routingKey": "foreign.node",
                "messageId": "node-float",
                "body": "{}",
                "headers": {"half": {"$float": 0.5}},
            },
            {"routingKey": "foreign.node", "messageId": "node-good", "body": "{}"},
        ],
    )
    publish_with_kombu(
        exchange,
        [
            {"id": "kombu-float", "body": {"from": "kombu"}, "headers": {"pi": PI}},
            {"id": "kombu-float-dead", "body": {"permanent": True}, "headers": {"pi": PI}},
            {"id": "kombu-good", "body": {}},
        ],
    )
    publisher = Publisher()
    try:
        publisher.publish(
            exchange,
            b"foreign.\xff",  # type: ignore[arg-type]  # raw bytes on purpose
            {"order": 1},
            message_id="raw-routing-key",
        )
        for binary_id in (b"\xff\x01", b"\xfe\x01"):
            publisher.publish(exchange, "foreign.raw", {"order": 2}, message_id=binary_id)
        publisher.publish(
            exchange,
            "foreign.raw",
            {"fail_attempts": 1},
            message_id="raw-long-binary-name",
            headers={LONG_BINARY_NAME: "x", "count": 7},
        )
        publisher.publish(
            exchange, "foreign.raw", body=deep_json(20_000), message_id="raw-deep-json"
        )
        publisher.publish(
            exchange,
            "foreign.raw",
            body=b'{"n": ' + b"9" * 5000 + b"}",
            message_id="raw-huge-number",
        )
        # Straight into the queue: an unexpected routing key, dead-lettered with its payload.
        publisher.publish("", queue, body=deep_json(600), message_id="raw-deep-payload")
    finally:
        publisher.close()
    connection = support.broker_connection(name="rm-tests raw frames")
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            exchange,
            "foreign.raw",
            b'{"order": 3}',
            RawProperties(headers_nested(3000, "raw-deep-headers")),
            mandatory=True,
        )
        channel.basic_publish(
            exchange, "foreign.raw", b"{}", pika.BasicProperties(message_id="raw-good")
        )
    finally:
        connection.close()


@pytest.fixture(scope="module")
def run(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    from reliable_messaging.models import DeadLetter, ProcessedMessage
    from tests.conftest import database_url
    from tests.testapp.models import Effect

    ns = support.new_namespace()
    queue = f"{ns}.foreign"
    result = Run(queue)
    proc: ConsumeProcess | None = None
    try:
        with django_db_blocker.unblock():
            env = {
                **os.environ,
                "RM_TEST_NAMESPACE": ns,
                "PYTHONUNBUFFERED": "1",
                "DJANGO_SETTINGS_MODULE": "tests.foreign.settings",
                "DATABASE_URL": database_url(),
            }
            env.pop("RM_TEST_CACHE_ALIAS", None)
            log = tmp_path_factory.mktemp("foreign") / "consume.log"
            proc = ConsumeProcess(["--queue", queue], env, log, settings="tests.foreign.settings")
            proc.wait_consuming()
            publish_everything(ns, queue)
            try:
                wait_until(
                    lambda: _settled(result),
                    timeout=40,
                    interval=0.2,
                    message="every foreign message handled or dead-lettered",
                )
                wait_until(lambda: support.drained(queue), timeout=15, interval=0.3)
                result.drained = True
            except WaitTimeout as exc:
                result.timeout = str(exc)
            _settled(result)
            result.returncode = proc.returncode
            result.log = proc.log()
        yield result
    finally:
        if proc is not None:
            proc.close()
        with django_db_blocker.unblock():
            DeadLetter.objects.filter(consumer=CONSUMER).delete()
            ProcessedMessage.objects.filter(consumer=CONSUMER).delete()
            Effect.objects.filter(consumer="foreign").delete()
        with contextlib.suppress(Exception):
            support.delete_broker_objects(ns)


def seen(run: Run, message_id: str, header: str) -> list[str]:
    """[type name, repr] of ``header`` as the handler received it."""
    headers: dict[str, list[str]] = run.effect(message_id)["payload"]["headers"]
    return headers[header]


# --------------------------------------------------------------------------- Node's amqplib


def test_node_doubles_reach_the_handler_exactly_even_after_a_retry(run: Run) -> None:
    assert run.effect("node-double")["attempt"] == 3  # two retry copies were published
    assert seen(run, "node-double", "ratio") == ["float", repr(RATIO)]
    assert seen(run, "node-double", "tiny") == ["float", repr(TINY)]


def test_node_double_is_exact_in_a_dead_letter(run: Run) -> None:
    letter = run.letter("node-double-dead")
    assert letter["reason"] == "permanent"
    assert letter["headers"]["ratio"] == RATIO
    assert bytes(letter["body"]) == json.dumps({"permanent": True}).encode()


def test_node_millisecond_timestamp_is_the_date_meant(run: Run) -> None:
    when = dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=dt.UTC)
    assert seen(run, "node-ms-timestamp", "sent_at") == ["datetime", repr(when)]


def test_java_style_date_before_1970_is_that_date(run: Run) -> None:
    when = dt.datetime(1960, 1, 1, tzinfo=dt.UTC)
    assert seen(run, "node-before-1970", "born") == ["datetime", repr(when)]


def test_node_amqp_float_is_a_float(run: Run) -> None:
    assert seen(run, "node-float", "half") == ["float", "0.5"]


# --------------------------------------------------------------------------- kombu


def test_kombu_float_header_reaches_the_handler_exactly(run: Run) -> None:
    assert seen(run, "kombu-float", "pi") == ["float", repr(PI)]


def test_kombu_float_header_is_exact_in_a_dead_letter(run: Run) -> None:
    letter = run.letter("kombu-float-dead")
    assert letter["reason"] == "permanent"
    assert letter["headers"]["pi"] == PI


# --------------------------------------------------------------------------- raw frames


def test_routing_key_that_is_not_utf8_is_one_dead_letter(run: Run) -> None:
    letter = run.letter("raw-routing-key")
    assert letter["reason"] == "invalid_headers"
    assert "routing key is not UTF-8" in letter["exception_message"]
    assert letter["routing_key"] == "foreign.\\xff"
    assert bytes(letter["body"]) == b'{"order": 1}'


def test_two_binary_message_ids_are_two_dead_letters(run: Run) -> None:
    refused = run.refused_ids()
    assert len(refused) == 2, run.dead_letters
    assert len({d["message_id"] for d in refused}) == 2
    assert all(d["reason"] == "invalid_headers" for d in refused)
    assert all(bytes(d["body"]) == b'{"order": 2}' for d in refused)


def test_a_long_binary_header_name_survives_a_retry_copy(run: Run) -> None:
    effect = run.effect("raw-long-binary-name")
    assert effect["attempt"] == 2  # the retry copy was published, and came back
    headers = effect["payload"]["headers"]
    assert headers["count"] == ["int", "7"]
    (name,) = [n for n in headers if n != "count"]
    assert name.startswith("\\xff") and len(name.encode()) <= 255


def test_headers_nested_beyond_the_recursion_limit_are_one_dead_letter(run: Run) -> None:
    letter = run.letter("raw-deep-headers")
    assert letter["reason"] == "invalid_headers"
    assert "could not be decoded" in letter["exception_message"]
    assert bytes(letter["body"]) == b'{"order": 3}'


@pytest.mark.parametrize(
    ("message_id", "says"),
    [("raw-deep-json", "nested too deeply"), ("raw-huge-number", "number too long")],
)
def test_json_python_cannot_decode_is_invalid_json(run: Run, message_id: str, says: str) -> None:
    letter = run.letter(message_id)
    assert letter["reason"] == "invalid_json"
    assert says in letter["exception_message"]
    assert bytes(letter["body"]).startswith(b"[" if message_id == "raw-deep-json" else b"{")


def test_a_payload_nested_600_deep_is_a_dead_letter_with_its_raw_body(run: Run) -> None:
    letter = run.letter("raw-deep-payload")
    assert letter["reason"] == "unexpected_routing_key"
    assert bytes(letter["body"]) == deep_json(600)
    assert letter["payload"] is None  # too deep to store as JSON; the body has all of it


def test_the_consumer_stays_up_and_handles_everything_behind_them_once(run: Run) -> None:
    assert run.returncode is None, run.log
    assert not run.timeout, run.timeout
    assert run.drained
    for message_id in HANDLED:
        run.effect(message_id)  # exactly one effect each
    assert not {e["message_id"] for e in run.effects} & set(DEAD)
    assert len(run.dead_letters) == len(DEAD) + 2
    assert "reconnecting" not in run.log, run.log
    assert "unexpected error" not in run.log, run.log


# --------------------------------------------------------------------------- record_dead_letter


def test_record_dead_letter_of_a_payload_nested_600_deep() -> None:
    from reliable_messaging.core.envelope import Delivery
    from reliable_messaging.dead_letters.record import record_dead_letter
    from reliable_messaging.models import DeadLetter

    body = deep_json(600)
    headers: dict[str, Any] = {"leaf": 1}
    for _ in range(400):
        headers = {"k": headers}
    delivery = Delivery(body=body, queue="q", exchange="ex", routing_key="rk", headers=headers)
    record_dead_letter(
        consumer=CONSUMER,
        delivery=delivery,
        message_id="deep-600",
        reason="permanent",
        attempts=1,
        payload=json.loads(body),
    )
    row = DeadLetter.objects.get(consumer=CONSUMER, message_id="deep-600")
    assert bytes(row.body) == body
    assert row.payload is None
    assert "nested deeper" in json.dumps(row.headers)
    shallow = json.loads(deep_json(50))
    record_dead_letter(
        consumer=CONSUMER,
        delivery=Delivery(body=deep_json(50), queue="q", exchange="ex", routing_key="rk"),
        message_id="deep-50",
        reason="permanent",
        attempts=1,
        payload=shallow,
    )
    assert DeadLetter.objects.get(consumer=CONSUMER, message_id="deep-50").payload == shallow


def test_dead_letters_of_two_refused_message_ids_stay_apart() -> None:
    from reliable_messaging.core.envelope import DecodeError, Delivery, decode_delivery
    from reliable_messaging.dead_letters.record import record_dead_letter
    from reliable_messaging.models import DeadLetter

    for binary_id in (b"\xff\x01", b"\xfe\x01"):
        delivery = Delivery(
            body=b"{}",
            queue="q",
            exchange="ex",
            routing_key="rk",
            message_id=binary_id,  # type: ignore[arg-type]  # bytes, as pika could hand over
        )
        error = decode_delivery(delivery, max_body_bytes=100)
        assert isinstance(error, DecodeError)
        record_dead_letter(
            consumer=CONSUMER,
            delivery=delivery,
            message_id=error.message_id,
            reason=error.reason,
            attempts=1,
            exception_message=error.detail,
        )
    assert DeadLetter.objects.filter(consumer=CONSUMER).count() == 2
