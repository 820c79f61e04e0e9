"""A dead letter replayed with real processes: the command, the relay, RabbitMQ, the consumer.

The story a user lives: a deploy breaks one consumer, its messages become dead letters while the
other subscriber of the routing key is fine; a fixed deploy goes out; the dead letters are
replayed. The replay must reach only the consumer that failed, take effect once, and resolve
the dead letter.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command

from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests.conftest import subprocess_env
from tests.support import MANAGE, ROOT, ConsumeProcess, Publisher, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

BROKEN = "RM_TEST_ALPHA_BROKEN"


def env_for(ns: str, **extra: str) -> dict[str, str]:
    return subprocess_env(ns, unset=(BROKEN,), **extra)  # only the processes that ask are broken


def effects(label: str, message_id: str) -> int:
    return Effect.objects.filter(consumer=label, message_id=message_id).count()


def test_replay_reaches_only_the_failed_consumer_and_resolves_it(
    ns: str, publisher: Publisher, tmp_path: Path
) -> None:
    broken = ConsumeProcess([], env_for(ns, **{BROKEN: "1"}), tmp_path / "consume-broken.log")
    fixed: ConsumeProcess | None = None
    try:
        broken.wait_consuming()
        payload = {"broken_while_env": {"alpha": BROKEN}}
        for message_id in ("order-1", "order-2"):
            publisher.publish(f"rmtest.{ns}", "order.placed", payload, message_id=message_id)
        wait_until(
            lambda: (
                DeadLetter.objects.filter(consumer="tests.alpha").count() == 2
                and effects("beta", "order-1") + effects("beta", "order-2") == 2
            ),
            timeout=30,
            message="two alpha dead letters and beta's two effects",
        )
        assert effects("alpha", "order-1") == 0  # rolled back with the failure

        # The fixed deploy: the broken process stops gracefully, a healthy one starts.
        broken.send(signal.SIGTERM)
        assert broken.wait(30) == 0
        # The relay below sends the replays: none beside the handlers takes them first.
        fixed = ConsumeProcess(
            ["--no-relay"], env_for(ns), tmp_path / "consume-fixed.log"
        ).wait_consuming()

        out = io.StringIO()
        call_command("replay_dead_letters", "--consumer", "tests.alpha", stdout=out)
        assert "replayed 2 dead letter(s), refused 0" in out.getvalue()
        relay = subprocess.run(
            [sys.executable, str(MANAGE), "relay", "--once", "--settings", "tests.settings"],
            cwd=ROOT,
            env=env_for(ns),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert relay.returncode == 0, relay.stdout + relay.stderr
        assert "sent 2" in relay.stdout

        wait_until(
            lambda: (
                DeadLetter.objects.filter(
                    consumer="tests.alpha", status=DeadLetterStatus.RESOLVED
                ).count()
                == 2
            ),
            timeout=30,
            message="both dead letters resolved by the consumer",
        )
        # Beta's inbox would absorb a copy silently, so look at what the healthy process was
        # handed: only alpha's queue may have received anything since the replay.
        assert "consumer=tests.beta" not in fixed.log(), fixed.log()
        for message_id in ("order-1", "order-2"):
            assert effects("alpha", message_id) == 1  # the replay took effect, once
            assert effects("beta", message_id) == 1
            assert ProcessedMessage.objects.filter(
                consumer="tests.alpha", message_id=message_id
            ).exists()
        letter = DeadLetter.objects.get(consumer="tests.alpha", message_id="order-1")
        assert letter.replay_count == 1
        assert [event["event"] for event in letter.history] == [
            "dead_lettered",
            "replayed",
            "resolved",
        ]
    finally:
        broken.close()
        if fixed is not None:
            fixed.close()
