"""The backplane's Unix socket (``--http-workers``) admits only this run's front-ends, and a connection that says
nothing holds up no one: over a real two-front-end server, talking to its socket as another local process would."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest

from halfserve.ipc.frames import FrameReader
from halfserve.multiproc.client import SLOT_BYTES, SLOTS
from halfserve.multiproc.engine_side import HELLO_TIMEOUT_S
from tests.conftest import ServerProcess, StartServer
from tests.e2e.test_http_workers import frontends

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(
    server_factory: StartServer, served_tiny_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> ServerProcess:
    temp = tmp_path_factory.mktemp("backplane-tmp")
    return server_factory(served_tiny_store, "--http-workers", "2", env={"TMPDIR": str(temp)})


def backplane_socket(server: ServerProcess) -> str:
    env = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    temp = next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"TMPDIR="))
    [path] = Path(temp).glob("halfserve-*/backplane.sock")
    return str(path)


@contextmanager
def attached(server: ServerProcess) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HELLO_TIMEOUT_S + 10)
    sock.connect(backplane_socket(server))
    try:
        yield sock
    finally:
        sock.close()


def hello(sock: socket.socket, body: dict[str, object] | bytes) -> None:
    """A hello as a front-end sends it: a JSON object and a memfd big enough for the slots it names."""
    fd = os.memfd_create("not-a-front-end")
    try:
        os.ftruncate(fd, SLOTS * SLOT_BYTES)
        socket.send_fds(sock, [body if isinstance(body, bytes) else orjson.dumps(body)], [fd])
    finally:
        os.close(fd)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def wait_ready(server: ServerProcess, within: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within:
        try:
            if httpx.get(f"{server.url}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready within {within} s")


@pytest.mark.parametrize(
    "body",
    [
        {"index": 7, "pid": 1, "slots": SLOTS, "slot_bytes": SLOT_BYTES},
        {"index": 7, "pid": 1, "secret": "0" * 64, "slots": SLOTS, "slot_bytes": SLOT_BYTES},
        {"index": 7, "pid": 1, "secret": 12, "slots": SLOTS, "slot_bytes": SLOT_BYTES},
        b"not json",
        b"[]",
    ],
    ids=["no-secret", "wrong-secret", "secret-not-a-string", "not-json", "not-an-object"],
)
def test_a_hello_without_the_runs_secret_is_dropped_unanswered(server: ServerProcess, body: object) -> None:
    with attached(server) as sock:
        hello(sock, body)  # type: ignore[arg-type]
        answered = read_all(sock)  # a front-end's connection is sent the model table at once
    assert answered == b"", FrameReader().feed(answered)
    wait_ready(server, within=5)


def connected(server: ServerProcess, pid: int) -> bool:
    return f"(pid {pid}) connected" in server.log.read_text(errors="replace")


def test_a_silent_connection_holds_up_no_front_ends_reconnect(server: ServerProcess) -> None:
    wait_ready(server, within=30)
    with attached(server) as silent:
        start = time.monotonic()
        victim, other = frontends(server)
        os.kill(victim, signal.SIGKILL)
        # The replacement's hello is taken while the silent connection is still open and waiting.
        deadline = start + 60
        while not any(connected(server, p) for p in frontends(server) if p not in (victim, other)):
            assert time.monotonic() < deadline, "the replacement front-end never connected"
            time.sleep(0.1)
        wait_ready(server, within=10)
        assert silent.recv(1) == b""  # dropped at the hello timeout
        assert time.monotonic() - start < HELLO_TIMEOUT_S + 5
