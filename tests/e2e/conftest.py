"""Shared pieces of the end-to-end tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support import ManageProcess


class Provider:
    """The payment provider: an HTTP server that the test stops and starts, on the port it
    bound first (its own choice: none is picked free beforehand, for another to take)."""

    def __init__(self) -> None:
        self.port = 0
        self.calls = 0
        # Seconds each call takes, in turn (none: at once).
        self.delays: list[float] = []
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        provider = self

        class Charge(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                provider.calls += 1
                if provider.delays:
                    time.sleep(provider.delays[provider.calls % len(provider.delays)])
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"charged")

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Charge)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@pytest.fixture
def provider() -> Iterator[Provider]:
    server = Provider()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def processes(request: pytest.FixtureRequest) -> Iterator[list[ManageProcess]]:
    """Every process a test starts; killed in teardown, their logs shown when it fails."""
    started: list[ManageProcess] = []
    request.node._rm_processes = started
    yield started
    for process in started:
        process.close()
