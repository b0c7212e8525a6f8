"""Instance processes restarted after the store or the code path changed serve the model the server loaded: they
build it from what the server process handed them at load (weights, a ``--code-path`` module's source, a Hugging Face
configuration), never from the files as they are now."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import serving
from tests.integration.test_isolated import alive, model, processes
from tests.integration.test_isolated_restarts import module_name, save_crashing
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.slow


async def restart_all(client: httpx.AsyncClient, name: str) -> None:
    """Kill every instance process of ``name`` and return once all were replaced and the model is ready again."""
    pids = (await model(client, name))["stats"]["instance_pids"]  # type: ignore[index]
    for pid in pids:  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        now = (await model(client, name))["stats"]["instance_pids"]  # type: ignore[index]
        ready = (await client.get("/ready")).status_code == 200
        if ready and not set(now) & set(pids) and all(alive(p) for p in now):  # type: ignore[arg-type, attr-defined]
            return
        assert time.monotonic() < deadline, f"the killed processes were not restarted within {DEADLINE_S:g} s: {now}"
        await asyncio.sleep(0.05)


async def test_a_restarted_process_runs_the_code_path_module_as_loaded_not_as_it_is_now(tmp_path: Path) -> None:
    code, _, _ = save_crashing(tmp_path)
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        body = {"inputs": [[1.0, 2.0, 3.0, 4.0]]}
        before = (await client.post("/predict", json=body)).json()["outputs"]
        path = code / f"{module_name(tmp_path)}.py"
        source = path.read_text()
        changed = source.replace("return self.linear(x)", "return self.linear(x) + 1000.0")
        assert changed != source
        path.write_text(changed)
        await restart_all(client, "crashing")
        after = await client.post("/predict", json=body)
        assert after.status_code == 200, after.text
        assert after.json()["outputs"] == before


async def test_a_restarted_process_builds_a_hugging_face_model_from_its_config_as_loaded(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_hugging_face import hf_store  # noqa: PLC0415 - needs transformers

    vdir, _ = hf_store(tmp_path)
    async with serving(processes(store=tmp_path, precision="fp32")) as client:
        body = {"inputs": [[5, 17, 23, 42, 7, 1, 99, 3]]}
        first = await client.post("/predict", json=body)
        assert first.status_code == 200, first.text
        before = first.json()["outputs"]
        config = json.loads((vdir / "config.json").read_text())
        config.update(hidden_act="relu", layer_norm_eps=0.5)  # other answers from the same weights
        (vdir / "config.json").write_text(json.dumps(config))
        await restart_all(client, "bert")
        after = await client.post("/predict", json=body)
        assert after.status_code == 200, after.text
        assert after.json()["outputs"] == before
