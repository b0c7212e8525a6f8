"""A real server with text logs and ``--access-log``: a request's path cannot write a line of its own into the log."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.conftest import ServerProcess, save_tiny_mlp

pytestmark = pytest.mark.slow

FORGED = "2026-11-29 10:00:00,000 CRITICAL halfserve.app: FORGED LINE"


def test_line_breaks_in_a_path_are_escaped_in_the_text_access_log(
    server_factory: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    save_tiny_mlp(tmp_path)
    server = server_factory(tmp_path, "--access-log")
    r = httpx.post(f"{server.url}/predictions/x%0d%0a{quote(FORGED)}%0d%0a%1b[31m", content=b"x", timeout=30)
    assert r.status_code == 404, r.text
    deadline = time.monotonic() + 30
    while "/predictions/x" not in server.log.read_text():
        assert time.monotonic() < deadline, "no access line for the request"
        time.sleep(0.05)
    lines = server.log.read_text().splitlines()
    assert not [line for line in lines if line.startswith(FORGED)]  # had been a line of its own
    # uvicorn's line, and the server's own (halfserve.access): an escape (ESC, %1b) had reached the latter raw
    (uvicorn,) = [line for line in lines if '"POST /predictions/x' in line]
    assert f"/predictions/x\\x0d\\x0a{FORGED}\\x0d\\x0a\\x1b[31m HTTP/1.1" in uvicorn
    (own,) = [line for line in lines if "halfserve.access: POST /predictions/x" in line]
    assert f"POST /predictions/x{FORGED}\\x1b[31m 404" in own  # its line breaks dropped, as before
