"""Closing a model's instance processes (unload, reload), as real ``halfserve serve`` processes on 127.0.0.1 with
``--placement instance_processes``: the wait for the processes to exit is off the event loop, so the server answers
meanwhile, and each closed process's pipes are released at once, not at some later garbage collection."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import SHIPPED_STORE, ServerProcess, start_server

MODEL = "digits_mlp"
TOKEN = "instance-close-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLAGS = ("--models", MODEL, "--placement", "instance_processes", "--precision", "fp32", "--admin-token", TOKEN)
RELOADS = 4
pytestmark = pytest.mark.slow

WITHOUT_GC = """\
import gc
import sys

from halfserve.cli import main

if __name__ == "__main__":  # not again in the processes it spawns, which import this script as __mp_main__
    # No collection ever runs: whatever a closed process leaves open stays open, as between two collections.
    gc.disable()
    sys.exit(main(sys.argv[sys.argv.index("halfserve") + 1 :]))  # after: python -m halfserve
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    script = tmp_path / "without_gc.py"
    script.write_text(WITHOUT_GC)
    started = start_server(SHIPPED_STORE, tmp_path / "server.log", *FLAGS, wrapper=[sys.executable, str(script)])
    try:
        yield started
    finally:
        started.stop()


def instance_pids(server: ServerProcess) -> list[int]:
    pids: list[int] = httpx.get(f"{server.url}/models/{MODEL}/stats", timeout=30).json()["instance_pids"]
    return pids


async def unload_while_polling_health(url: str) -> tuple[list[float], float, float]:
    """Unload the model and poll ``/health`` one request after another until the unload is answered; returns when
    each health answer arrived, and when the unload was sent and answered (monotonic seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        sent = time.monotonic()
        unload = asyncio.create_task(client.post(f"/models/{MODEL}/unload", headers=AUTH))
        answers: list[float] = []
        while not unload.done():
            response = await client.get("/health")
            assert response.status_code == 200
            answers.append(time.monotonic())
        assert (await unload).status_code == 200, (await unload).text
        return answers, sent, time.monotonic()


def test_health_answers_while_a_hung_instance_process_is_stopped(server: ServerProcess) -> None:
    """The instance process is stopped (SIGSTOP): it cannot exit when told, so the unload waits the exit timeout and
    then kills it. /health is answered all along: no gap between answers nears the unload's own time (about
    ``EXIT_TIMEOUT_S``), as it did when the wait ran on the event loop and stalled every request."""
    (pid,) = instance_pids(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        answers, sent, done = asyncio.run(unload_while_polling_health(server.url))
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
    took = done - sent
    gaps = [b - a for a, b in zip([sent, *answers], [*answers, done], strict=True)]
    assert len(answers) >= 2, f"/health answered {len(answers)} times during an unload of {took:.1f} s"
    assert max(gaps) < took / 2, f"/health stalled {max(gaps):.1f} s of the unload's {took:.1f} s"
    log = server.log.read_text()
    assert "did not exit; terminating it" in log
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_reloads_leave_no_descriptors_behind(server: ServerProcess) -> None:
    """With garbage collection off in the server, descriptors stay flat over reloads (each old instance process's
    pipe and sentinel used to stay open until a collection: about two per reload)."""

    def reload() -> None:
        response = httpx.post(f"{server.url}/models/{MODEL}/reload", headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text

    reload()  # whatever a first reload opens for good (threads, pools) is open before counting
    before = open_fds(server.proc.pid)
    for _ in range(RELOADS):
        reload()
    after = open_fds(server.proc.pid)
    assert after - before < RELOADS, f"{after - before} descriptors more after {RELOADS} reloads"
