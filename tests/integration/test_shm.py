"""The system shared memory extension in-process: regions registered, read as inputs, written as outputs, refused."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from halfserve.settings import Settings
from tests.conftest import free_port, shm_key
from tests.integration.conftest import serving

TOKEN = "shm-admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = (("authorization", f"Bearer {TOKEN}"),)
GRPC_REGISTER = "/inference.GRPCInferenceService/SystemSharedMemoryRegister"
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


async def test_regions_are_capped_by_max_shm_regions_over_http_and_grpc(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    """Each region keeps a descriptor open in the server: past the cap, one more is refused by its setting on either
    transport (the server had registered 19,956 and then dropped every new connection), and unregistering frees a
    place."""
    body = {"key": shm_key(segment), "byte_size": 1024}
    port = free_port()
    settings = Settings(
        store=tiny_store, admin_token=TOKEN, max_shm_regions=2, grpc=True, grpc_port=port, host="127.0.0.1"
    )
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc_register = channel.unary_unary(
            GRPC_REGISTER, request_serializer=service_pb2.SystemSharedMemoryRegisterRequest.SerializeToString
        )
        registered = [(await register(client, name, body)).status_code for name in ("a", "b")]
        over_http = await register(client, "c", body)
        with pytest.raises(grpc.aio.AioRpcError) as over_grpc:
            await grpc_register(
                service_pb2.SystemSharedMemoryRegisterRequest(name="c", key=body["key"], byte_size=1024),
                metadata=GRPC_AUTH,
                timeout=20,
            )
        await client.post("/v2/systemsharedmemory/region/a/unregister", headers=AUTH)
        again = await register(client, "c", body)
        listed = [r["name"] for r in (await client.get("/v2/systemsharedmemory/status", headers=AUTH)).json()]
    full = "cannot register shared memory region 'c': 2 regions are registered, the limit (max_shm_regions)"
    assert registered == [200, 200]
    assert over_http.status_code == 413, over_http.text
    assert over_http.json()["error"] == f"{full}; unregister one first"
    assert over_grpc.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert over_grpc.value.details() == f"{full}; unregister one first"
    assert again.status_code == 200, again.text
    assert listed == ["b", "c"]


NAMED = (
    "shared memory region name: expected printable ASCII characters without spaces or '/', other than '.' and '..' "
    "(one segment of a URL path), got "
)


async def test_a_region_name_is_short_printable_ascii_over_http_and_grpc(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    body = {"key": shm_key(segment), "byte_size": 1024}
    port = free_port()
    settings = Settings(store=tiny_store, admin_token=TOKEN, grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc_register = channel.unary_unary(
            GRPC_REGISTER, request_serializer=service_pb2.SystemSharedMemoryRegisterRequest.SerializeToString
        )
        refused = {
            "3,000 characters": await register(client, "x" * 3000, body),
            "a newline": await register(client, "a%0Ab", body),
            "a space": await register(client, "a%20b", body),
        }
        longest = await register(client, "x" * 128, body)
        refused_grpc = {}
        # A region ".." was unregistered by .../region/../unregister, which clients resolve to unregister every
        # region; a "/" cannot be one segment of the routes' paths.
        for what, name in {"empty": "", "129 characters": "y" * 129, "dot-dot": "..", "a slash": "a/b"}.items():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await grpc_register(
                    service_pb2.SystemSharedMemoryRegisterRequest(name=name, key=body["key"], byte_size=1024),
                    metadata=GRPC_AUTH,
                    timeout=20,
                )
            refused_grpc[what] = info.value
        listed = [r["name"] for r in (await client.get("/v2/systemsharedmemory/status", headers=AUTH)).json()]
    messages = {what: (r.status_code, r.json()["error"]) for what, r in refused.items()}
    assert messages == {
        "3,000 characters": (400, "shared memory region name: expected 1 to 128 characters, got 3000"),
        "a newline": (400, f"{NAMED}'a\\nb'"),
        "a space": (400, f"{NAMED}'a b'"),
    }
    assert longest.status_code == 200, longest.text
    assert {what: (e.code(), e.details()) for what, e in refused_grpc.items()} == {
        "empty": (grpc.StatusCode.INVALID_ARGUMENT, "shared memory region name: expected 1 to 128 characters, got 0"),
        "129 characters": (
            grpc.StatusCode.INVALID_ARGUMENT,
            "shared memory region name: expected 1 to 128 characters, got 129",
        ),
        "dot-dot": (grpc.StatusCode.INVALID_ARGUMENT, f"{NAMED}'..'"),
        "a slash": (grpc.StatusCode.INVALID_ARGUMENT, f"{NAMED}'a/b'"),
    }
    assert listed == ["x" * 128]


@contextlib.contextmanager
def no_descriptor_to_spare() -> Iterator[None]:
    """This process's open-file limit lowered to its lowest free descriptor, so the next ``open`` fails ``EMFILE``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_server_out_of_descriptors_answers_503_not_the_client_s_400(
    tiny_store: Path, segment: shared_memory.SharedMemory
) -> None:
    body = {"key": shm_key(segment), "byte_size": 1024}
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        with no_descriptor_to_spare():
            short = await register(client, "r", body)
        after = await register(client, "r", body)
    assert short.status_code == 503, short.text
    assert short.headers["retry-after"] == "5"  # a shortage that passes as connections close, not in a moment
    assert short.json()["error"] == (
        f"cannot open shared memory {body['key']!r}: the server is out of file descriptors (Too many open files); "
        "its open-file limit is too low for its connections and max_shm_regions"
    )
    assert after.status_code == 200, after.text


def test_a_front_end_that_cannot_mirror_a_region_answers_503_until_it_can(segment: shared_memory.SharedMemory) -> None:
    """A front-end's copy of a region it had no file descriptor for had been dropped: requests naming it read "no
    shared memory region 'r' is registered", blaming the client for the server's shortage."""
    from halfserve.errors import ServerResourceError
    from halfserve.regions import Regions

    engine = Regions(most=4)
    engine.register("r", shm_key(segment), 0, 1024)
    front_end = Regions(most=4)
    with no_descriptor_to_spare():
        front_end.sync(engine.status())
        with pytest.raises(ServerResourceError, match="out of file descriptors"):
            front_end.get("r", "inputs[0]")
    assert front_end.get("r", "inputs[0]").status() == engine.status()[0]  # opened once a descriptor is free
    front_end.sync([])
    with pytest.raises(Exception, match="no shared memory region 'r' is registered"):
        front_end.get("r", "inputs[0]")
