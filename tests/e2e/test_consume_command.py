"""``manage.py consume`` as real subprocesses: races, crashes, signals, a database outage.

Each process runs with the test's namespace (its own exchange and queues: ``<ns>.alpha`` and
``<ns>.beta`` of tests/testapp/consumers.py) against the test database. The processes are
SIGKILLed in teardown if still running, and their logs are attached to a failed test's report.
"""

from __future__ import annotations

import io
import re
import signal

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from reliable_messaging.models import DeadLetter
from tests import support
from tests.support import ConsumeProcess, Publisher, queue_counts, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def alpha_queue(ns: str) -> str:
    return f"{ns}.alpha"


def exchange(ns: str) -> str:
    return f"rmtest.{ns}"


def effect_count(message_id: str, label: str = "alpha") -> int:
    return Effect.objects.filter(consumer=label, message_id=message_id).count()


def in_transaction_backends() -> int:
    """Other sessions on the test database inside a transaction that has written an Effect row (a
    handler running: its inbox row and effect are written but not committed). A transaction alone
    is not enough: the relay beside the handlers claims outbox rows in its own."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE a.datname = current_database() AND l.pid <> pg_backend_pid() "
            "AND l.relation = %s::regclass AND l.mode = 'RowExclusiveLock'",
            [Effect._meta.db_table],
        )
        return int(cursor.fetchone()[0])


def wait_handler_running(proc: ConsumeProcess, timeout: float = 30) -> None:
    def running() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"consume exited with {proc.returncode}:\n{proc.log()}")
        return in_transaction_backends() > 0

    wait_until(running, timeout=timeout, interval=0.05, message="a handler in its transaction")


def log_lines(proc: ConsumeProcess, pattern: str) -> list[str]:
    return [line for line in proc.log().splitlines() if re.search(pattern, line)]


# --------------------------------------------------------------------------- command line


def test_idle_timeout_exits_zero(consume) -> None:
    proc = consume("--idle-timeout", "1")
    assert proc.wait(60) == 0
    assert "no delivery for 1.0s" in proc.log()


def test_unknown_queue_is_a_command_error(consume, ns: str) -> None:
    proc = consume("--queue", "no.such.queue")
    assert proc.wait(60) == 1
    log = proc.log()
    assert "CommandError: Unknown queue(s): no.such.queue" in log
    assert f"{ns}.alpha" in log and f"{ns}.beta" in log  # lists what is registered


def test_no_registered_consumer_is_a_command_error() -> None:
    from reliable_messaging.core.registry import registry

    with registry.isolated(), pytest.raises(CommandError, match="No consumers are registered"):
        call_command("consume", stdout=io.StringIO())


@pytest.mark.parametrize(
    ("options", "text"),
    [
        ({"queues": ["no.such.queue"]}, "Unknown queue(s): no.such.queue"),
        ({"concurrency": 0}, "--concurrency must be at least 1"),
        ({"idle_timeout": 0}, "--idle-timeout must be a positive number"),
    ],
)
def test_bad_options_are_command_errors(options: dict, text: str) -> None:
    with pytest.raises(CommandError, match=re.escape(text)):
        call_command("consume", stdout=io.StringIO(), **options)


# --------------------------------------------------------------------------- races and crashes


@pytest.fixture
def root_logging_at_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes started after this log everything at INFO through the root logger."""
    monkeypatch.setenv("RM_ROOT_LOG_LEVEL", "INFO")


def test_a_normal_start_says_it_consumes_and_logs_no_not_found(
    root_logging_at_info: None, consume
) -> None:
    """Starting looks for queues an earlier shape of a consumer may have left (passive
    declares, answered 404 when there are none): nothing alarming about that in the log, even
    with the root logger at INFO (where pika's own lines show)."""
    proc = consume().wait_consuming()
    log = proc.log()
    assert "consuming " in log
    # A reply code, not the digits inside a random namespace ("taefb404219") nor those of a
    # line's time or pid ("01:14:38,404 973 INFO logger message": the message alone).
    said = "\n".join(line.split(" ", 4)[-1] for line in log.splitlines())
    assert "NOT_FOUND" not in log and not re.search(r"\b404\b", said), log
    # Nor a line for every connection and channel pika opens (kept to its warnings unless the
    # project sets pika's level itself).
    assert " INFO pika" not in log, log


@pytest.fixture
def default_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processes started after this run with Django's default LOGGING (a project fresh
    from startproject): no handler for this app's loggers."""
    monkeypatch.setenv("RM_DEFAULT_LOGGING", "1")


def test_with_the_default_logging_consume_says_it_started_progresses_and_stopped(
    default_logging: None, consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--progress-interval", "0.5").wait_consuming()  # "consuming <queues> from"
    publisher.publish(exchange(ns), "order.placed", {}, message_id="say-1")
    proc.wait_for_log("progress: ", timeout=30)
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0
    log = proc.log()
    assert f"consuming {ns}.alpha" in log and "from amqp://" in log
    assert "processed=" in log.split("progress: ", 1)[1]
    assert "received SIGTERM: finishing the handlers in flight" in log
    assert "stopped gracefully" in log
    assert "processed message_id=" not in log  # per-message lines stay with LOGGING's choice
    assert log.count("stopped gracefully") == 1


def test_concurrent_duplicates_in_two_processes_take_effect_once(
    consume, ns: str, publisher: Publisher
) -> None:
    first = consume().wait_consuming()
    second = consume().wait_consuming()
    queues = (f"{ns}.alpha", f"{ns}.beta")
    # RabbitMQ round-robins a queue's deliveries over its consumers, but which consumer comes
    # next is not ours to set (a process's first fresh delivery subscribes it again at full
    # prefetch, which moves it in the rotation): a race whose two copies reached one process
    # is run again with a new message id, up to five times. Every run's effects count.
    for attempt in range(1, 6):
        message_id = f"race-{attempt}"
        # Both copies in flight at once: the second one's inbox insert waits on the first
        # one's uncommitted row, then finds it committed.
        for _ in range(2):
            publisher.publish(
                exchange(ns), "order.placed", {"sleep": {"alpha": 1}}, message_id=message_id
            )
        wait_until(
            lambda: support.drained(*queues),
            timeout=60,
            interval=0.3,
            message="both queues drained",
        )
        assert effect_count(message_id, "alpha") == 1
        assert effect_count(message_id, "beta") == 1
        key = rf"message_id={message_id} consumer=tests\.alpha"
        processed = {p.pid: log_lines(p, rf"processed {key}") for p in (first, second)}
        duplicate = {p.pid: log_lines(p, rf"duplicate {key}") for p in (first, second)}
        assert sum(map(len, processed.values())) == 1, processed
        assert sum(map(len, duplicate.values())) == 1, duplicate
        # The other process answered its copy as a duplicate, or, when the first one's
        # transaction outlasted INBOX_LOCK_TIMEOUT on a loaded machine, deferred it (the
        # deferred copy is then the duplicate, in whichever process it reaches).
        answered = {
            p.pid: log_lines(p, rf"{key} attempt=\d+ outcome=(duplicate|deferred)")
            for p in (first, second)
        }
        processed_by = {pid for pid, lines in processed.items() if lines}
        if any(lines for pid, lines in answered.items() if pid not in processed_by):
            break  # the race happened across the two processes, and took effect once
    else:
        pytest.fail("in five runs both copies of the message always reached the same process")
    assert first.returncode is None and second.returncode is None


def test_kill_9_mid_handler_then_restart_takes_effect_once(
    consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    publisher.publish(exchange(ns), "order.placed", {"sleep": {"alpha": 2}}, message_id="kill-1")
    wait_handler_running(proc)
    proc.send(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    # The uncommitted effect and inbox row died with the connection; the message went back.
    wait_until(lambda: in_transaction_backends() == 0, timeout=30)
    assert effect_count("kill-1") == 0
    wait_until(
        lambda: queue_counts(alpha_queue(ns)) == (1, 0),
        timeout=30,
        message="the message back in the queue, ready",
    )

    again = consume("--queue", alpha_queue(ns)).wait_consuming()
    wait_until(lambda: support.drained(alpha_queue(ns)), timeout=60, interval=0.3)
    assert effect_count("kill-1") == 1
    assert len(log_lines(again, r"processed message_id=kill-1 consumer=tests\.alpha")) == 1


def test_kill_9_after_commit_before_ack_redelivery_is_a_duplicate(
    consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    publisher.publish(
        exchange(ns), "order.placed", {"crash_after_commit": {"alpha": 1}}, message_id="crash-1"
    )
    assert proc.wait(60) == -signal.SIGKILL  # died right after its commit
    assert effect_count("crash-1") == 1
    # Never acked: the broker has it again.
    wait_until(
        lambda: queue_counts(alpha_queue(ns)) == (1, 0),
        timeout=30,
        message="the unacked message back in the queue",
    )

    again = consume("--queue", alpha_queue(ns)).wait_consuming()
    wait_until(lambda: support.drained(alpha_queue(ns)), timeout=60, interval=0.3)
    assert effect_count("crash-1") == 1
    assert len(log_lines(again, r"duplicate message_id=crash-1 consumer=tests\.alpha")) == 1
    assert not log_lines(again, r"processed message_id=crash-1")
    assert again.returncode is None


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_stop_finishes_the_handler_in_flight(
    consume, ns: str, publisher: Publisher, sig: signal.Signals
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    publisher.publish(
        exchange(ns), "order.placed", {"sleep": {"alpha": 1.5}}, message_id="graceful-1"
    )
    wait_handler_running(proc)
    proc.send(sig)
    assert proc.wait(60) == 0
    log = proc.log()
    assert f"received {sig.name}" in log
    assert "stopped gracefully" in log
    assert effect_count("graceful-1") == 1
    assert len(log_lines(proc, r"processed message_id=graceful-1 consumer=tests\.alpha")) == 1
    # Acked before exiting: nothing left to redeliver.
    assert queue_counts(alpha_queue(ns)) == (0, 0)


def test_second_sigterm_exits_at_once(consume, ns: str, publisher: Publisher) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    publisher.publish(
        exchange(ns), "order.placed", {"sleep": {"alpha": 60}}, message_id="impatient-1"
    )
    wait_handler_running(proc)
    proc.send(signal.SIGTERM)
    proc.wait_for_log("received SIGTERM")
    assert proc.returncode is None  # still waiting for its handler
    proc.send(signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM
    # Nothing committed, nothing acked: the message is back for the next consumer.
    wait_until(lambda: in_transaction_backends() == 0, timeout=30)
    assert effect_count("impatient-1") == 0
    wait_until(lambda: queue_counts(alpha_queue(ns)) == (1, 0), timeout=30)


# --------------------------------------------------------------------------- database outage


def test_database_outage_holds_the_message_then_processes_it_once(
    consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    connections.close_all()
    support.pg_ctl("stop")
    try:
        assert not support.pg_isready()
        publisher.publish(exchange(ns), "order.placed", {"order": 1}, message_id="outage-1")
        proc.wait_for_log("holding deliveries unacked", timeout=30)
        # Held, not acked, not dead-lettered, and the process is still up.
        wait_until(
            lambda: queue_counts(alpha_queue(ns)) == (0, 1),
            timeout=20,
            message="the message unacked",
        )
        assert proc.returncode is None
    finally:
        support.ensure_postgresql_up()
    wait_until(
        lambda: support.drained(alpha_queue(ns)),
        timeout=60,
        interval=0.3,
        message="the held message processed and acked after the database came back",
    )
    assert effect_count("outage-1") == 1
    assert len(log_lines(proc, r"processed message_id=outage-1 consumer=tests\.alpha")) == 1
    assert proc.returncode is None


def test_sigterm_during_a_database_outage_gives_the_message_back(
    consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    connections.close_all()
    support.pg_ctl("stop")
    try:
        publisher.publish(exchange(ns), "order.placed", {"order": 2}, message_id="outage-2")
        proc.wait_for_log("holding deliveries unacked", timeout=30)
        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0
        # Released (nack + requeue), not lost and not dead-lettered.
        wait_until(lambda: queue_counts(alpha_queue(ns)) == (1, 0), timeout=20)
    finally:
        support.ensure_postgresql_up()
    again = consume("--queue", alpha_queue(ns)).wait_consuming()
    wait_until(lambda: support.drained(alpha_queue(ns)), timeout=60, interval=0.3)
    assert effect_count("outage-2") == 1
    assert len(log_lines(again, r"processed message_id=outage-2 consumer=tests\.alpha")) == 1


def test_database_lost_while_a_handler_runs_then_processed_once(
    consume, ns: str, publisher: Publisher
) -> None:
    proc = consume("--queue", alpha_queue(ns)).wait_consuming()
    publisher.publish(exchange(ns), "order.placed", {"sleep": {"alpha": 2}}, message_id="outage-3")
    wait_handler_running(proc)
    connections.close_all()
    support.pg_ctl("stop")  # kills the handler's transaction under it
    try:
        # The commit fails. With the database still down the delivery is held unacked; had
        # it come back already (another process may restart it), the failure would be an
        # ordinary retry. Either way nothing is acked before the effect commits.
        wait_until(
            lambda: (
                "holding deliveries unacked" in proc.log()
                or re.search(r"message_id=outage-3 .*outcome=retry", proc.log())
            ),
            timeout=30,
            message="the failed commit handled",
        )
        assert proc.returncode is None
    finally:
        support.ensure_postgresql_up()
    wait_until(
        lambda: support.drained(alpha_queue(ns)),
        timeout=60,
        interval=0.3,
        message="processed after the database came back",
    )
    assert effect_count("outage-3") == 1
    assert len(log_lines(proc, r"processed message_id=outage-3 consumer=tests\.alpha")) == 1
    assert not DeadLetter.objects.exists()
    assert proc.returncode is None
