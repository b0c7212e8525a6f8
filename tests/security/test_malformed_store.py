"""One malformed model folder fails that model alone, named, and the others serve: a manifest nested 200,000 deep
(``RecursionError`` in the parser), one of 340 MB (refused by its size before it is read: parsing it took 1.46 GB),
a version folder named ``²`` (``isdigit()`` is true, ``int()`` refuses it); the same cap and depth hold for the
JSON files of a version folder (a Hugging Face model's config.json)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from halfserve import storage, store
from halfserve.manifest import Manifest, TensorSpec, load_manifest
from halfserve.storage import MAX_JSON_BYTES, StoreError
from tests.conftest import save_tiny_mlp, start_server

DEEP = "[" * 200_000 + "]" * 200_000
HUGE = 340 * 1024 * 1024


def malformed(root: Path) -> None:
    """Next to servable models: a manifest nested too deeply, a huge one (a sparse file: its size is all that is
    needed), and a version folder whose name is a digit to ``isdigit()`` and not to ``int()``."""
    for name in ("deep", "huge"):
        (root / name / "1").mkdir(parents=True)
    (root / "deep" / storage.MANIFEST).write_text(DEEP)
    with (root / "huge" / storage.MANIFEST).open("wb") as f:
        f.truncate(HUGE)
    save_tiny_mlp(root, "odd")
    for name in ("²", "07", "0"):
        (root / "odd" / name).mkdir()


def test_versions_are_the_folders_named_as_numbers_are_written(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "odd")
    for name in ("²", "٣", "07", "0", "-1", ".import-1-x", "5 "):
        (tmp_path / "odd" / name).mkdir()
    (tmp_path / "odd" / "9").write_text("a file, not a folder")
    assert storage.versions(tmp_path / "odd") == [1]


def test_a_manifest_too_large_or_too_deep_fails_its_model_named(tmp_path: Path) -> None:
    malformed(tmp_path)
    with pytest.raises(StoreError, match=r"deep/config.json: not valid JSON \(nested too deeply\)"):
        load_manifest(tmp_path / "deep")
    with pytest.raises(StoreError, match=rf"huge/config.json: {HUGE} bytes, over the {MAX_JSON_BYTES}-byte limit"):
        load_manifest(tmp_path / "huge")


def test_a_version_folders_config_json_has_the_same_bounds(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    manifest = Manifest(
        name="hf",
        architecture="transformers:AutoModel",
        inputs=[TensorSpec(name="input_ids", datatype="INT64", shape=[8])],
        outputs=[TensorSpec(name="last_hidden_state", shape=[8, 4])],
    )
    version = tmp_path / "hf" / "1"
    version.mkdir(parents=True)
    config = version / "config.json"
    config.write_text('{"model_type": "bert", "x": ' + DEEP + "}")
    with pytest.raises(StoreError, match="1/config.json: not valid JSON"):
        store.build(tmp_path / "hf", manifest, version)
    with config.open("wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(StoreError, match="1/config.json: .* over the .*-byte limit"):
        store.build(tmp_path / "hf", manifest, version)


def test_a_server_starts_and_serves_beside_malformed_model_folders(tmp_path: Path) -> None:
    root = tmp_path / "store"
    save_tiny_mlp(root)
    malformed(root)
    server = start_server(root, tmp_path / "server.log")
    try:
        listed = {m["name"]: m for m in httpx.get(f"{server.url}/models").json()["models"]}
        for name in ("tiny", "odd"):
            r = httpx.post(f"{server.url}/predict", json={"model": name, "inputs": [[0.5] * 16]})
            assert r.status_code == 200, r.text
        assert httpx.get(f"{server.url}/ready").status_code == 200
        assert sorted(listed) == ["odd", "tiny"]
        assert listed["odd"]["version"] == 1
        if server.proc.pid and Path(f"/proc/{server.proc.pid}/status").is_file():
            peak = next(
                line for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines() if "VmHWM" in line
            )
            print(f"server peak RSS beside a {HUGE >> 20} MB manifest: {peak.split(':')[1].strip()}")
    finally:
        server.stop()
    log = server.log.read_text()
    assert "model 'deep' cannot be served: " in log
    assert "deep/config.json: not valid JSON (nested too deeply)" in log
    assert f"model 'huge' cannot be served: {root}/huge/config.json: {HUGE} bytes, over the" in log
