"""What a request may cost in compute is bounded by default: no more rows than one of the model's batches, and no
compressed body that inflates past a ratio of its own size (tensors of zeros compress a thousandfold)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving
from tests.integration.test_limits import HEADER, INFER, binary_body

RAW = {HEADER: "0", "Content-Type": "application/octet-stream"}


async def test_by_default_a_request_carries_at_most_one_batch_of_rows(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)  # max_batch_size 8, max_queue_rows 4096
    batch = np.zeros((8, 16), np.float32)
    over = np.zeros((9, 16), np.float32)
    async with serving(Settings(store=tmp_path)) as client:
        fits = await client.post(INFER, content=batch.tobytes(), headers=RAW)
        raw = await client.post(INFER, content=over.tobytes(), headers=RAW)
        content, headers = binary_body(over)
        v2 = await client.post(INFER, content=content, headers=headers)
        predict = await client.post("/predict", json={"inputs": over.tolist()})
    assert fits.status_code == 200, fits.text
    for r in (raw, v2, predict):
        assert r.status_code == 413, r.text
        assert "9 rows exceed the limit of 8 per request (the model's max_batch_size; max_request_rows)" in r.text
    # The setting raises it, up to the model's queue.
    async with serving(Settings(store=tmp_path, max_request_rows=10_000)) as client:
        assert (await client.post(INFER, content=over.tobytes(), headers=RAW)).status_code == 200
        many = np.zeros((5000, 16), np.float32)
        queue = await client.post(INFER, content=many.tobytes(), headers=RAW)
    assert queue.status_code == 413
    assert queue.json()["error"].endswith("(the model's max_queue_rows)")


async def test_a_body_inflating_past_the_ratio_is_refused_as_it_inflates(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    zeros = gzip.compress(bytes(16 * 2**20), compresslevel=9)  # 16 MiB of zeros in about 16 KB
    assert len(zeros) < 32 * 2**10
    rows = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    fine = gzip.compress(rows.tobytes())  # random floats barely compress
    gz = {**RAW, "Content-Encoding": "gzip"}
    async with serving(Settings(store=tmp_path)) as client:
        bomb = await client.post(INFER, content=zeros, headers=gz)
        served = await client.post(INFER, content=fine, headers=gz)
    assert bomb.status_code == 413
    limit = max(2**20, 100 * len(zeros))  # the first MiB is free
    assert bomb.json()["error"] == (
        f"body: decompresses to more than {limit} bytes (max_compression_ratio: 100 times its {len(zeros)} "
        "compressed bytes)"
    )
    assert served.status_code == 200, served.text
    # A higher ratio lets the same body inflate whole (and be refused for what it holds instead).
    async with serving(Settings(store=tmp_path, max_compression_ratio=2000)) as client:
        whole = await client.post(INFER, content=zeros, headers=gz)
    assert whole.status_code == 413
    assert "rows exceed" in whole.json()["error"]
