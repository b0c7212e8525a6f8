"""A client that pipelines requests and never reads the answers holds a bounded amount of the server's memory.

The server went on reading such a connection's requests and queued every one of them, each with its request's state,
until the send timeout dropped the connection: clients pipelining ``GET /metrics`` by the hundred grew a server by
gigabytes. Now a connection whose answers wait for the client is not read further, nor more than a few of its
pipelined requests queued. Over a real server on raw sockets, its resident memory read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer

pytestmark = pytest.mark.slow

CONNECTIONS = 4
REQUEST = b"GET /openapi.json HTTP/1.1\r\nHost: localhost\r\n\r\n"
PER_WRITE = 2000
"""Requests a client sends in one write (about 100 KB of them)."""
ROUNDS = 60
"""Writes each client tries, a tenth of a second apart: what it sends is all the server may read, whatever its speed."""
GROWTH_BOUND = 100 * 2**20
"""Without a bound the server grew by 100 to 200 MiB here in 4 s (its queued requests); with it, by about 1 MiB."""


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    # A send timeout longer than the test: what bounds these connections is not that they are dropped.
    return server_factory(served_tiny_store, "--send-timeout", "300", "--no-grpc")


def rss(server: ServerProcess) -> int:
    """The server's resident memory, in bytes."""
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def unread(server: ServerProcess) -> Iterator[list[socket.socket]]:
    host, port = server.url.removeprefix("http://").split(":")
    with ExitStack() as held:
        socks = []
        for _ in range(CONNECTIONS):
            sock = held.enter_context(contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect((host, int(port)))
            sock.setblocking(False)  # sends what the server's window takes, never waits for it
            socks.append(sock)
        yield socks


def test_a_connection_whose_answers_are_not_read_is_not_read_further(
    server: ServerProcess, unread: list[socket.socket]
) -> None:
    assert httpx.get(f"{server.url}/openapi.json", timeout=30).status_code == 200  # built once, before measuring
    before = rss(server)
    most = before
    for _ in range(ROUNDS):
        for sock in unread:
            with contextlib.suppress(BlockingIOError):
                sock.send(REQUEST * PER_WRITE)
        most = max(most, rss(server))
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    most = max(most, rss(server))
    assert most - before < GROWTH_BOUND, f"grew by {(most - before) / 2**20:.0f} MiB"


def test_pipelined_requests_past_the_queue_bound_are_all_answered_in_order(server: ServerProcess) -> None:
    """The connection is held past 16 queued requests, then read on: every answer comes, in order."""
    host, port = server.url.removeprefix("http://").split(":")
    with contextlib.closing(socket.create_connection((host, int(port)), timeout=30)) as sock:
        paths = [b"/health" if i % 2 else b"/nope-%d" % i for i in range(200)]
        sock.sendall(b"".join(b"GET %s HTTP/1.1\r\nHost: localhost\r\n\r\n" % path for path in paths))
        data = b""
        while data.count(b"HTTP/1.1 ") < len(paths):
            chunk = sock.recv(65536)
            assert chunk, f"closed after {data.count(b'HTTP/1.1 ')} answers"
            data += chunk
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
    assert statuses == [b"200" if i % 2 else b"404" for i in range(200)]
