"""A registered region is its owner's memory: without the admin token a client can neither read it through the
model (as an input), overwrite it (as an output), nor list the regions and their keys."""

from __future__ import annotations

from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from halfserve.settings import Settings
from tests.conftest import shm_key
from tests.integration.conftest import serving

TOKEN = "shm-access-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_regions_are_used_and_listed_only_with_the_admin_token(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    secret = np.arange(16, dtype=np.float32)
    np.ndarray((16,), np.float32, segment.buf)[:] = secret
    key = shm_key(segment)
    ins = {"shared_memory_region": "owner", "shared_memory_byte_size": 64}
    outs = {"shared_memory_region": "owner", "shared_memory_byte_size": 16, "shared_memory_offset": 0}
    read = {"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "parameters": ins}]}
    overwrite = {
        "inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}],
        "outputs": [{"name": "logits", "parameters": outs}],
    }
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        reg = await client.post(
            "/v2/systemsharedmemory/region/owner/register", json={"key": key, "byte_size": 4096}, headers=AUTH
        )
        assert reg.status_code == 200
        wrong = {"Authorization": "Bearer not-the-token"}
        refused = {
            "read, no token": await client.post("/v2/models/tiny/infer", json=read),
            "read, wrong token": await client.post("/v2/models/tiny/infer", json=read, headers=wrong),
            "overwrite, no token": await client.post("/v2/models/tiny/infer", json=overwrite),
            "list": await client.get("/v2/systemsharedmemory/status"),
            "list one": await client.get("/v2/systemsharedmemory/region/owner/status"),
        }
        allowed = await client.post("/v2/models/tiny/infer", json=read, headers=AUTH)
        listed = await client.get("/v2/systemsharedmemory/status", headers=AUTH)
    for what, r in refused.items():
        assert r.status_code == 401, (what, r.text)
        assert key not in r.text, what
    assert (
        refused["read, no token"]
        .json()["error"]
        .startswith("shared_memory_region: using a shared memory region needs the admin token")
    )
    np.testing.assert_array_equal(np.ndarray((16,), np.float32, segment.buf), secret)  # not overwritten
    assert allowed.status_code == 200, allowed.text
    assert listed.json() == [{"name": "owner", "key": key, "offset": 0, "byte_size": 4096}]
