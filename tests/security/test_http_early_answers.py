"""A connection answered before its request body was read is closed, and one whose answers are not read is dropped:
neither holds a place under the connection cap. Over a real server with a cap of 3 connections, on raw sockets.

An early answer (the Host check's 400, an unknown model's 404, 401, a 413 by ``Content-Length``, a 415) left the rest
of the body unread; one more byte then marked the connection busy with no timer left, and a few such sockets gave every
new request the cap's 503 for as long as they stayed open. A client pipelining requests and never reading the answers
held its place the same way, the server waiting for ever to send.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

CAP = 3
TOKEN = "a-long-enough-admin-token"
CLOSED_WITHIN_S = 30.0
"""A hang, not a slow host: the server closes within its linger (2 s) or its send timeout (1 s here)."""


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    # Long head and body timeouts: whatever closes these connections is not the timers that bound a slow request.
    limits = ["--header-timeout", "60", "--body-timeout", "60", "--max-body-bytes", "4096", "--send-timeout", "1"]
    env = {"HALFSERVE_ADMIN_TOKEN": TOKEN}
    return server_factory(served_tiny_store, *limits, "--max-connections", str(CAP), "--no-grpc", env=env)


def open_socket(server: ServerProcess, receive_buffer: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:  # set before connecting, so the window it advertises stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(CLOSED_WITHIN_S)
    sock.connect((host, int(port)))
    return sock


EARLY_ANSWERS = {
    "Host check": (b"POST /predict", b"Host: rebound.example.com\r\ncontent-type: application/json", 1000, 400),
    "unknown model": (b"POST /v2/models/nope/infer", b"Host: localhost\r\ncontent-type: application/json", 1000, 404),
    "admin token": (b"POST /models/tiny/load", b"Host: localhost\r\ncontent-type: application/json", 1000, 401),
    "Content-Length": (b"POST /predict", b"Host: localhost\r\ncontent-type: application/json", 10**6, 413),
    "Content-Type": (b"POST /predict", b"Host: localhost\r\ncontent-type: text/plain", 1000, 415),
}


def read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One whole answer on a connection kept open: its head and its ``Content-Length`` of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(h.split(b": ", 1) for h in head.lower().split(b"\r\n")[1:])
    while len(body) < int(fields[b"content-length"]):
        body += sock.recv(65536)
    return head, body


def answered_early(sock: socket.socket, kind: str) -> bytes:
    """Send ``kind``'s request with only the first byte of its body, read its answer's head and body (without
    waiting for the server to close), then send one more byte of the body; the answer's head."""
    line, headers, length, _ = EARLY_ANSWERS[kind]
    sock.sendall(line + b" HTTP/1.1\r\n" + headers + b"\r\ncontent-length: %d\r\n\r\n{" % length)
    head, _ = read_answer(sock)
    sock.sendall(b" ")
    return head


def closed_by_server(sock: socket.socket) -> bool:
    """Read (and drop) what comes until the server closes; False if it is still open after ``CLOSED_WITHIN_S``."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def predict(server: ServerProcess) -> int:
    return httpx.post(f"{server.url}/predict", json={"inputs": [[0.0] * 16]}, timeout=30).status_code


def test_a_body_read_whole_before_its_answer_keeps_the_connection(server: ServerProcess) -> None:
    """The close is for an answer that comes before the body is whole: a body arriving in several reads, then
    answered, leaves the connection kept for the next request."""
    body = b'{"inputs": [[' + b", ".join(b"0.0" for _ in range(16)) + b"]]}"
    head = b"POST /predict HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
    with contextlib.closing(open_socket(server)) as sock:
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body[:10])
        time.sleep(0.2)  # the rest in a read of its own (the test holds however long this takes)
        sock.sendall(body[10:])
        first, _ = read_answer(sock)
        sock.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        second, _ = read_answer(sock)
    assert first.startswith(b"HTTP/1.1 200 "), first
    assert b"connection: close" not in first.lower()
    assert second.startswith(b"HTTP/1.1 200 "), second


@pytest.mark.parametrize("kind", list(EARLY_ANSWERS))
def test_a_connection_answered_before_its_body_was_read_is_closed(server: ServerProcess, kind: str) -> None:
    with contextlib.closing(open_socket(server)) as sock:
        head = answered_early(sock, kind)
        assert head.startswith(b"HTTP/1.1 %d " % EARLY_ANSWERS[kind][3]), head
        assert b"\r\nconnection: close" in head.lower()
        assert closed_by_server(sock)
    assert predict(server) == 200


def test_connections_answered_early_do_not_hold_the_cap(server: ServerProcess) -> None:
    """Twice the cap of them, each kept open by the client after its one more byte: they are all closed, and a new
    request is served."""
    with ExitStack() as held:
        for i in range(2 * CAP):
            sock = held.enter_context(contextlib.closing(open_socket(server)))
            kinds = list(EARLY_ANSWERS)
            with contextlib.suppress(OSError):  # past the cap, the 503 comes first: also an early answer
                answered_early(sock, kinds[i % len(kinds)])
        wait_until(lambda: predict(server) == 200, "a request served while the early-answered sockets are open")


@pytest.fixture
def slow_readers(server: ServerProcess) -> Iterator[list[socket.socket]]:
    """A cap's worth of connections, each pipelining 2,000 requests for the OpenAPI document (megabytes of answers)
    and reading none of them."""
    request = b"GET /openapi.json HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with ExitStack() as held:
        socks = [held.enter_context(contextlib.closing(open_socket(server, receive_buffer=4096))) for _ in range(CAP)]
        for sock in socks:
            with contextlib.suppress(OSError):  # the server stops reading once it cannot send, or drops it
                sock.sendall(request * 2000)
        yield socks


def test_a_client_that_never_reads_its_answers_is_dropped_after_the_send_timeout(
    server: ServerProcess, slow_readers: list[socket.socket]
) -> None:
    wait_until(lambda: predict(server) == 200, "a request served while the slow readers are connected")
    for sock in slow_readers:
        assert closed_by_server(sock)  # what was sent before the drop, then the end: not every answer
    assert "(send_timeout): connection dropped" in server.log.read_text()
