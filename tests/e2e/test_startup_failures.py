"""A server that cannot start exits, non-zero, with its last line naming the cause: real ``halfserve serve``
processes on 127.0.0.1 whose port is taken or whose front-end fails at start, with and without ``--http-workers``.

A supervisor (Kubernetes, compose, systemd) restarts or reports a server that exits; one that hangs after a failed
start (its engine process waiting on front-ends that wait for a backplane that is gone) is neither. The deadline
below bounds a hang; the exit itself takes seconds.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SHIPPED_STORE, free_port
from tests.waiting import DEADLINE_S, wait_until

pytestmark = pytest.mark.slow

FAILING_FRONTEND = """\
import sys

from halfserve.multiproc import frontend


async def refuse(self: frontend.FrontendApp) -> None:
    raise RuntimeError("this front-end cannot start")


# At module level: a spawned front-end imports this script again (as __mp_main__) before it runs.
frontend.FrontendApp._start = refuse  # type: ignore[method-assign]

if __name__ == "__main__":
    from halfserve.cli import main

    sys.exit(main())
"""


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def serve(log: Path, *args: str, script: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``halfserve serve`` on the shipped store until it exits (failing the test past the deadline)."""
    entry = [str(script)] if script is not None else ["-m", "halfserve"]
    cmd = [sys.executable, *entry, "serve", "--store", str(SHIPPED_STORE), "--models", "digits_mlp", "--host"]
    cmd += ["127.0.0.1", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S, env=os.environ.copy())
    except subprocess.TimeoutExpired as e:
        log.write_text(f"{e.stdout!r}\n{e.stderr!r}")
        pytest.fail(f"the server did not exit within {DEADLINE_S:g} s of a failed start: {' '.join(cmd)}")


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_no_process_left(result: subprocess.CompletedProcess[str]) -> None:
    """Every process the server started (each logs ``Started server process [pid]``) has exited too."""
    pids = [int(p) for p in re.findall(r"Started server process \[(\d+)\]", result.stderr)]
    assert pids, result.stderr
    wait_until(lambda: not any(running(p) for p in pids), f"processes {pids} to exit with the server")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_grpc_port_taken_exits_non_zero_naming_the_port(taken_port: int, workers: str, tmp_path: Path) -> None:
    args = ["--port", str(free_port()), "--grpc", "--grpc-port", str(taken_port), "--http-workers", workers]
    result = serve(tmp_path / "log", *args)
    assert result.returncode != 0, result.stderr
    # the operating system's reason, not grpcio's "Failed to bind ... set GRPC_VERBOSITY=debug"
    assert f"cannot listen on 127.0.0.1:{taken_port} (--grpc-port): Address already in use" in last_line(result)
    assert_no_process_left(result)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_torchserve_management_port_taken_exits_non_zero_naming_the_port(
    taken_port: int, workers: str, tmp_path: Path
) -> None:
    args = ["--port", str(free_port()), "--torchserve-management-port", str(taken_port), "--http-workers", workers]
    result = serve(tmp_path / "log", *args)
    assert result.returncode != 0, result.stderr
    expected = f"cannot listen on 127.0.0.1:{taken_port} (--torchserve-management-port): Address already in use"
    assert expected in last_line(result), result.stderr
    assert_no_process_left(result)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_http_port_taken_exits_non_zero_naming_the_port(taken_port: int, workers: str, tmp_path: Path) -> None:
    result = serve(tmp_path / "log", "--port", str(taken_port), "--http-workers", workers)
    assert result.returncode != 0, result.stderr
    assert str(taken_port) in last_line(result), result.stderr


def test_a_front_end_that_fails_at_start_stops_the_server(tmp_path: Path) -> None:
    """Not restarted over and over: it would fail the same way, and the server would never serve."""
    script = tmp_path / "failing_frontend.py"
    script.write_text(FAILING_FRONTEND)
    result = serve(tmp_path / "log", "--port", str(free_port()), "--http-workers", "2", script=script)
    assert result.returncode != 0, result.stderr
    assert re.search(r"front-end \d \(pid \d+\) exited with \d+ before it started", last_line(result)), result.stderr
    assert "restarting it" not in result.stderr
    assert_no_process_left(result)
