"""The relay's publishing step alone: ``InFlight.publish`` of 500-row batches through
``ConfirmingPublisher``, on a stand-in connection that keeps what pika's transport would be
handed (pika's own ``Channel.basic_publish`` and ``Connection._send_message`` where a build
uses them), in µs of thread CPU or in instructions per message.

    .venv/bin/python bench/relay_encoding.py [--builds NAME=PATH,...] [--rounds 3]
        [--callgrind]

Each build runs in a process of its own (its tree first on the path), the builds alternating
round by round: ``--batches`` batches a loop, the best of ``--loops`` loops (thread CPU, what
the machine's load moves least). With ``--callgrind`` each build runs under
``valgrind --tool=callgrind`` with one loop and with three, and the difference over the extra
messages is its instructions per message: the start-up cancels out, and the count does not move
with the load of a shared machine. No broker and no database: the rows are made here, as the
claim makes them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_builds

HERE = Path(__file__).resolve()
BATCH = 500


def child(batches: int, loops: int) -> None:
    """In the build's tree: publish ``batches`` batches ``loops`` times; print the best µs."""
    import dataclasses
    import datetime as dt
    import time
    from types import SimpleNamespace

    import django

    django.setup()
    import pika.channel
    import pika.connection

    from reliable_messaging.broker import publisher as publisher_module
    from reliable_messaging.conf import messaging_settings
    from reliable_messaging.core.liveness import HealthState
    from reliable_messaging.publishing.claims import Claim, ClaimedRow
    from reliable_messaging.publishing.in_flight import InFlight
    from reliable_messaging.publishing.relay import RelayReport

    class Connection:
        """What pika's connection does with a message, its transport a list."""

        bytes_sent = 0
        frames_sent = 0
        is_open = True
        _body_max_length = 131_072 - 8
        _send_method = pika.connection.Connection._send_method  # type: ignore[attr-defined]
        _send_message = pika.connection.Connection._send_message  # type: ignore[attr-defined]
        _output_marshaled_frames = pika.connection.Connection._output_marshaled_frames  # type: ignore[attr-defined]

        def __init__(self) -> None:
            self.written: list[bytes] = []

        def _adapter_emit_data(self, data: bytes) -> None:
            self.written.append(data)

    class Channel:
        """pika's own publishing methods on an open channel."""

        channel_number = 1
        is_open = True
        OPEN = _state = pika.channel.Channel.OPEN
        basic_publish = pika.channel.Channel.basic_publish
        _raise_if_not_open = pika.channel.Channel._raise_if_not_open  # type: ignore[attr-defined]
        _send_method = pika.channel.Channel._send_method  # type: ignore[attr-defined]

        def __init__(self, connection: Connection) -> None:
            self.connection = connection

    publisher = publisher_module.ConfirmingPublisher(messaging_settings)
    connection = Connection()
    channel = Channel(connection)
    publisher._connection = connection  # type: ignore[assignment]
    publisher._channel = channel  # type: ignore[assignment]
    frames_for = getattr(publisher_module, "publish_frames_for", None)
    if frames_for is not None:
        publisher._frames = frames_for(connection, channel)
    publisher.exchange_exists = lambda exchange: True  # type: ignore[method-assign]
    publisher.call_later = lambda delay, callback: None  # type: ignore[method-assign]
    publisher.cancel = lambda timer: None  # type: ignore[method-assign]
    in_flight = InFlight(
        publisher,
        SimpleNamespace(settings=messaging_settings),  # type: ignore[arg-type]
        RelayReport(),
        HealthState(),
        None,
    )
    # The time a row's age counts from, as the build's ClaimedRow holds it.
    if "published_us" in {column.name for column in dataclasses.fields(ClaimedRow)}:
        published: dict[str, Any] = {"published_us": time.time_ns() // 1000}
    else:
        published = {"created_at": dt.datetime.now(dt.UTC)}
    claims = [
        [
            ClaimedRow(
                pk=start + i,
                message_id=f"{start + i:032x}",
                exchange="rm.bench",
                routing_key="bench.order",
                body=f'{{"order_id": {i}, "amount": "19.99", "customer": "c{i % 97}"}}',
                headers={},
                raw_body=None,
                raw_properties=None,
                ordering_key=None,
                attempts=0,
                **published,
            )
            for i in range(BATCH)
        ]
        for start in range(0, batches * BATCH, BATCH)
    ]
    worker = SimpleNamespace(batch=None)
    best = float("inf")
    for _ in range(loops):
        started = time.thread_time()
        for rows in claims:
            in_flight.publish(worker, Claim(rows=rows), lambda recorded: None)  # type: ignore[arg-type]
            connection.written.clear()
            in_flight._batches.clear()
        best = min(best, time.thread_time() - started)
    print(json.dumps({"us": best * 1e6 / (batches * BATCH), "direct": frames_for is not None}))


def run_build(root: Path, batches: int, loops: int, wrapper: list[str] | None = None) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONHASHSEED": "0",
        "RM_LOG_LEVEL": "WARNING",
    }
    command = [*(wrapper or []), sys.executable, str(HERE), "--child", str(batches), str(loops)]
    result = subprocess.run(command, env=env, cwd="/tmp", capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{root}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def instructions(root: Path, batches: int) -> float:
    """Instructions per message under callgrind: three loops less one, over the extra ones."""
    totals = []
    with tempfile.TemporaryDirectory() as directory:
        for loops in (1, 3):
            out = Path(directory) / f"callgrind.{loops}.out"
            run_build(
                root,
                batches,
                loops,
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"],
            )
            summary = next(
                line
                for line in out.read_text().splitlines()
                if line.startswith(("summary:", "totals:"))
            )
            totals.append(int(summary.split()[1]))
    return (totals[1] - totals[0]) / (2 * batches * BATCH)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--builds", help="NAME=PATH,NAME=PATH: source trees, alternated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="500-row batches a loop")
    parser.add_argument("--loops", type=int, default=3)
    parser.add_argument("--callgrind", action="store_true")
    args = parser.parse_args()
    builds = parse_builds(args.builds)
    results: dict[str, list[float]] = {name: [] for name in builds}
    for round_ in range(args.rounds):
        names = list(builds)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            load = os.getloadavg()[0]
            if args.callgrind:
                value = instructions(builds[name], args.batches)
                print(f"round {round_ + 1} {name}: {value:,.0f} instructions per message")
            else:
                value = run_build(builds[name], args.batches, args.loops)["us"]
                print(f"round {round_ + 1} {name}: {value:.1f} us per message (load {load:.1f})")
            results[name].append(value)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
