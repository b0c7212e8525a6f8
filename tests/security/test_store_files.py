"""Every file the store reads must be a regular file: a checkpoint, manifest, calibration file or tokenizer that is a
named pipe (opening it blocked ``halfserve serve`` for ever, before any port opened), a link to ``/dev/zero`` or a
folder fails its model alone, as ``<path>: not a regular file``, logged, and the others serve. A folder left out of
the store is logged (its name as ``repr`` shows it, so a newline cannot forge a log line), a version folder named
past the largest version is logged too, and what an import writes is readable by other users as the umask allows."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from halfserve import calibration, models, storage, store
from halfserve.importer import import_model
from halfserve.manifest import TensorSpec, load_manifest
from halfserve.storage import StoreError
from tests.conftest import ServerProcess, free_port, save_tiny_mlp
from tests.waiting import wait_until

TOKEN = "store-files-token"
HUNG = 60
"""Seconds a test may run before it fails as hung (on the code before these checks, each one blocked for ever)."""


def fifo(path: Path) -> None:
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def folder(path: Path) -> None:
    path.mkdir()


NOT_REGULAR: dict[str, Callable[[Path], None]] = {"pipe": fifo, "zero": dev_zero, "folder": folder}
"""What stands where the store expects a file, by a model name that says so."""


def replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


@pytest.mark.timeout(HUNG)
@pytest.mark.parametrize("kind", sorted(NOT_REGULAR))
def test_a_checkpoint_that_is_not_a_regular_file_is_refused_named(tmp_path: Path, kind: str) -> None:
    save_tiny_mlp(tmp_path, kind)
    path = tmp_path / kind / "1" / storage.WEIGHTS
    replace(path, NOT_REGULAR[kind])
    manifest = load_manifest(tmp_path / kind)
    with pytest.raises(StoreError, match=f"^{path}: not a regular file$"):
        store.check_architecture(tmp_path / kind, manifest, 1)
    with pytest.raises(StoreError, match=f"^{path}: not a regular file$"):
        store.load(tmp_path, kind)


@pytest.mark.timeout(HUNG)
@pytest.mark.parametrize("kind", sorted(NOT_REGULAR))
def test_a_manifest_or_calibration_file_that_is_not_a_regular_file_is_refused_named(tmp_path: Path, kind: str) -> None:
    save_tiny_mlp(tmp_path, "tiny")
    manifest = load_manifest(tmp_path / "tiny")
    vdir = tmp_path / "tiny" / "1"
    NOT_REGULAR[kind](vdir / calibration.CALIBRATION)
    with pytest.raises(calibration.CalibrationError, match="calibration.safetensors: not a regular file"):
        calibration.stored(vdir, manifest)
    replace(tmp_path / "tiny" / storage.MANIFEST, NOT_REGULAR[kind])
    with pytest.raises(StoreError, match="tiny/config.json: not a regular file"):
        load_manifest(tmp_path / "tiny")


@pytest.mark.timeout(HUNG)
def test_a_pipe_swapped_in_after_the_check_cannot_block_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is checked again once open (opened without blocking): what looked regular may be replaced between."""
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / storage.MANIFEST
    os.mkfifo(path)
    looked = os.stat_result((stat.S_IFREG | 0o644, 0, 0, 1, 0, 0, 2, 0, 0, 0))
    monkeypatch.setattr(Path, "stat", lambda self, **_: looked if self == path else os.stat(self))
    with pytest.raises(StoreError, match="config.json: not a regular file"):
        load_manifest(tmp_path / "m")


@pytest.mark.timeout(HUNG)
def test_a_tokenizer_that_is_not_a_regular_file_is_refused_named(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from halfserve import text  # noqa: PLC0415

    save_tiny_mlp(tmp_path, "tiny")
    path = tmp_path / "tokenizer.json"
    os.mkfifo(path)
    with pytest.raises(text.TokenizerUnavailableError, match="tokenizer.json: not a regular file"):
        text.encoder_at(path, load_manifest(tmp_path / "tiny"))


def malformed(root: Path) -> None:
    """Beside the servable ``tiny``: models whose checkpoint or manifest is no regular file, one in a folder whose
    name holds a newline, and a version folder past the largest version number."""
    save_tiny_mlp(root)
    for kind, make in NOT_REGULAR.items():
        save_tiny_mlp(root, kind)
        replace(root / kind / "1" / storage.WEIGHTS, make)
        save_tiny_mlp(root, f"manifest-{kind}")
        replace(root / f"manifest-{kind}" / storage.MANIFEST, make)
    save_tiny_mlp(root, "forged")
    (root / "forged").rename(root / "forged\nERROR forged line")
    (root / "tiny" / ("9" * 29)).mkdir()


def serve(root: Path, log: Path) -> ServerProcess:
    """``halfserve serve`` once it answers ``/health`` (not ``/ready``: some models here fail, as they should)."""
    port = free_port()
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(root), "--port", str(port)]
        env = {**os.environ, "HALFSERVE_ADMIN_TOKEN": TOKEN}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)

    def healthy() -> bool:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
        try:
            return httpx.get(f"{server.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, "the server answers /health", timeout=120, every=0.1)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.mark.timeout(300)
def test_a_server_starts_beside_files_that_are_not_regular_and_logs_each(tmp_path: Path) -> None:
    root = tmp_path / "store"
    malformed(root)
    server = serve(root, tmp_path / "server.log")
    try:
        # the server answers /health while its models still load: wait for tiny's readiness before asking it
        wait_until(lambda: httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200, "tiny to be ready")
        r = httpx.post(f"{server.url}/predict", json={"model": "tiny", "inputs": [[0.5] * 16]})
        assert r.status_code == 200, r.text
        listed = {m["name"]: m for m in httpx.get(f"{server.url}/models").json()["models"]}
        assert sorted(listed) == sorted(["tiny", *NOT_REGULAR])
        for kind in NOT_REGULAR:
            assert listed[kind]["state"] == "failed", listed[kind]
            r = httpx.post(f"{server.url}/models/{kind}/load", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 400, r.text
            assert f"{kind}/1/{storage.WEIGHTS}: not a regular file" in r.json()["error"]
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
    log = server.log.read_text()
    for kind in NOT_REGULAR:
        assert f"{root}/{kind}/1/{storage.WEIGHTS}: not a regular file" in log
        manifest = root / f"manifest-{kind}" / storage.MANIFEST
        assert f"model 'manifest-{kind}' cannot be served: {manifest}: not a regular file" in log
    assert "model 'forged\\nERROR forged line' cannot be served: model name" in log
    assert "\nERROR forged line" not in log
    assert f"model 'tiny': version folder '{'9' * 29}' is ignored" in log


def test_version_folders_past_the_largest_version_are_left_out_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_tiny_mlp(tmp_path)
    for name in ("9" * 29, "1234567890", "999999999"):
        (tmp_path / "tiny" / name).mkdir()
    assert storage.versions(tmp_path / "tiny") == [1, 999999999]
    ignored = sorted(r.getMessage() for r in caplog.records if "is ignored" in r.message)
    assert ignored == [
        f"model 'tiny': version folder {name!r} is ignored: a version number has at most 9 digits"
        for name in sorted(("1234567890", "9" * 29))
    ]


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask_022")
def test_an_import_writes_files_and_folders_others_can_read(tmp_path: Path) -> None:
    """As a plain write would under the umask: a server running as another user reads the store."""
    mlp = {"in_features": 6, "hidden": [8], "out_features": 4}
    torch.manual_seed(0)
    source, root = tmp_path / "weights.pth", tmp_path / "store"
    torch.save(models.build("mlp", **mlp).state_dict(), source)
    features = [TensorSpec(name="features", shape=[6])]
    import_model(source, root, "net", "mlp", features, arch_kwargs=mlp, device=torch.device("cpu"))
    vdir = root / "net" / "1"
    modes = {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
        for p in (root / "net", vdir, root / "net" / storage.MANIFEST, vdir / storage.WEIGHTS)
    }
    modes[calibration.CALIBRATION] = stat.S_IMODE((vdir / calibration.CALIBRATION).stat().st_mode)
    assert modes == {
        "net": 0o755,
        "net/1": 0o755,
        f"net/{storage.MANIFEST}": 0o644,
        f"net/1/{storage.WEIGHTS}": 0o644,
        calibration.CALIBRATION: 0o644,
    }


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"_attn_implementation": "kernels-community/flash-attn"}, "_attn_implementation"),
        ({"attn_implementation": "kernels-community/flash-attn"}, "attn_implementation"),
        ({"text_config": {"_attn_implementation": "kernels-community/flash-attn"}}, "text_config._attn_implementation"),
    ],
)
def test_a_hugging_face_config_names_only_allowed_attention(
    tmp_path: Path, config: dict[str, object], field: str
) -> None:
    """The model's own config.json is held to the allow-list of ``arch_kwargs``: a hub repository named there would be
    downloaded and run as compiled kernels. Refused at load and at import; ``eager``, ``sdpa`` and null load."""
    pytest.importorskip("transformers")
    from tests.unit.test_hugging_face import HF, hf_store, tiny_bert  # noqa: PLC0415

    vdir, _ = hf_store(tmp_path / "store")
    original = json.loads((vdir / "config.json").read_text())
    (vdir / "config.json").write_text(json.dumps({**original, **config}))
    message = f"1/config.json: {field}: 'kernels-community/flash-attn' is refused; use one of \\['eager', 'sdpa'\\]"
    with pytest.raises(StoreError, match=message):
        store.load(tmp_path / "store", "bert")
    source = tmp_path / "source"
    tiny_bert(source)
    (source / "config.json").write_text(json.dumps({**original, **config}))
    inputs = [TensorSpec(name="input_ids", datatype="INT64", shape=[8])]
    with pytest.raises(StoreError, match=f"source/config.json: {field}: 'kernels-community/flash-attn' is refused"):
        import_model(source, tmp_path / "imported", "bert", HF, inputs, device=torch.device("cpu"))
    for allowed in ("eager", "sdpa", None):
        (vdir / "config.json").write_text(json.dumps({**original, "_attn_implementation": allowed}))
        store.load(tmp_path / "store", "bert")
