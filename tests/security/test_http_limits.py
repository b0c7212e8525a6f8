"""Every connection is held to limits: idle, trickling and oversized ones are answered (408, 414, 431, 503) and
closed, and the server keeps serving everyone else. Over a real server, with short timeouts so the tests are quick."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    limits = ["--header-timeout", "1", "--body-timeout", "1", "--max-url-bytes", "1024", "--max-header-bytes", "4096"]
    return server_factory(served_tiny_store, *limits, "--max-connections", "16")


@contextmanager
def connection(server: ServerProcess) -> Iterator[socket.socket]:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def answer(sock: socket.socket) -> tuple[int, bytes, float]:
    """Read until the server closes: the status, the whole answer, and how long it took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data, time.monotonic() - start


def send_slowly(sock: socket.socket, data: bytes, every: float) -> None:
    """A byte at a time, ``every`` seconds apart, until the server hangs up."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return
        time.sleep(every)


def send_part_of_a_body(sock: socket.socket, part: bytes) -> None:
    """A /predict request announcing a 1000-byte body, and only ``part`` of it."""
    head = b"POST /predict HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
    head += b"content-length: 1000\r\n\r\n"
    sock.sendall(head + part)


def metric(server: ServerProcess, status: int) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("halfserve_requests_total{") and f'status="{status}"' in line
    )


def still_serving(server: ServerProcess) -> None:
    assert server.proc.poll() is None
    r = httpx.post(f"{server.url}/predict", json={"inputs": [[0.0] * 16]}, timeout=10)
    assert r.status_code == 200


def test_an_idle_connection_is_closed_after_the_header_timeout(server: ServerProcess) -> None:
    with connection(server) as sock:
        status, data, took = answer(sock)
    assert status == 408
    assert b"(header_timeout)" in data
    assert took < 5
    # The protocol's own answers carry date and server as the app's do (they had neither).
    head = data.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
    names = sorted(line.split(b":")[0] for line in head if line.startswith((b"date:", b"server:")))
    assert names == [b"date", b"server"]
    still_serving(server)


def test_headers_trickled_a_byte_at_a_time_are_cut_off(server: ServerProcess) -> None:
    head = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\nx-padding: " + b"a" * 200
    with connection(server) as sock:
        start = time.monotonic()
        send_slowly(sock, head, every=0.05)  # the head's first byte re-arms the timer once; then 1 s
        status, data, _ = answer(sock)
    assert status == 408
    assert time.monotonic() - start < 5
    still_serving(server)


def read_one_answer(sock: socket.socket) -> bytes:
    """One whole answer on a connection kept open: its head, then its Content-Length of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v) for k, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_the_next_request_on_a_kept_connection_is_held_to_the_header_timeout(server: ServerProcess) -> None:
    """A request that arrived whole leaves no timer behind; the next one's head, trickled, still gets one."""
    with connection(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_one_answer(sock).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        send_slowly(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nx-padding: " + b"a" * 200, every=0.05)
        status, data, _ = answer(sock)
    assert status == 408
    assert b"(header_timeout)" in data
    assert time.monotonic() - start < 5
    still_serving(server)


def test_a_body_trickled_within_the_gap_is_cut_off_at_the_minimum_rate(server: ServerProcess) -> None:
    """A byte every 0.25 s never leaves a 1 s gap, so the gap alone would read it for as long as it is sent; the
    body must come at --min-body-rate once its first --body-timeout is over, and is answered 408 while it trickles."""
    sent = 0
    with connection(server) as sock:
        send_part_of_a_body(sock, b"")
        while sent < 40 and not select.select([sock], [], [], 0.25)[0]:  # 10 s of bytes, unless answered first
            sock.sendall(b" ")
            sent += 1
        status, data, _ = answer(sock)
    assert status == 408, data
    assert b"(min_body_rate)" in data
    assert sent < 40  # answered while the body was still arriving
    still_serving(server)


def test_a_stalled_body_is_a_408_counted_as_one(server: ServerProcess) -> None:
    before = metric(server, 408)
    with connection(server) as sock:
        send_part_of_a_body(sock, b'{"inputs": [[0.0, ')
        status, data, took = answer(sock)
    assert status == 408
    assert b"(body_timeout)" in data
    assert took < 5
    time.sleep(0.2)
    assert metric(server, 408) == before + 1
    still_serving(server)


@pytest.mark.parametrize(
    ("what", "head", "status", "setting"),
    [
        ("a long URL", b"GET /health?" + b"a" * (2 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, b"(max_url_bytes)"),
        (
            "one long header",
            b"GET /health HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * (2 << 20) + b"\r\n\r\n",
            431,
            b"max_",
        ),
        (
            "many small headers",
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 40) for i in range(200)),
            431,
            b"(max_header_bytes)",
        ),
    ],
)
def test_an_oversized_head_is_refused_before_it_is_read_whole(
    server: ServerProcess, what: str, head: bytes, status: int, setting: bytes
) -> None:
    with connection(server) as sock:
        with contextlib.suppress(OSError):  # the server answered and hung up before the rest was sent: the point
            sock.sendall(head)
        got, data, _ = answer(sock)
    assert got == status, (what, data[:300])
    assert setting in data
    still_serving(server)


@pytest.fixture(scope="module")
def capped(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    """A server with a cap of 8 connections, and timeouts long enough for a test to hold them."""
    limits = ["--header-timeout", "60", "--body-timeout", "60"]
    return server_factory(served_tiny_store, *limits, "--max-connections", "8", "--no-grpc")


def test_probes_are_answered_while_slow_bodies_hold_every_connection(capped: ServerProcess) -> None:
    """8 bodies trickling in hold the cap, and 40 silent connections more take every place kept past it for probes:
    the probes are still answered (the silent connection waiting longest gives its place up), every other request
    gets the cap's 503."""
    host, port = capped.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(8)]
    try:
        for sock in held:  # accepted before the silent ones, which connect after them
            send_part_of_a_body(sock, b'{"inputs": ')
        silent = [socket.create_connection((host, int(port)), timeout=30) for _ in range(40)]
        try:
            probes = [httpx.get(f"{capped.url}{path}", timeout=30) for path in ("/health", "/ready", "/v2/health/live")]
            predict = httpx.post(f"{capped.url}/predict", json={"inputs": [[0.0] * 16]}, timeout=30)
        finally:
            for sock in silent:
                sock.close()
    finally:
        for sock in held:
            sock.close()
    assert [r.status_code for r in probes] == [200, 200, 200], [r.text for r in probes]
    assert probes[0].headers["connection"] == "close"  # its place is for the next probe
    assert predict.status_code == 503
    assert predict.json()["error"].endswith("(max_connections)")
    assert predict.headers["retry-after"] == "1"


async def test_a_burst_past_the_cap_is_answered_503_not_reset(capped: ServerProcess) -> None:
    """100 requests at once on their own connections, past a cap of 8 (and its 32 places for probes): each is
    answered, 200 or the cap's 503; none is reset before its answer is read."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=capped.url, limits=limits, timeout=30) as client:

        async def predict() -> int | str:
            try:
                r = await client.post("/predict", json={"inputs": [[0.0] * 16]})
            except httpx.TransportError as e:
                return type(e).__name__
            assert r.status_code == 200 or r.json()["error"].endswith("(max_connections)"), r.text
            return r.status_code

        answers = await asyncio.gather(*(predict() for _ in range(100)))
    assert set(answers) == {200, 503}, answers
    still_serving(capped)


def test_connections_past_the_cap_are_refused_and_the_server_recovers(server: ServerProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(16)]
    try:
        with connection(server) as extra:
            status, data, _ = answer(extra)
    finally:
        for s in held:
            s.close()
    assert status == 503
    assert b"(max_connections)" in data
    time.sleep(0.3)  # the held ones are closed; the slots are free again
    still_serving(server)


def test_a_client_gone_mid_body_is_a_499_without_a_traceback(server: ServerProcess) -> None:
    before = metric(server, 499)
    with connection(server) as sock:
        send_part_of_a_body(sock, b'{"inputs": ')
        time.sleep(0.2)
    time.sleep(0.5)
    assert metric(server, 499) == before + 1
    assert metric(server, 500) == 0
    assert "Traceback" not in server.log.read_text()
    still_serving(server)


@pytest.mark.parametrize("given", ["a b", "user=admin", "x\ty", "k=v status=200", "é"])
def test_request_ids_that_could_forge_log_fields_are_replaced(server: ServerProcess, given: str) -> None:
    r = httpx.post(
        f"{server.url}/predict",
        json={"inputs": [[0.0] * 16]},
        headers={"X-Request-Id": given.encode()},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] != given
    assert all(c.isalnum() or c in "._:-" for c in r.headers["x-request-id"])
