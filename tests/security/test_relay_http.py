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


def exchange(url: str, head: list[str], body: bytes = b"") -> tuple[int, list[tuple[str, str]], bytes]:
    """Send one request made of ``head`` and ``body``, read until the server closes: status, headers as sent, body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
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


GET_ROUTES = ("/v2/health/ready", "/v2/models/tiny", "/v2", "/health", "/ping")
"""GET routes, relayed and answered by a front-end alike, whose answers do not change from one request to the next."""


def close_head(method: str, path: str, *extra: str) -> list[str]:
    return [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *extra]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_is_answered_wherever_get_is_with_get_s_headers_and_no_body(
    relayed: ServerProcess, single: ServerProcess, path: str
) -> None:
    """RFC 9110 section 9.3.2 (it was a 405)."""
    for server in (relayed, single):
        get_status, get_headers, get_body = exchange(server.url, close_head("GET", path))
        status, headers, body = exchange(server.url, close_head("HEAD", path))
        assert (status, body) == (get_status, b""), (server.url, path, status, body)
        for name in ("content-type", "content-length"):
            assert dict(headers)[name] == dict(get_headers)[name], (server.url, path, name)
        assert int(dict(headers)["content-length"]) == len(get_body) > 0


def test_a_method_a_get_route_does_not_take_is_a_405_naming_get_and_head(
    relayed: ServerProcess, single: ServerProcess
) -> None:
    for server in (relayed, single):
        status, headers, body = exchange(server.url, close_head("DELETE", "/v2/models/tiny"))
        assert status == 405, (server.url, body)
        assert dict(headers)["allow"] == "GET, HEAD"


PAST_THE_CAP = b"x" * (100 * 2**10)
"""A body past the relay's cap (64 KiB): a front-end reads no more of a request it relays."""
FRAMINGS = {
    "length": ([f"Content-Length: {len(PAST_THE_CAP)}"], PAST_THE_CAP),
    "chunked": (["Transfer-Encoding: chunked"], b"%x\r\n%s\r\n0\r\n\r\n" % (len(PAST_THE_CAP), PAST_THE_CAP)),
}
"""The body declared (the relay refuses it from its head) or chunked (once it has read its cap of it)."""
PER_ANSWER = ("date", "x-request-id")
"""Headers whose values differ from one answer to the next."""


def same_in_both(name: str, value: str) -> str:
    """A header's value as both modes must agree on it: none for :data:`PER_ANSWER`."""
    return "" if name in PER_ANSWER else value


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/models/tiny:frobnicate"),  # KServe V1's 404 naming the verb it serves
        ("DELETE", "/predictions/tiny"),  # TorchServe's 405, in its own shape
        ("PUT", "/v2/models/tiny/infer"),  # a 405 naming POST
        ("POST", "/v2/models/tiny/versions/1/frobnicate"),
        ("POST", "/nonexistent"),
        ("POST", "/v1/models/tiny:explain"),  # explanations are not served: a route of its own had taken it
        ("GET", "/v1/models/tiny:explain"),
    ],
)
def test_a_large_body_for_no_route_gets_the_router_s_answer_not_the_relay_s_413(
    relayed: ServerProcess, single: ServerProcess, method: str, path: str, framing: str
) -> None:
    """A front-end refused the body of a request it relays past its cap with a 413 ("body: 102400 bytes exceed a
    management call's limit") before asking whether any route takes the request: "too large" where one process
    answers that there is no such route, or that it takes another method."""
    extra, body = FRAMINGS[framing]
    found = []
    for server in (relayed, single):
        status, headers, answer = exchange(server.url, close_head(method, path, *extra), body)
        found.append((status, orjson.loads(answer), [(k, same_in_both(k, v)) for k, v in headers]))
    assert found[0] == found[1], found
    assert found[0][0] in (404, 405), found
    assert exchange(relayed.url, close_head("GET", "/v2/models/tiny"))[0] == 200


@pytest.mark.parametrize("framing", FRAMINGS)
@pytest.mark.parametrize("path", ["/v2/models/tiny", "/models/tiny"])
def test_a_get_s_body_past_the_relay_cap_is_left_unread_as_one_process_leaves_it(
    relayed: ServerProcess, single: ServerProcess, path: str, framing: str
) -> None:
    """No route reads a GET's body: one process answers the GET; a front-end had refused the body with a 413."""
    extra, body = FRAMINGS[framing]
    for server in (relayed, single):
        status, _, answer = exchange(server.url, close_head("GET", path, *extra), body)
        assert (status, orjson.loads(answer)["name"]) == (200, "tiny"), (server.url, answer)


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_relayed_route_still_refuses_a_body_past_the_relay_cap(relayed: ServerProcess, framing: str) -> None:
    """In one process's words, with the request's id (the front-end's 413 had read "body: 102400 bytes exceed a
    management call's limit", without an ``X-Request-Id``)."""
    extra, body = FRAMINGS[framing]
    head = close_head("POST", "/v2/repository/models/tiny/load", *extra)
    status, headers, answer = exchange(relayed.url, head, body)
    assert status == 413, answer
    size = "102400 bytes exceed the limit of 65536 bytes" if framing == "length" else "more than 65536 bytes"
    assert orjson.loads(answer)["error"] == f"body: {size} (a management call's limit)"
    assert dict(headers)["x-request-id"]
    status, headers, _ = exchange(relayed.url, [*head, "X-Request-Id: relayed-413"], body)
    assert (status, dict(headers)["x-request-id"]) == (413, "relayed-413")


def test_a_client_asking_which_route_takes_its_request_is_answered_as_any_other(
    relayed: ServerProcess, single: ServerProcess
) -> None:
    """The header a front-end sends to ask the engine process which route takes a request without running it is
    dropped from what clients send, as the client address header is."""
    for server in (relayed, single):
        status, _, body = exchange(server.url, close_head("GET", "/v2/models/tiny", "X-Halfserve-Route-Only: 1"))
        assert (status, orjson.loads(body)["name"]) == (200, "tiny"), (server.url, status, body)


@pytest.mark.parametrize("path", ["/models", "/v2/models/tiny", "/health", "/v2/health/ready"])
def test_an_http_1_1_request_without_a_host_is_a_400_in_both_modes(
    relayed: ServerProcess, single: ServerProcess, path: str
) -> None:
    """RFC 9112 section 3.2 (it was served); HTTP/1.0 needs none (above)."""
    for server in (relayed, single):
        status, _, body = exchange(server.url, [f"GET {path} HTTP/1.1", "Connection: close"])
        assert status == 400, (server.url, path, body)
        assert orjson.loads(body)["error"] == "Host: missing; an HTTP/1.1 request must send one (RFC 9112 section 3.2)"
        assert exchange(server.url, close_head("GET", path))[0] == 200


@pytest.mark.parametrize(
    ("host", "error"),
    [
        ("127.0.0.1:99999", "Host: '127.0.0.1:99999' names port 99999, past 65535"),
        ("127.0.0.1:abc", "Host: '127.0.0.1:abc' is not a host and optional port"),
        ("user@127.0.0.1", "Host: 'user@127.0.0.1' is not a host and optional port"),
        ("127.0.0.1/x", "Host: '127.0.0.1/x' is not a host and optional port"),
    ],
)
def test_a_host_that_is_no_host_and_port_is_a_400_on_every_route(
    relayed: ServerProcess, single: ServerProcess, host: str, error: str
) -> None:
    """RFC 9112 section 3.2 (each was served where the name before the colon was allowed); the probes included."""
    for server in (relayed, single):
        for path in ("/models", "/health"):
            status, _, body = exchange(server.url, [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close"])
            assert status == 400, (server.url, path, body)
            assert orjson.loads(body)["error"] == error


def test_an_absolute_form_target_is_judged_by_its_own_name(relayed: ServerProcess, single: ServerProcess) -> None:
    """RFC 9112 section 3.2.2: the target's name stands in for the Host header (before, a foreign name in the target
    was served beside an allowed Host)."""
    for server in (relayed, single):
        port = server.url.rsplit(":", 1)[1]
        foreign = close_head("GET", "http://rebound.example/v2/models/tiny")
        status, _, body = exchange(server.url, foreign)
        assert status == 400, (server.url, body)
        assert orjson.loads(body)["error"] == (
            "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)"
        )
        own = [f"GET http://127.0.0.1:{port}/v2/models/tiny HTTP/1.1", "Host: rebound.example", "Connection: close"]
        status, _, body = exchange(server.url, own)
        assert status == 200, (server.url, body)
        assert orjson.loads(body)["name"] == "tiny"


@pytest.mark.parametrize(
    ("target", "status", "error"),
    [
        # A port the URL parser refuses, and a target without a path, were uvicorn's text/plain "Invalid HTTP request
        # received."; another scheme's foreign name was served.
        ("http://127.0.0.1:99999/v2/models/tiny", 400, "Host: '127.0.0.1:99999' names port 99999, past 65535"),
        ("http://127.0.0.1:99999/health", 400, "Host: '127.0.0.1:99999' names port 99999, past 65535"),
        ("http://rebound.example", 400, "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)"),
        (
            "http://rebound.example?a=1",
            400,
            "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)",
        ),
        (
            "ftp://rebound.example/models",
            400,
            "Host: 'rebound.example' is not a name this server answers to (allowed_hosts)",
        ),
        (
            "http:///v2/models/tiny",
            400,
            "request target: 'http:///v2/models/tiny' names no host (RFC 9110 section 4.2.1)",
        ),
        ("http://127.0.0.1?a=1", 200, None),
    ],
)
def test_an_absolute_form_target_s_name_is_judged_in_json_whatever_the_url_parser_makes_of_it(
    relayed: ServerProcess, single: ServerProcess, target: str, status: int, error: str | None
) -> None:
    """RFC 9112 section 3.2.2 for every absolute-form target, RFC 9110 section 4.2.3 (an empty path is ``/``) and
    4.2.1 (an ``http`` URI names a host)."""
    for server in (relayed, single):
        got, headers, body = exchange(server.url, close_head("GET", target))
        assert got == status, (server.url, target, body)
        if error is not None:
            assert dict(headers)["content-type"] == "application/json"
            assert orjson.loads(body)["error"] == error


def answers(url: str, data: bytes) -> list[tuple[int, bytes]]:
    """Send ``data`` (requests, pipelined) on one connection; each answer's status and body, until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        stream = b""
        while chunk := sock.recv(65536):
            stream += chunk
    found = []
    while stream:
        top, _, rest = stream.partition(b"\r\n\r\n")
        status_line, *lines = top.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (line.partition(":") for line in lines) if k.lower() == "content-length")
        found.append((int(status_line.split()[1]), rest[:length]))
        stream = rest[length:]
    return found


MALFORMED = {
    "method": b"GARBAGE\r\n\r\n",
    "Content-Length and Transfer-Encoding": b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nabc",
    "signed Content-Length": b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: +3\r\n\r\nabc",
    "chunk size": b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_request_is_a_json_400_after_the_answers_to_those_pipelined_before_it(
    relayed: ServerProcess, single: ServerProcess, kind: str
) -> None:
    row = b'{"inputs": [[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]}'
    predict = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n%s" % (len(row), row)
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for server in (relayed, single):
        found = answers(server.url, predict + health + MALFORMED[kind] + health)
        assert [status for status, _ in found] == [200, 200, 400], (server.url, found)
        assert orjson.loads(found[0][1])["outputs"]
        error = orjson.loads(found[2][1])["error"]
        assert error.startswith("request: not valid HTTP/1.1 ("), error
        # Alone on its connection, it is answered at once, in the same words.
        assert answers(server.url, MALFORMED[kind]) == [(400, found[2][1])]


def test_a_websocket_upgrade_is_answered_as_plain_http(relayed: ServerProcess, single: ServerProcess) -> None:
    # No route is a WebSocket. The request went to uvicorn's WebSocket protocol, outside every connection limit, and
    # was left open and unanswered for as long as the client kept it.
    upgrade = (
        b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    for server in (relayed, single):
        assert answers(server.url, upgrade) == [(200, b'{"live":true}')], server.url


ROW = b'{"inputs": [[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]}'
CHUNKED_ROW = b"%x\r\n%s\r\n0\r\n\r\n" % (len(ROW), ROW)


@pytest.mark.parametrize(
    ("head", "body", "status", "error"),
    [
        # The parser ignored the coding and read the body as plain chunks: foo was served, gzip'd JSON a bad-JSON 400.
        (
            b"Transfer-Encoding: gzip, chunked",
            CHUNKED_ROW,
            501,
            "Transfer-Encoding: 'gzip, chunked' is not supported; send the body chunked alone or with a length",
        ),
        # What follows the head was taken as the new protocol's: the body was lost (a 400 "body: empty").
        (
            b"Connection: upgrade\r\nUpgrade: foo\r\nContent-Length: %d" % len(ROW),
            ROW,
            400,
            "Upgrade: a request asking to upgrade cannot carry a body here (the server speaks HTTP/1.1 only); "
            "send it without Connection: upgrade",
        ),
    ],
    ids=["transfer-coding", "upgrade-with-body"],
)
def test_a_body_framed_otherwise_than_it_would_be_read_is_refused(
    relayed: ServerProcess, single: ServerProcess, head: bytes, body: bytes, status: int, error: str
) -> None:
    request = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\n\r\n" + body
    plain = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    for server in (relayed, single):
        [(got, answer)] = answers(server.url, request)
        assert (got, orjson.loads(answer)) == (status, {"error": error}), server.url
        assert answers(server.url, plain + CHUNKED_ROW)[0][0] == 200  # chunked alone is read


def test_a_request_asking_to_upgrade_is_answered_then_its_connection_closed(
    relayed: ServerProcess, single: ServerProcess
) -> None:
    # What follows the head of a request asking to upgrade is taken as the new protocol's and dropped: the request
    # behind it is not answered, so the answer says the connection closes (it stayed open, idle, until the keep-alive
    # timeout, and the client could not tell the request behind it was lost).
    health = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    for server in (relayed, single):
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(health + b"Connection: upgrade\r\nUpgrade: h2c\r\n\r\n" + health + b"\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.count(b"HTTP/1.1 ") == 1, data
        assert b"\r\nconnection: close\r\n" in data.lower(), data
