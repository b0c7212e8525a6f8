"""Child processes of a load test: the ``halfserve serve`` it starts in self-contained mode, and CPU accounting."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

import halfserve
from halfserve.loadtest import LoadtestError

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0


def child_env() -> dict[str, str]:
    """The environment for a child Python process, importing the same ``halfserve`` package as this one."""
    root = str(Path(halfserve.__file__).resolve().parent.parent)  # the source root, server/
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of process ``pid`` (all its threads), from ``/proc``; ``None`` where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3, utime and stime are fields 14 and 15 (man 5 proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ManagedServer:
    """``halfserve serve`` on 127.0.0.1 and a free port, serving one model, started and stopped by the load test.

    It runs in a session of its own (so Ctrl-C in the terminal reaches the load test, which stops it in order) and
    logs to ``log``.
    """

    def __init__(
        self,
        store: Path,
        model: str,
        precision: str,
        log: Path,
        *,
        device: str | None = None,
        extra_args: tuple[str, ...] = (),
        grpc: bool = False,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(store), "--models", model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--precision", precision]
        self.grpc_target: str | None = None
        if grpc:
            grpc_port = free_port()
            self.grpc_target = f"127.0.0.1:{grpc_port}"
            cmd += ["--grpc", "--grpc-port", str(grpc_port)]
        else:
            cmd += ["--no-grpc"]
        if device is not None:
            cmd += ["--device", device]
        self.command = [*cmd, *extra_args]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Poll ``GET /ready`` until it answers 200; returns the seconds it took. Fails if the server exits."""
        start = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() - start < timeout:
                if self.proc.poll() is not None:
                    raise LoadtestError(
                        f"halfserve serve exited with code {self.proc.returncode} before it was ready:\n{self.tail()}"
                    )
                try:
                    if client.get(f"{self.url}/ready").status_code == 200:
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise LoadtestError(f"halfserve serve was not ready within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (the server drains what is queued), then wait; SIGKILL only if it does not exit in time."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ManagedServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
