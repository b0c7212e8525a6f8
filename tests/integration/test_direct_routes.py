"""The inference routes answered straight from the HTTP protocol (``halfserve.transport.DirectCycle``) keep HTTP/1.1's
rules: pipelined requests are answered in order, ``Expect: 100-continue`` is honoured, ``Connection: close`` and
HTTP/1.0 close after the answer, and a handler that fails answers 500 while the server goes on serving. Over real
servers on 127.0.0.1 and raw sockets, so that nothing in between reorders or reframes what the server wrote."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn

from halfserve.httpserver import uvicorn_config
from halfserve.settings import Settings
from halfserve.transport import Answer, DirectHandler
from tests.conftest import ServerProcess, StartServer, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    return server_factory(served_tiny_store)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def predict_request(sample: float, rid: str, *extra: str, version: str = "1.1", slow: bool = False) -> bytes:
    """A /predict request for one sample; ``slow``: gzipped with over 96 KiB of incompressible padding, which the
    server inflates in a worker thread, so that its answer takes longer than a plain request's. The padding is random
    digits past a value's last place that float32 keeps (a field of its own would be refused as one /predict does not
    read)."""
    body = orjson.dumps({"inputs": [[sample] * 16]})
    if slow:
        digits = "".join(secrets.choice("0123456789") for _ in range(240_000))
        padded = ",".join([repr(sample)] * 15 + [repr(sample) + "0" * 20 + digits])
        body = gzip.compress(f'{{"inputs": [[{padded}]]}}'.encode())
        assert len(body) > 96 << 10
        extra = (*extra, "Content-Encoding: gzip")
    head = [f"POST /predict HTTP/{version}", "Host: localhost", "Content-Type: application/json"]
    head += [f"X-Request-Id: {rid}"]
    head += [*extra, f"Content-Length: {len(body)}"]
    return "\r\n".join(head).encode() + b"\r\n\r\n" + body


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` whole responses from ``sock``, framed by their Content-Length: status, headers, body."""
    data = b""
    answers: list[tuple[int, dict[str, str], bytes]] = []
    while len(answers) < count:
        if b"\r\n\r\n" not in data or not _has_body(data):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(answers)} answers"
            data += chunk
            continue
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        answers.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
        data = rest[length:]
    return answers


def _has_body(data: bytes) -> bool:
    head, _, rest = data.partition(b"\r\n\r\n")
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            return len(rest) >= int(value)
    return True


def closed_after(sock: socket.socket) -> bool:
    """True when the server closes the connection (within the socket's timeout) with nothing more to send."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_pipelined_requests_are_answered_in_order(server: ServerProcess) -> None:
    alone = {
        rid: httpx.post(f"{server.url}/predict", json={"inputs": [[x] * 16]}, timeout=10).json()["outputs"]
        for rid, x in (("first", 1.0), ("second", -2.0))
    }
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server.url) as sock:
        # Three requests in one write: the second and third arrive while the first is still being read, and would
        # be answered first if they were started beside it.
        sock.sendall(predict_request(1.0, "first", slow=True) + predict_request(-2.0, "second") + health)
        answers = read_answers(sock, 3)
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [h.get("x-request-id") for _, h, _ in answers[:2]] == ["first", "second"]
    for (_, _, body), rid in zip(answers[:2], ("first", "second"), strict=True):
        assert orjson.loads(body)["outputs"] == alone[rid]
    assert orjson.loads(answers[2][2])["status"] == "live"


def test_expect_100_continue_is_answered_before_the_body(server: ServerProcess) -> None:
    request = predict_request(0.5, "expecting", "Expect: 100-continue")
    head, _, body = request.partition(b"\r\n\r\n")
    with connect(server.url) as sock:
        sock.sendall(head + b"\r\n\r\n")
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        [(status, headers, _)] = read_answers(sock, 1)
    assert status == 200
    assert headers["x-request-id"] == "expecting"


@pytest.mark.parametrize(
    ("extra", "version"), [(("Connection: close",), "1.1"), ((), "1.0")], ids=["connection-close", "http-1.0"]
)
def test_a_request_that_ends_the_connection_is_answered_then_closed(
    server: ServerProcess, extra: tuple[str, ...], version: str
) -> None:
    with connect(server.url) as sock:
        sock.sendall(predict_request(0.25, "last", *extra, version=version))
        [(status, headers, _)] = read_answers(sock, 1)
        assert status == 200
        assert headers["connection"] == "close"
        assert closed_after(sock)


def test_encoded_paths_and_query_strings_reach_the_v2_route(server: ServerProcess) -> None:
    body = {"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]}
    plain = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body, timeout=10)
    encoded = httpx.post(f"{server.url}/v2/models/ti%6Ey/versions/1/infer?trace=1", json=body, timeout=10)
    assert plain.status_code == encoded.status_code == 200
    assert encoded.json()["outputs"] == plain.json()["outputs"]
    assert encoded.json()["model_name"] == "tiny"


@contextlib.contextmanager
def direct_server(direct: dict[str, DirectHandler], keep_alive: float = 5.0) -> Iterator[str]:
    """A real uvicorn server on 127.0.0.1, in a thread, answering ``direct``'s paths through the protocol and
    everything else with 404 from a plain ASGI app; idle connections closed after ``keep_alive`` seconds."""

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

    port = free_port()

    def route(scope: dict[str, object]) -> DirectHandler | None:
        return direct.get(str(scope["path"]))

    config = uvicorn_config(app, Settings(), None, route, host="127.0.0.1", port=port)  # type: ignore[arg-type]
    config.lifespan, config.timeout_keep_alive = "off", keep_alive  # type: ignore[assignment]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "server did not start"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _Answer:
    body: bytes | memoryview

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code, self.body = status_code, body
        self.raw_headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]


async def _fails(scope: object, receive: object) -> Answer:
    raise RuntimeError("the handler failed")


async def _answers(scope: object, receive: object) -> Answer:
    await asyncio.sleep(0)
    return _Answer(200, b'{"ok":true}')


def test_a_failing_handler_answers_500_and_the_server_goes_on() -> None:
    with direct_server({"/fails": _fails, "/answers": _answers}) as url, httpx.Client(timeout=10) as client:
        failed = client.post(f"{url}/fails", content=b"{}")
        assert failed.status_code == 500
        assert failed.json() == {"error": "internal error"}
        assert failed.headers["connection"] == "close"
        assert client.post(f"{url}/answers", content=b"{}").json() == {"ok": True}
        assert client.get(f"{url}/answers").status_code == 404  # only POSTs go direct
        assert client.post(f"{url}/elsewhere").status_code == 404


def test_an_idle_connection_is_closed_a_keep_alive_timeout_after_its_last_answer() -> None:
    request = b"POST /answers HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    # The margins are the host's: a loaded one may take a second to run the server's timer or this thread.
    with direct_server({"/answers": _answers}, keep_alive=3.0) as url, connect(url) as sock:
        sock.sendall(request)
        assert read_answers(sock, 1)[0][0] == 200
        time.sleep(1.0)  # well inside the timeout: the connection stays open, and its idle time starts again
        # Timed from before the request: its answer, and the idle time after it, come later whenever this thread
        # runs again (timed from the answer's arrival, a late wake-up here shortened the idle time seen).
        sent = time.monotonic()
        sock.sendall(request)
        assert read_answers(sock, 1)[0][0] == 200
        assert closed_after(sock)
        idle = time.monotonic() - sent
    assert idle >= 2.9
