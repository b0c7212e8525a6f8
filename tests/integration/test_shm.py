"""The system shared memory extension in-process: regions registered, read as inputs, written as outputs, refused."""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from halfserve.settings import Settings
from tests.conftest import shm_key
from tests.integration.conftest import serving

TOKEN = "shm-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
INFER = "/v2/models/tiny/infer"


def request(rows: int, inputs: dict[str, Any], outputs: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "features", "shape": [rows, 16], "datatype": "FP32", "parameters": inputs}]
    }
    if outputs is not None:
        body["outputs"] = [{"name": "logits", "parameters": outputs}]
    return body


async def register(client: httpx.AsyncClient, name: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(f"/v2/systemsharedmemory/region/{name}/register", json=body, headers=AUTH)


async def test_inputs_read_from_and_outputs_written_into_shared_memory(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    np.ndarray(x.shape, np.float32, segment.buf, offset=256)[:] = x
    async with serving(Settings(store=tiny_store, precision="fp32", admin_token=TOKEN)) as client:
        client.headers.update(AUTH)  # naming a region, and listing them, need the token
        want = np.asarray((await client.post("/predict", json={"inputs": x.tolist()})).json()["outputs"])
        # Two regions in one object: inputs from byte 0 of the first, outputs into the second.
        r = await register(client, "in", {"key": shm_key(segment), "offset": 0, "byte_size": 2048})
        assert r.status_code == 200, r.text
        r = await register(client, "out", {"key": shm_key(segment), "offset": 2048, "byte_size": 2048})
        assert r.status_code == 200, r.text
        status = (await client.get("/v2/systemsharedmemory/status")).json()
        one = (await client.get("/v2/systemsharedmemory/region/out/status")).json()
        ins = {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes, "shared_memory_offset": 256}
        outs = {"shared_memory_region": "out", "shared_memory_byte_size": 1024, "shared_memory_offset": 64}
        both = await client.post(INFER, json=request(3, ins, outs))
        body_out = await client.post(INFER, json=request(3, ins))
        meta = (await client.get("/v2")).json()
    assert "system_shared_memory" in meta["extensions"]
    assert status == [
        {"name": "in", "key": shm_key(segment), "offset": 0, "byte_size": 2048},
        {"name": "out", "key": shm_key(segment), "offset": 2048, "byte_size": 2048},
    ]
    assert one == [status[1]]
    assert both.status_code == 200, both.text
    out = both.json()["outputs"][0]
    assert "data" not in out
    assert out["shape"] == [3, 4]
    assert out["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": 3 * 4 * 4}
    got = np.ndarray((3, 4), np.float32, segment.buf, offset=2048 + 64).copy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(body_out.json()["outputs"][0]["data"], want.ravel(), rtol=1e-6, atol=1e-6)


async def test_registration_needs_the_admin_token_and_a_real_object(
    tiny_store: Path, segment: shared_memory.SharedMemory, tmp_path: Path
) -> None:
    body = {"key": shm_key(segment), "byte_size": 1024}
    link = Path("/dev/shm") / f"halfserve-link-{secrets.token_hex(4)}"
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    os.symlink(secret, link)
    try:
        async with serving(Settings(store=tiny_store)) as client:
            off = await client.post("/v2/systemsharedmemory/region/r/register", json=body)
        async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
            anonymous = await client.post("/v2/systemsharedmemory/region/r/register", json=body)
            refused = {
                what: await register(client, "r", {**body, **change})
                for what, change in {
                    "not a name": {"key": "/dev/shm/x"},
                    "relative": {"key": "x"},
                    "missing": {"key": "/halfserve-no-such-object"},
                    "a link out of /dev/shm": {"key": "/" + link.name},
                    "too big": {"byte_size": 4097},
                    "past the end": {"offset": 4000, "byte_size": 100},
                    "empty": {"byte_size": 0},
                    "negative": {"offset": -1},
                }.items()
            }
            status = (await client.get("/v2/systemsharedmemory/status", headers=AUTH)).json()
            first = await register(client, "r", body)
            again = await register(client, "r", body)
            cuda = await client.post("/v2/cudasharedmemory/region/g/register", json={}, headers=AUTH)
            unknown_status = await client.get("/v2/systemsharedmemory/region/nope/status", headers=AUTH)
    finally:
        link.unlink()
    assert off.status_code == 403
    assert anonymous.status_code == 401
    messages = {what: (r.status_code, r.json()["error"]) for what, r in refused.items()}
    assert all(code == 400 for code, _ in messages.values()), messages
    assert "POSIX shared memory name" in messages["not a name"][1]
    assert "POSIX shared memory name" in messages["relative"][1]
    assert "cannot open shared memory" in messages["missing"][1]
    assert "cannot open shared memory" in messages["a link out of /dev/shm"][1]
    assert "do not fit" in messages["too big"][1]
    assert "do not fit" in messages["past the end"][1]
    assert "do not fit" in messages["empty"][1]
    assert "offset: expected a non-negative integer" in messages["negative"][1]
    assert status == []
    assert first.status_code == 200
    assert again.status_code == 400
    assert "already registered" in again.json()["error"]
    assert cuda.status_code == 400
    assert "CUDA shared memory is not supported" in cuda.json()["error"]
    assert unknown_status.status_code == 404


async def test_an_object_shrunk_after_registration_fails_its_requests_not_the_server(tiny_store: Path) -> None:
    """A shrunk object is a short read and a refused write for the requests that name it; the server goes on.
    (tests/security/test_shm_faults.py shrinks it during requests.)"""
    name = f"halfserve-shrink-{secrets.token_hex(4)}"
    path = Path("/dev/shm") / name
    path.write_bytes(bytes(8192))
    ins = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 4096}
    outs = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "shared_memory_offset": 4096 + 64}
    try:
        async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
            client.headers.update(AUTH)
            await register(client, "r", {"key": "/" + name, "byte_size": 8192})
            before = await client.post(INFER, json=request(1, ins, outs))
            os.truncate(path, 1024)
            after_in = await client.post(INFER, json=request(1, ins))
            after_out = await client.post(
                INFER,
                json={
                    **request(1, {"shared_memory_region": "r", "shared_memory_byte_size": 64}),
                    "outputs": [{"name": "logits", "parameters": outs}],
                },
            )
            still = await client.post("/predict", json={"inputs": [[0.0] * 16]})
    finally:
        path.unlink()
    assert before.status_code == 200, before.text
    for r in (after_in, after_out):
        assert r.status_code == 400, r.text
        assert "the shared memory object of region 'r' shrank below it" in r.json()["error"]
    assert still.status_code == 200


async def test_bad_shared_memory_requests_are_400s_and_unregistered_regions_are_gone(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    x = np.zeros((2, 16), np.float32)
    ins = {"shared_memory_region": "r", "shared_memory_byte_size": x.nbytes}
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        client.headers.update(AUTH)
        await register(client, "r", {"key": shm_key(segment), "byte_size": 1024})
        cases = {
            "unknown region": (request(2, {**ins, "shared_memory_region": "nope"}), "no shared memory region 'nope'"),
            "no byte size": (request(2, {"shared_memory_region": "r"}), "needs shared_memory_byte_size"),
            "size unlike shape": (
                request(2, {**ins, "shared_memory_byte_size": 64}),
                "64 bytes of binary data, but shape [2, 16] of FP32 takes 128 bytes",
            ),
            "overrun": (request(2, {**ins, "shared_memory_offset": 1000}), "overrun shared memory region 'r'"),
            "data too": (
                {
                    "inputs": [
                        {"name": "features", "shape": [2, 16], "datatype": "FP32", "data": [0] * 32, "parameters": ins}
                    ]
                },
                "give one of data, binary_data_size or shared_memory_region",
            ),
            "output too small": (
                request(2, ins, {"shared_memory_region": "r", "shared_memory_byte_size": 16}),
                "16 bytes cannot hold the output 'logits' (32 bytes for 2 rows)",
            ),
            "classes into memory": (
                request(2, ins, {"shared_memory_region": "r", "shared_memory_byte_size": 64, "classification": 2}),
                "classification answers in the body",
            ),
        }
        answers = {what: await client.post(INFER, json=body) for what, (body, _) in cases.items()}
        ok = await client.post(INFER, json=request(2, ins))
        gone = await client.post("/v2/systemsharedmemory/region/r/unregister", headers=AUTH)
        after = await client.post(INFER, json=request(2, ins))
        await register(client, "a", {"key": shm_key(segment), "byte_size": 8})
        await register(client, "b", {"key": shm_key(segment), "byte_size": 8})
        everything = await client.post("/v2/systemsharedmemory/unregister", headers=AUTH)
        left = (await client.get("/v2/systemsharedmemory/status")).json()
    for what, (_, message) in cases.items():
        assert answers[what].status_code == 400, (what, answers[what].text)
        assert message in answers[what].json()["error"], (what, answers[what].text)
    assert ok.status_code == 200, ok.text
    assert gone.status_code == everything.status_code == 200
    assert after.status_code == 400
    assert "no shared memory region 'r' is registered" in after.json()["error"]
    assert left == []
