"""A client's shared memory object can change under the server at any moment: nothing it does may take the server
down. The server reads and writes client objects with pread/pwrite on a kept descriptor, never through a mapping,
so a shrunk object is a short read (400) and a full tmpfs an ENOSPC (507), not a SIGBUS that kills the process."""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ServerProcess, save_tiny_mlp

pytestmark = pytest.mark.slow

TOKEN = "shm-security-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROWS = 512  # 32 KiB of FP32 input: long enough a read for a shrink to land inside it
SIZE = ROWS * 16 * 4


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("shm-faults-store")
    save_tiny_mlp(root, batching={"max_batch_size": 512, "max_delay_ms": 1})
    return server_factory(root, "--admin-token", TOKEN, "--precision", "fp32")


def infer(client: httpx.Client, region: str, *, output: bool) -> httpx.Response:
    ins = {"shared_memory_region": region, "shared_memory_byte_size": SIZE}
    body: dict[str, object] = {
        "inputs": [{"name": "features", "shape": [ROWS, 16], "datatype": "FP32", "parameters": ins}]
    }
    if output:
        outs = {"shared_memory_region": region, "shared_memory_byte_size": ROWS * 4 * 4, "shared_memory_offset": SIZE}
        body["outputs"] = [{"name": "logits", "parameters": outs}]
    return client.post("/v2/models/tiny/infer", json=body)


def test_an_object_shrunk_and_regrown_under_requests_never_kills_the_server(server: ServerProcess) -> None:
    name = f"halfserve-flap-{secrets.token_hex(4)}"
    path = Path("/dev/shm") / name
    full = 2 * SIZE
    path.write_bytes(np.ones(full // 4, np.float32).tobytes())
    stop = threading.Event()

    def flap() -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            while not stop.is_set():
                os.ftruncate(fd, 4096)
                os.ftruncate(fd, full)
        finally:
            os.close(fd)

    statuses: list[int] = []
    flapper = threading.Thread(target=flap, daemon=True)
    try:
        with httpx.Client(base_url=server.url, timeout=10, headers=AUTH) as client:
            reg = client.post(
                f"/v2/systemsharedmemory/region/{name}/register", json={"key": "/" + name, "byte_size": full}
            )
            assert reg.status_code == 200, reg.text
            flapper.start()
            deadline = time.monotonic() + 8
            i = 0
            while time.monotonic() < deadline and i < 600:
                statuses.append(infer(client, name, output=i % 2 == 1).status_code)
                i += 1
            stop.set()
            flapper.join()
            after = client.post("/predict", json={"inputs": [[0.0] * 16]})
            client.post(f"/v2/systemsharedmemory/region/{name}/unregister")
    finally:
        stop.set()
        path.unlink()
    assert server.proc.poll() is None, f"the server died:\n{server.log.read_text()[-2000:]}"
    assert set(statuses) <= {200, 400}, statuses
    assert after.status_code == 200


@pytest.fixture
def object_on_a_full_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A 1 MiB sparse shared memory object on a tmpfs of one page that its first page fills, as an object on Docker's
    64 MB /dev/shm is once the others fill it: bind-mounted over ``/dev/shm/<name>`` (mounts need root)."""
    name = f"halfserve-full-{secrets.token_hex(4)}"
    fs, target = tmp_path / "tiny", Path("/dev/shm") / name
    fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(fs)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with (fs / "obj").open("wb") as f:
            f.write(np.ones(16, np.float32).tobytes())  # the input, on the one page the tmpfs has
            f.truncate(1 << 20)
        target.touch()
        try:
            subprocess.run(["mount", "--bind", str(fs / "obj"), str(target)], check=True, capture_output=True)
            try:
                yield name
            finally:
                subprocess.run(["umount", str(target)], check=True)
        finally:
            target.unlink()
    finally:
        subprocess.run(["umount", str(fs)], check=True)


def test_an_output_into_a_full_tmpfs_is_a_507_not_a_dead_server(
    server: ServerProcess, object_on_a_full_tmpfs: str
) -> None:
    name = object_on_a_full_tmpfs
    ins = {"shared_memory_region": name, "shared_memory_byte_size": 64}
    outs = {"shared_memory_region": name, "shared_memory_byte_size": 16, "shared_memory_offset": 512 << 10}
    body = {
        "inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "parameters": ins}],
        "outputs": [{"name": "logits", "parameters": outs}],
    }
    with httpx.Client(base_url=server.url, timeout=10, headers=AUTH) as client:
        reg = client.post(
            f"/v2/systemsharedmemory/region/{name}/register", json={"key": "/" + name, "byte_size": 1 << 20}
        )
        assert reg.status_code == 200, reg.text
        try:
            full = client.post("/v2/models/tiny/infer", json=body)
            after = client.post("/predict", json={"inputs": [[0.0] * 16]})
        finally:
            client.post(f"/v2/systemsharedmemory/region/{name}/unregister")
    assert server.proc.poll() is None, f"the server died:\n{server.log.read_text()[-2000:]}"
    assert full.status_code == 507, full.text
    assert full.json()["error"].startswith(f"outputs[0].parameters: no room to write shared memory region '{name}'")
    assert after.status_code == 200
