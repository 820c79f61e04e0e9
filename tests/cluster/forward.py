"""A TCP forwarder, run as its own process: ``python forward.py LISTEN_HOST LISTEN_PORT
TARGET_HOST TARGET_PORT``.

The consumer in a network namespace reaches PostgreSQL (which listens on 127.0.0.1 only)
through it. A process of its own rather than a thread of the test run: its copying does not
share the test process's GIL (the traffic thread, the polling), it needs nothing installed
(socat or HAProxy may not be), and killing it is its whole teardown. Each accepted connection
gets its own connection to the target; bytes are copied both ways until either side closes.
It prints ``listening`` once bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listen_host: str, listen_port: int, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, target_writer), _pipe(target_reader, writer))

    server = await asyncio.start_server(handle, listen_host, listen_port, reuse_address=True)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    listen_host, listen_port, host, port = argv
    asyncio.run(_serve(listen_host, int(listen_port), host, int(port)))


if __name__ == "__main__":
    main(sys.argv[1:])
