"""Nothing in a model folder runs: a manifest's ``module:factory`` architecture is taken only from the operator's
``--code-path`` folders, installed ``halfserve.architectures`` entry points or halfserve's own models, decided from
where the module lies before anything is imported. A manifest naming ``os:system``, ``subprocess:Popen`` or
``runpy:run_path`` (with a ``.py`` shipped in its folder) is refused at ``halfserve import`` and at load, where that
model fails with the reason and the others serve. A factory that raises fails its model's load, not the server, and a
``transformers:`` model's ``arch_kwargs`` are allow-listed (``attn_implementation`` naming a hub repository would
download and run compiled kernels)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from halfserve import importer, models, storage, store
from halfserve.app import create_app
from halfserve.manifest import TensorSpec, load_manifest
from halfserve.settings import Settings
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp
from tests.waiting import DEADLINE_S

ROOT = Path(__file__).resolve().parents[2]


def hostile(folder: Path, marker: Path) -> dict[str, tuple[str, dict[str, object]]]:
    """Architectures that would run a command or a script of the model folder's, each writing ``marker``."""
    script = folder / "payload.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return {
        "os": ("os:system", {"command": f"touch {marker}"}),
        "subprocess": ("subprocess:Popen", {"args": ["touch", str(marker)]}),
        "runpy": ("runpy:run_path", {"path_name": str(script)}),
    }


def write_hostile(root: Path, name: str, architecture: str, arch_kwargs: dict[str, object]) -> None:
    """A model folder's manifest naming ``architecture``, beside whatever its version folder already ships."""
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    manifest = {
        "name": name,
        "architecture": architecture,
        "arch_kwargs": arch_kwargs,
        "inputs": [{"name": "x", "shape": [4]}],
        "outputs": [{"name": "y", "shape": [2]}],
    }
    (folder / storage.MANIFEST).write_text(json.dumps(manifest))


@asynccontextmanager
async def started(settings: Settings, ready_model: str) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan, once ``ready_model`` is ready (the server as a whole is not: a model failed)."""
    app = create_app(settings)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    async with app.router.lifespan_context(app), client:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while (await client.get(f"/v2/models/{ready_model}/ready")).status_code != 200:
            assert loop.time() < deadline, f"model {ready_model} not ready"
            await asyncio.sleep(0.05)
        yield client


@pytest.mark.parametrize("kind", ["os", "subprocess", "runpy"])
async def test_a_manifest_naming_code_outside_the_code_path_fails_that_model_and_runs_nothing(
    tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "store"
    save_tiny_mlp(root)
    marker = tmp_path / "ran"
    architecture, kwargs = hostile(root, marker)[kind]
    write_hostile(root, "evil", architecture, kwargs)
    (root / "evil" / "1" / "payload.py").write_text((root / "payload.py").read_text())
    async with started(Settings(store=root), "tiny") as client:
        ok = await client.post("/predict", json={"model": "tiny", "inputs": np.zeros((2, 16)).tolist()})
        assert ok.status_code == 200, ok.text
        ready = await client.get("/v2/models/evil/ready")
        assert ready.status_code != 200
        health = await client.get("/health")
        assert health.status_code == 200
        evil = await client.post("/predict", json={"model": "evil", "inputs": [[0, 0, 0, 0]]})
        assert evil.status_code in (404, 503), evil.text
        assert "is not in a --code-path folder" in evil.text, evil.text
    assert not marker.exists()


def test_the_same_architectures_are_refused_at_import(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    weights = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(1)}, str(weights))
    for architecture, kwargs in hostile(tmp_path, marker).values():
        with pytest.raises(StoreError, match="is not in a --code-path folder"):
            importer.import_model(
                weights, tmp_path / "store", "evil", architecture, [TensorSpec(name="x", shape=[4])], arch_kwargs=kwargs
            )
    assert not marker.exists()
    assert not (tmp_path / "store" / "evil").exists()


def test_a_module_in_the_code_path_still_serves_and_a_shadowed_one_does_not(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "opcode_allowed.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def build() -> nn.Module:
                return nn.Linear(4, 2)
            """
        )
    )
    before = list(sys.path)
    try:
        models.add_code_path([code])
        assert models.resolve("opcode_allowed:build")().out_features == 2
        # The module's file decides, not its name: a stdlib module stays refused with a code path given.
        with pytest.raises(models.UnknownArchitectureError, match="not in a --code-path folder"):
            models.resolve("os:system")
        assert models.resolve("halfserve.models.mlp:MLP") is not None  # halfserve's own
    finally:
        sys.path[:] = before
        sys.modules.pop("opcode_allowed", None)


FACTORY_RAISES = """
    def build() -> object:
        raise RuntimeError("the factory fails")
"""


def test_a_factory_that_raises_fails_its_model_and_serve_starts_for_the_others(tmp_path: Path) -> None:
    """``halfserve serve``'s check before it binds: a factory's RuntimeError used to end it with a traceback."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "opcode_raises.py").write_text(textwrap.dedent(FACTORY_RAISES))
    root = tmp_path / "store"
    save_tiny_mlp(root)
    write_hostile(root, "broken", "opcode_raises:build", {})
    check = (
        "import sys; from halfserve import models; from halfserve.repository import ModelRepository;"
        "from halfserve.settings import Settings;"
        f"s = Settings(store={str(root)!r}, code_path=[{str(code)!r}]); models.add_code_path(s.code_path);"
        "r = ModelRepository(s); r.discover();"
        "print(r.models['broken'].state.value, r.models['tiny'].state.value); print(r.models['broken'].error)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    states, error = done.stdout.splitlines()
    assert states == "failed loading"
    assert "architecture: 'opcode_raises:build' failed to build: RuntimeError: the factory fails" in error
    # Alone in the store, the model fails `halfserve serve` with one line naming it, exit status 2.
    (root / "tiny" / storage.MANIFEST).unlink()
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(root), "--code-path", str(code)]
    serve = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert serve.returncode == 2, serve.stderr
    assert "Traceback" not in serve.stderr, serve.stderr
    assert "RuntimeError: the factory fails" in serve.stderr


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attn_implementation": "kernels-community/evil"}, "attn_implementation: 'kernels-community/evil' is refused"),
        ({"torch_dtype": "float16"}, "'torch_dtype' is refused for a transformers: model"),
        ({"device_map": "auto"}, "'device_map' is refused"),
    ],
)
def test_hugging_face_arch_kwargs_are_allow_listed(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    from tests.unit.test_hugging_face import hf_store

    hf_store(tmp_path)
    m = load_manifest(tmp_path / "bert")
    store.write_manifest(tmp_path, m.model_copy(update={"arch_kwargs": kwargs}))
    with pytest.raises(StoreError, match=message):
        store.load(tmp_path, "bert")
    store.write_manifest(tmp_path, m.model_copy(update={"arch_kwargs": {"attn_implementation": "eager"}}))
    assert store.load(tmp_path, "bert").module.config._attn_implementation == "eager"


async def test_a_store_inside_a_code_path_folder_runs_no_module_of_its_own(tmp_path: Path) -> None:
    """With the store inside a ``--code-path`` folder, a model folder's ``.py`` is importable as ``store.<model>...``:
    it is refused before it is imported, naming the store, and the other models serve."""
    root = tmp_path / "store"
    save_tiny_mlp(root)
    marker = tmp_path / "ran"
    write_hostile(root, "evil", "store.evil.pwn:Net", {})
    (root / "evil" / "pwn.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nNet = None\n")
    async with started(Settings(store=root, code_path=[tmp_path]), "tiny") as client:
        ok = await client.post("/predict", json={"model": "tiny", "inputs": np.zeros((2, 16)).tolist()})
        assert ok.status_code == 200, ok.text
        evil = await client.post("/predict", json={"model": "evil", "inputs": [[0, 0, 0, 0]]})
        assert evil.status_code in (404, 503), evil.text
        assert "lies in the model store" in evil.text, evil.text
    assert not marker.exists()
