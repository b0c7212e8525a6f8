"""``--placement instance_processes`` behind ``--http-workers 2``, as real processes on 127.0.0.1: the instance
processes read the rows in the front-ends' shared memory where they lie (no copy), answer as the fp32 model does, and
exit with the server on SIGTERM after every accepted request is answered."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import SHIPPED_STORE, start_server
from tests.e2e.test_server import fp32_reference, samples

MODEL = "digits_mlp"
pytestmark = pytest.mark.slow


async def post_all(url: str, x: np.ndarray) -> list[httpx.Response]:
    """Each row in its own request on its own connection, all at once (spread over the front-ends)."""
    limits = httpx.Limits(max_connections=len(x), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        return await asyncio.gather(
            *(client.post("/predict", json={"model": MODEL, "inputs": [row.tolist()]}) for row in x)
        )


def test_instance_processes_read_front_end_slots_in_place_and_exit_with_the_server(tmp_path: Path) -> None:
    flags = ("--models", MODEL, "--http-workers", "2", "--placement", "instance_processes", "--precision", "fp32")
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", *flags)
    try:
        x = samples(24, seed=3)
        responses = asyncio.run(post_all(server.url, x))
        assert [r.status_code for r in responses] == [200] * len(x)
        got = np.array([r.json()["outputs"][0] for r in responses], dtype=np.float32)
        np.testing.assert_allclose(got, fp32_reference(x), rtol=1e-4, atol=1e-4)
        stats = httpx.get(f"{server.url}/models/{MODEL}/stats").json()
        assert stats["input_bytes_in_place"] == x.nbytes  # every row read in the front-ends' slots
        assert stats["input_bytes_copied"] == 0
        pids = stats["instance_pids"]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_without_front_ends_each_row_is_copied_once_into_the_instance_process(tmp_path: Path) -> None:
    flags = ("--models", MODEL, "--placement", "instance_processes", "--precision", "fp32")
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", *flags)
    try:
        x = samples(8, seed=4)
        responses = asyncio.run(post_all(server.url, x))
        assert [r.status_code for r in responses] == [200] * len(x)
        stats = httpx.get(f"{server.url}/models/{MODEL}/stats").json()
        assert (stats["input_bytes_copied"], stats["input_bytes_in_place"]) == (x.nbytes, 0)
    finally:
        server.stop()
