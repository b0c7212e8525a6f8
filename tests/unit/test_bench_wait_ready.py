"""The benchmarks' one wait for a server to get ready (benchmarks/common.py ``wait_ready``), against real processes:
it returns once the URL answers 200, and fails naming why when the process exits first or the URL never answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import wait_ready
from tests.conftest import free_port


def test_it_returns_once_the_url_answers_200(tmp_path: Path) -> None:
    (tmp_path / "ready").write_text("yes")  # http.server answers GET /ready with this file
    port = free_port()
    cmd = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(tmp_path), str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_ready(f"http://127.0.0.1:{port}/ready", proc, 60, interval=0.05) >= 0
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_exits_first_fails_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        cmd = [sys.executable, "-c", "import sys; print('no weights here'); sys.exit(3)"]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(RuntimeError, match=r"exited with 3 (.|\n)*no weights here"):
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", proc, 60, interval=0.05, log=log)


def test_a_url_that_never_answers_fails_after_the_timeout() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="did not answer 200 within 0.3 s"):
            wait_ready(f"http://127.0.0.1:{free_port()}/ready", proc, 0.3, interval=0.05)
        assert proc.poll() is None  # the caller stops it
    finally:
        proc.kill()
        proc.wait()
