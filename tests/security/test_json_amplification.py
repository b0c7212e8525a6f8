"""A small body must not buy a large amount of work: a gzip body that inflates to tens of megabytes of ``[],[],...``
or of zeros is refused (413, max_json_values) after a count, not parsed into millions of Python objects on the event
loop, and the server answers ``/health`` throughout."""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, StartServer

pytestmark = pytest.mark.slow

STALL_S = 3.0
"""A liveness bound, not a speed claim: before the count, one such body held the event loop for 13-16 s. A loaded host
stretches the probes towards a second by its scheduling alone (each waits for the server's loop, and its own thread, to
be run), so the bound leaves room for that."""


@pytest.fixture(scope="module")
def server(server_factory: StartServer, served_tiny_store: Path) -> ServerProcess:
    # Room for the within-budget request's rows; a compression ratio that lets every body here inflate whole, so that
    # the count, not the ratio (tests/security/test_cost_amplification.py), is what refuses them.
    rows = ["--max-queue-rows", "32768", "--max-request-rows", "32768"]
    return server_factory(served_tiny_store, *rows, "--max-compression-ratio", "100000")


def bomb(prefix: bytes, item: bytes, suffix: bytes, size: int) -> bytes:
    """gzip of ``prefix`` + ``item`` repeated to about ``size`` bytes + ``suffix``: valid JSON of a few tens of KB."""
    return gzip.compress(prefix + item * (size // len(item)) + item.rstrip(b",") + suffix, compresslevel=9)


def peak_rss_mb(server: ServerProcess) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def send_while_probing(server: ServerProcess, path: str, body: bytes) -> tuple[httpx.Response, float]:
    """POST ``body`` while another thread times ``GET /health`` every 20 ms; the answer and the slowest probe."""
    slowest = 0.0
    done = threading.Event()

    def probe() -> None:
        nonlocal slowest
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post(path, content=body, headers=headers)
        time.sleep(0.1)  # a stall that outlasts the answer still shows in the probe
    finally:
        done.set()
        prober.join()
    return r, slowest


LISTS = 60 * 2**20  # bytes of [],[],... : about 21 million empty lists, inside the default 64 MiB body limit
CASES = {
    "predict-lists": ("/predict", bomb(b'{"inputs": [', b"[],", b"]}", LISTS)),
    "v2-lists": (
        "/v2/models/tiny/infer",
        bomb(
            b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 16], "data": [', b"[],", b"]}]}", LISTS
        ),
    ),
    "predict-zeros": ("/predict", bomb(b'{"inputs": [[', b"0,", b"]]}", 66_000_000)),  # one sample of 33 M zeros
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_amplifying_json_body_is_a_quick_413_and_the_server_keeps_answering(
    server: ServerProcess, case: str
) -> None:
    path, body = CASES[case]
    assert len(body) < 200_000
    r, slowest = send_while_probing(server, path, body)
    assert r.status_code == 413, r.text[:500]
    assert r.json()["error"].startswith("body: JSON with more than 524288 values and containers (max_json_values)")
    assert slowest < STALL_S, f"/health took {slowest:.2f} s while the body was handled"
    assert server.proc.poll() is None
    assert peak_rss_mb(server) < 1500, "parsing would have built gigabytes of lists"
    ok = httpx.post(f"{server.url}/predict", json={"inputs": [[0.0] * 16]}, timeout=10)
    assert ok.status_code == 200


def test_a_json_body_within_the_value_budget_is_served(server: ServerProcess) -> None:
    rows = 2**19 // 17 - 1  # 16 values and one list per row, under the budget with the envelope
    body = gzip.compress(b'{"inputs": [' + b",".join([b"[" + b",".join([b"0.5"] * 16) + b"]"] * rows) + b"]}")
    r = httpx.post(
        f"{server.url}/predict",
        content=body,
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["outputs"]) == rows
