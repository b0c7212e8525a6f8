"""Live fidelity where the engine process batches behind front-end processes (``--http-workers 2``), as real
processes on 127.0.0.1: the rows both front-ends send are sampled where their batches come back, rerun in fp32 and
shown in ``/models`` and ``/metrics`` (relayed by the front-ends)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import SHIPPED_STORE, start_server
from tests.e2e.test_http_workers import frontends, post_many
from tests.e2e.test_server import samples
from tests.waiting import wait_until

MODEL = "digits_mlp"
pytestmark = pytest.mark.slow


def live(url: str) -> dict[str, object]:
    listed = httpx.get(f"{url}/models").json()
    models = listed["models"] if isinstance(listed, dict) else listed
    found = next(m for m in models if m["name"] == MODEL)["live_fidelity"]
    assert isinstance(found, dict)
    return found


def test_rows_sent_through_front_ends_are_rerun_in_fp32_in_the_engine_process(tmp_path: Path) -> None:
    args = ("--models", MODEL, "--http-workers", "2", "--precision", "bf16", "--live-fidelity-rate", "1")
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", *args)
    try:
        assert len(frontends(server)) == 2
        assert live(server.url)["rows_compared"] == 0
        bodies = [{"model": MODEL, "inputs": [row.tolist()]} for row in samples(20)]
        responses = asyncio.run(post_many(server.url, bodies))
        assert [r.status_code for r in responses] == [200] * 20
        assert {r.json()["precision"] for r in responses} == {"bf16"}
        wait_until(lambda: live(server.url)["rows_compared"] == 20, "the 20 rows rerun in fp32")
        figures = live(server.url)["figures"]
        assert isinstance(figures, dict)
        assert (figures["samples"], figures["source"], figures["precision"]) == (20, "live", "bf16")
        assert isinstance(figures["top1_agreement"], float)  # the class scores output is measured
        assert live(server.url)["shortfall"] is None  # 20 rows: below min_rows (100), so no verdict yet
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'halfserve_live_fidelity_rows_total{{model="{MODEL}"}} 20.0' in metrics
    finally:
        server.stop()
