"""Engine instances in processes of their own (``--placement instance_processes``), in-process app, real instance
processes: the same answers as threads, fault isolation, a crashed process restarted, counters, precision switches."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from halfserve import store
from halfserve.engine.protocol import EngineError
from halfserve.execution import Batching, Execution
from halfserve.isolated.engine import ProcessEngine
from halfserve.manifest import Manifest, OverflowPolicy, Precision, TensorSpec
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.fault_models import save_overflowing_linear
from tests.integration.conftest import serving

pytestmark = pytest.mark.slow

TOKEN = "isolated-test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CRASH, POISON, OOM_ABOVE = 777.0, 666.0, 4

FAULTY = textwrap.dedent(
    """
    import os

    import torch
    from torch import nn


    class Faulty(nn.Module):
        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__()
            self.linear = nn.Linear(in_features, out_features)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if (x == {crash}).any():
                os._exit(3)  # the process dies, as a segfault in a kernel would take it
            if (x == {poison}).any():
                raise ValueError("poisoned input")
            if x.shape[0] > {oom_above} and bool(x.any()):  # not the warm-up's zeros
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {{x.shape[0]}} rows' worth")
            return self.linear(x)


    def build(in_features: int, out_features: int) -> nn.Module:
        return Faulty(in_features, out_features)
    """
).format(crash=CRASH, poison=POISON, oom_above=OOM_ABOVE)


def save_faulty(root: Path, code: Path, instances: int = 1) -> None:
    """A linear model from the operator's code (``faulty:build``) that kills its process for an input holding
    ``CRASH`` and raises for one holding ``POISON``."""
    code.mkdir(exist_ok=True)
    (code / "faulty.py").write_text(FAULTY)
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.linear = torch.nn.Linear(4, 3)
    manifest = Manifest(
        name="faulty",
        architecture="faulty:build",
        arch_kwargs={"in_features": 4, "out_features": 3},
        inputs=[TensorSpec(name="x", shape=[4])],
        outputs=[TensorSpec(name="y", shape=[3])],
        batching=Batching(max_batch_size=8, max_delay_ms=20),
        execution=Execution(instances=instances),
    )
    store.save(root, manifest, module)


def processes(**kw: object) -> Settings:
    return Settings(placement="instance_processes", admin_token=TOKEN, **kw)  # type: ignore[arg-type]


async def model(client: httpx.AsyncClient, name: str) -> dict[str, object]:
    r = await client.get("/models")
    found: dict[str, object] = next(m for m in r.json()["models"] if m["name"] == name)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_instance_processes_answer_as_threads_do(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "tiny", execution=Execution(instances=2))
    x = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    answers = {}
    for mode in ("instance_threads", "instance_processes"):
        settings = Settings(store=tmp_path, precision="fp32", placement=mode, max_delay_ms=20)  # type: ignore[arg-type]
        async with serving(settings) as client:
            replies = await asyncio.gather(
                *(client.post("/predict", json={"inputs": x[i : i + 4].tolist()}) for i in range(0, 40, 4))
            )
            assert [r.status_code for r in replies] == [200] * 10
            answers[mode] = np.concatenate([np.array(r.json()["outputs"], dtype=np.float32) for r in replies])
            listing = await model(client, "tiny")
            assert listing["execution"]["placement"] == mode  # type: ignore[index]
            stats = listing["stats"]
            assert isinstance(stats, dict)
            if mode == "instance_processes":
                pids = stats["instance_pids"]
                assert len(set(pids)) == 2
                assert os.getpid() not in pids
                assert all(alive(p) for p in pids)
                assert stats["rows"] == 40
                assert sum(stats["instance_forwards"]) > 0
    np.testing.assert_allclose(answers["instance_processes"], answers["instance_threads"], rtol=1e-5, atol=1e-6)
    assert not any(alive(p) for p in pids)  # the processes exit with the server


async def test_a_poisoned_request_fails_alone_and_its_process_keeps_serving(tmp_path: Path) -> None:
    save_faulty(tmp_path, tmp_path / "code")
    async with serving(processes(store=tmp_path, code_path=[tmp_path / "code"], precision="fp32")) as client:
        pid = (await model(client, "faulty"))["stats"]["instance_pids"]  # type: ignore[index]
        rows = [[1.0, 2.0, 3.0, float(i)] for i in range(7)]
        rows[3] = [POISON] * 4
        replies = await asyncio.gather(*(client.post("/predict", json={"inputs": [r]}) for r in rows))
        statuses = [r.status_code for r in replies]
        assert statuses == [200, 200, 200, 500, 200, 200, 200]
        assert "poisoned input" in replies[3].json()["error"]
        assert (await model(client, "faulty"))["stats"]["instance_pids"] == pid  # type: ignore[index]


async def test_out_of_memory_in_a_process_shrinks_the_batch_size_and_fails_nobody(tmp_path: Path) -> None:
    save_faulty(tmp_path, tmp_path / "code")
    settings = processes(store=tmp_path, code_path=[tmp_path / "code"], precision="fp32", max_delay_ms=100)
    async with serving(settings) as client:
        replies = await asyncio.gather(
            *(client.post("/predict", json={"inputs": [[1.0, 2.0, 3.0, float(i)]]}) for i in range(8))
        )
        assert [r.status_code for r in replies] == [200] * 8
        stats = (await model(client, "faulty"))["stats"]
        # The batcher halved its batch size until a batch fitted: the process raised the batch-too-large error.
        assert (stats["max_batch_size"], stats["configured_max_batch_size"]) == (OOM_ABOVE, 8)  # type: ignore[index]


async def test_a_crashed_instance_process_fails_only_its_request_and_is_restarted(tmp_path: Path) -> None:
    save_faulty(tmp_path, tmp_path / "code")
    async with serving(processes(store=tmp_path, code_path=[tmp_path / "code"], precision="fp32")) as client:
        [before] = (await model(client, "faulty"))["stats"]["instance_pids"]  # type: ignore[index]
        rows = [[1.0, 2.0, 3.0, float(i)] for i in range(5)]
        rows[2] = [CRASH] * 4
        replies = await asyncio.gather(*(client.post("/predict", json={"inputs": [r]}) for r in rows))
        # The batch that held the crashing row is rerun in parts on the restarted process, until the row stands
        # alone: only its request fails.
        assert [r.status_code for r in replies] == [200, 200, 500, 200, 200]
        assert "exited" in replies[2].json()["error"]
        assert not alive(before)
        [after] = (await model(client, "faulty"))["stats"]["instance_pids"]  # type: ignore[index]
        assert after != before
        assert alive(after)
        r = await client.post("/predict", json={"inputs": [[1.0, 1.0, 1.0, 1.0]]})
        assert r.status_code == 200


async def test_one_of_two_processes_killed_the_other_serves_meanwhile(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "tiny", execution=Execution(instances=2))
    async with serving(processes(store=tmp_path, precision="fp32")) as client:
        pids = (await model(client, "tiny"))["stats"]["instance_pids"]  # type: ignore[index]
        os.kill(pids[0], 9)
        deadline = time.monotonic() + 60
        statuses = []
        while time.monotonic() < deadline:
            r = await client.post("/predict", json={"inputs": [[0.5] * 16]})
            statuses.append(r.status_code)
            now = (await model(client, "tiny"))["stats"]["instance_pids"]  # type: ignore[index]
            if pids[0] not in now and all(alive(p) for p in now):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the killed process was not restarted within 60 s: {now}")
        # A batch handed to the killed process before its end was seen never reached it: it runs on the other
        # process, which answers the rest while it restarts.
        assert statuses == [200] * len(statuses)
        assert pids[1] in now


async def test_overflow_rerun_and_counters_come_back_from_the_process(tmp_path: Path) -> None:
    save_overflowing_linear(tmp_path, "over", OverflowPolicy.RERUN_FP32)
    async with serving(processes(store=tmp_path)) as client:
        r = await client.post("/predict", json={"inputs": [[100.0] * 4, [1.0] * 4]})
        assert r.status_code == 200, r.text
        assert r.json()["precision"] == "fp32"  # the overflowing chunk was rerun in fp32, in the process
        assert r.json()["outputs"][0][0] == pytest.approx(80_000.0)
        stats = (await model(client, "over"))["stats"]
        assert (stats["overflows"], stats["fp32_reruns"]) == (1, 1)  # type: ignore[index]


async def test_a_precision_switch_starts_new_processes_and_stops_the_old(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "tiny")
    async with serving(processes(store=tmp_path, precision="fp16")) as client:
        listing = await model(client, "tiny")
        [old] = listing["stats"]["instance_pids"]  # type: ignore[index]
        assert listing["weight_dtype"] == "float16"
        r = await client.post("/models/tiny/precision", json={"precision": "fp32"}, headers=AUTH)
        assert r.status_code == 200, r.text
        listing = await model(client, "tiny")
        [new] = listing["stats"]["instance_pids"]  # type: ignore[index]
        assert (listing["precision"], listing["weight_dtype"]) == ("fp32", "float32")
        assert new != old
        assert alive(new)
        assert not alive(old)
        r = await client.post("/predict", json={"inputs": [[0.25] * 16]})
        assert (r.status_code, r.json()["precision"]) == (200, "fp32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
async def test_an_instance_process_that_cannot_start_fails_the_start_with_its_error(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "tiny")
    loaded = store.load(tmp_path, "tiny")
    on_cuda = Settings(store=tmp_path, device="cuda")  # what the process resolves: no CUDA here
    with pytest.raises(EngineError, match=r"ValueError: device 'cuda' requested but CUDA is not available"):
        await ProcessEngine.start(on_cuda, loaded, Precision.FP32, torch.device("cpu"), 8, False)


async def test_instance_processes_serve_the_weights_loaded_not_the_store_now(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "tiny", execution=Execution(instances=2))
    async with serving(processes(store=tmp_path, precision="fp32")) as client:
        before = (await client.post("/predict", json={"inputs": [[0.5] * 16]})).json()["outputs"]
        # The checkpoint changes on disk (another version saved over it); a restarted process still serves what the
        # server loaded, as a thread would, until the model is reloaded.
        save_tiny_mlp(tmp_path, "tiny", seed=1, execution=Execution(instances=2))
        (tmp_path / "tiny" / "1" / "model.safetensors").write_bytes(b"damaged")
        pids = (await model(client, "tiny"))["stats"]["instance_pids"]  # type: ignore[index]
        for pid in pids:
            os.kill(pid, 9)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = (await model(client, "tiny"))["stats"]["instance_pids"]  # type: ignore[index]
            if not set(now) & set(pids) and all(alive(p) for p in now):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the killed processes were not restarted within 60 s")
        after = (await client.post("/predict", json={"inputs": [[0.5] * 16]})).json()["outputs"]
        assert after == before
