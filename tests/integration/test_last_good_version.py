"""A version that fails to load never replaces one that serves: at start-up the newest version that loads is served,
and a load or reload that fails leaves the serving version answering; ``/models`` names the versions that failed. A
model whose forward does not return the outputs its manifest declares fails its load, not each of its requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
from safetensors.torch import save_file

from halfserve import models, storage
from halfserve.manifest import TensorSpec
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving

TOKEN = "management-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SAMPLE = {"model": "tiny", "inputs": [[0.5] * 16]}


def settings(root: Path) -> Settings:
    return Settings(store=root, admin_token=TOKEN)


def version_folder(root: Path, version: int) -> Path:
    folder = root / "tiny" / str(version)
    folder.mkdir()
    return folder


def checkpoint(root: Path, version: int, **mlp: object) -> None:
    save_file(models.build("mlp", **mlp).state_dict(), str(version_folder(root, version) / storage.WEIGHTS))


def misshapen(root: Path, version: int) -> None:
    """A checkpoint whose tensor names fit the architecture and whose shapes do not: it fails at load."""
    checkpoint(root, version, in_features=8, hidden=[32], out_features=4)


def misnamed(root: Path, version: int) -> None:
    """A checkpoint with a layer the architecture lacks: refused before the port binds."""
    checkpoint(root, version, in_features=16, hidden=[32, 32], out_features=4)


def unreadable(root: Path, version: int) -> None:
    (version_folder(root, version) / storage.WEIGHTS).write_bytes(b"not a safetensors file")


async def listing(client: httpx.AsyncClient) -> dict[str, object]:
    entry: dict[str, object] = next(m for m in (await client.get("/models")).json()["models"] if m["name"] == "tiny")
    return entry


async def answers(client: httpx.AsyncClient) -> None:
    r = await client.post("/predict", json=SAMPLE)
    assert r.status_code == 200, r.text
    assert (await client.get("/ready")).status_code == 200


async def test_at_start_up_the_newest_version_that_loads_is_served(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    misshapen(tmp_path, 2)  # fails while loading
    misnamed(tmp_path, 3)  # fails its check before loading
    async with serving(settings(tmp_path)) as client:
        await answers(client)
        entry = await listing(client)
    assert (entry["version"], entry["state"], entry["error"]) == (1, "ready", None)
    failed = entry["failed_versions"]
    assert isinstance(failed, list)
    assert [f["version"] for f in failed] == [2, 3]
    assert "checkpoint does not fit" in failed[0]["error"]
    assert "size mismatch" in failed[0]["error"]
    assert "unexpected: " in failed[1]["error"]


async def test_a_load_or_reload_that_fails_leaves_the_served_version_answering(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(settings(tmp_path)) as client:
        await answers(client)
        unreadable(tmp_path, 2)
        for path in ("/models/tiny/load", "/v2/repository/models/tiny/load"):
            r = await client.post(path, json={}, headers=AUTH)
            assert r.status_code == 400, r.text
            assert "cannot read safetensors checkpoint" in r.json()["error"]
            await answers(client)
        entry = await listing(client)
        assert (entry["version"], entry["state"]) == (1, "ready")
        failed = entry["failed_versions"]
        assert isinstance(failed, list)
        assert [f["version"] for f in failed] == [2]
        assert "2/model.safetensors: cannot read safetensors checkpoint" in failed[0]["error"]
        r = await client.post("/models/tiny/reload", json={}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1
        assert [f["version"] for f in r.json()["failed_versions"]] == [2]  # still passed over
        await answers(client)
        shutil.rmtree(tmp_path / "tiny" / "2")  # gone from the store: no longer named as failing
        r = await client.post("/models/tiny/reload", json={}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["failed_versions"] == []


async def test_loading_a_model_not_served_takes_its_newest_version_that_loads(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(settings(tmp_path)) as client:
        assert (await client.post("/models/tiny/unload", headers=AUTH)).status_code == 200
        misshapen(tmp_path, 2)
        r = await client.post("/models/tiny/load", json={}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert (r.json()["version"], r.json()["state"]) == (1, "ready")
        assert [f["version"] for f in r.json()["failed_versions"]] == [2]
        await answers(client)
        # Asked for by number, a version that fails is not swapped for another.
        r = await client.post("/models/tiny/load", json={"version": 2}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert "size mismatch" in r.json()["error"]
        await answers(client)


async def test_a_model_that_does_not_return_its_declared_outputs_fails_its_load_not_its_requests(
    tmp_path: Path,
) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(settings(tmp_path)) as client:
        # Its forward returns 4 values a row; the manifest says 2, and labels them.
        save_tiny_mlp(tmp_path, "liar", outputs=[TensorSpec(name="logits", shape=[2])], labels=["a", "b"])
        r = await client.post("/models/liar/load", json={}, headers=AUTH)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == (
            f"failed to load 'liar': {tmp_path / 'liar' / storage.MANIFEST}: outputs: output 'logits' has rows of "
            "shape [4], declared [2]; "
            "the model's forward returns one tensor, rows of shape [4] float32 (for 2 rows): the manifest's outputs "
            "must say what it returns"
        )
        r = await client.post("/predict", json={"model": "liar", "inputs": [[0.5] * 16]})
        assert r.status_code == 404, r.text  # not served, rather than a 500 on every request
        await answers(client)
