"""HTTP's rules hold through an ``--http-workers`` front-end's relay as they do on a single-process server: relayed
answers carry a ``Content-Length`` (never chunked to an HTTP/1.0 client) and ``date`` and ``server`` once each; the
Host check judges what the client sent (none: answered; a foreign name: refused); and a request with two ``Host``
headers is a 400 in both modes (RFC 9112 section 3.2). Over real servers, with raw sockets so that HTTP/1.0 and
repeated headers reach the server as written."""

from __future__ import annotations

import socket
from pathlib import Path

import orjson
import pytest

from tests.conftest import ServerProcess, StartServer

pytestmark = pytest.mark.slow

RELAYED = ("/models", "/v2", "/v2/models/tiny", "/models/tiny/stats", "/metrics", "/health")
"""Routes a front-end relays to the engine process (``/health`` on its probe connections)."""


@pytest.fixture(scope="module")
def relayed(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    return server_factory(served_tiny_store, "--http-workers", "2")


@pytest.fixture(scope="module")
def single(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    return server_factory(served_tiny_store)


def exchange(url: str, head: list[str]) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send one request made of ``head`` (no body), read until the server closes: status, headers as sent, body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
    return int(status_line.split()[1]), headers, body


def names(headers: list[tuple[str, str]]) -> list[str]:
    return [k for k, _ in headers]


@pytest.mark.parametrize("path", RELAYED)
def test_http_1_0_answers_carry_a_length_not_chunks_and_each_header_once(
    relayed: ServerProcess, single: ServerProcess, path: str
) -> None:
    for server in (relayed, single):
        status, headers, body = exchange(server.url, [f"GET {path} HTTP/1.0", "Host: 127.0.0.1"])
        assert status == 200, (server.url, path, body)
        assert "transfer-encoding" not in names(headers), headers
        assert int(dict(headers)["content-length"]) == len(body), headers
        for name in ("date", "server", "content-type", "content-length"):
            assert names(headers).count(name) == 1, (name, headers)


def test_http_1_1_relayed_answers_carry_date_and_server_once(relayed: ServerProcess) -> None:
    for path in ("/v2/models/tiny", "/models", "/v2/repository/index"):
        method = "POST" if path.startswith("/v2/repository") else "GET"
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", "Content-Length: 0"]
        _, headers, _ = exchange(relayed.url, head)
        assert names(headers).count("date") == names(headers).count("server") == 1, (path, headers)


@pytest.mark.parametrize("path", RELAYED)
def test_a_request_without_a_host_is_answered_through_the_relay_as_without_it(
    relayed: ServerProcess, single: ServerProcess, path: str
) -> None:
    for server in (relayed, single):
        status, _, body = exchange(server.url, [f"GET {path} HTTP/1.0"])
        assert status == 200, (server.url, path, body)


@pytest.mark.parametrize("path", ["/models", "/v2/models/tiny", "/metrics"])
def test_a_foreign_host_is_still_refused_through_the_relay(relayed: ServerProcess, path: str) -> None:
    """The DNS-rebinding defence: a name the server does not answer to, sent by the client, is refused."""
    status, _, body = exchange(relayed.url, [f"GET {path} HTTP/1.0", "Host: rebound.example"])
    assert status == 400
    assert orjson.loads(body)["error"] == "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)"


@pytest.mark.parametrize("path", ["/models", "/v2/models/tiny", "/health", "/predict"])
def test_two_host_headers_are_refused_in_both_modes(relayed: ServerProcess, single: ServerProcess, path: str) -> None:
    method, extra = ("POST", ["Content-Length: 0"]) if path == "/predict" else ("GET", [])
    for server in (relayed, single):
        for hosts in (["127.0.0.1", "evil.com"], ["127.0.0.1", "127.0.0.1"]):
            head = [f"{method} {path} HTTP/1.1", *(f"Host: {h}" for h in hosts), "Connection: close", *extra]
            status, _, body = exchange(server.url, head)
            assert status == 400, (server.url, path, body)
            assert orjson.loads(body)["error"] == "Host: more than one Host header; send one"
        # The server goes on serving.
        assert exchange(server.url, ["GET /v2/models/tiny HTTP/1.0", "Host: 127.0.0.1"])[0] == 200
