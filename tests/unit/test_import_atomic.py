"""An import writes its version into a dot-prefixed folder the store's version scan ignores, and renames it into
place only once complete: a failed import leaves the store as it was, and what a killed one left is ignored by the
server and removed by the next import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halfserve import cli, models, storage, store
from halfserve.importer import ImportFailure, import_model
from halfserve.manifest import TensorSpec

MLP = {"in_features": 6, "hidden": [8], "out_features": 4}
FEATURES = [TensorSpec(name="features", shape=[6])]
CPU = torch.device("cpu")
STAGE_PREFIX = ".import-"
"""The folder an import writes into, ``.import-<pid>-<random>`` (:data:`halfserve.storage.STAGE_PREFIX`)."""


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_a_reimport_missing_its_tokenizer_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.integration.test_padding_invariance import import_args, text_bert  # noqa: PLC0415

    text = ["--mask", "attention_mask", "--text", "text"]
    source, root = text_bert(tmp_path / "bert"), tmp_path / "store"
    assert cli.main(import_args(source, root, *text)) == 0
    before = snapshot(root)
    (source / "tokenizer.json").unlink()
    assert cli.main(import_args(source, root, *text)) == 2
    assert snapshot(root) == before
    assert storage.versions(root / "bert") == [1]
    # A fresh name leaves no model folder behind.
    assert cli.main(import_args(source, tmp_path / "fresh", *text)) == 2
    assert not (tmp_path / "fresh" / "bert").exists()


def test_what_a_killed_import_left_is_ignored_and_removed_by_the_next_import(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path, root = tmp_path / "weights.pth", tmp_path / "store"
    torch.save(models.build("mlp", **MLP).state_dict(), path)
    import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    killed = root / "net" / f"{STAGE_PREFIX}{dead_pid()}-x1"
    killed.mkdir()
    (killed / storage.WEIGHTS).write_bytes(b"half a checkpo")
    running = root / "net" / f"{STAGE_PREFIX}{os.getpid()}-x2"  # this process: still writing
    running.mkdir()
    assert storage.versions(root / "net") == [1]
    assert store.load(root, "net").version == 1
    result = import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    assert result.version_dir == root / "net" / "2"
    assert not killed.exists()
    assert running.exists()
    assert sorted(p.name for p in (root / "net").iterdir()) == [running.name, "1", "2", storage.MANIFEST]
    assert store.load(root, "net").version == 2


def test_an_import_numbers_its_version_past_a_stray_file_and_stops_at_the_highest_number(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path, root = tmp_path / "weights.pth", tmp_path / "store"
    torch.save(models.build("mlp", **MLP).state_dict(), path)
    import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    (root / "net" / "2").write_text("not a version")  # the rename onto it failed, and the import retried 2 for ever
    (root / "net" / "3").symlink_to(tmp_path / "nowhere")
    result = import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    assert result.version_dir == root / "net" / "4"
    assert store.load(root, "net").version == 4
    (root / "net" / "4").rename(root / "net" / "999999999")  # the highest a version may be
    with pytest.raises(storage.StoreError, match=r"999999999 is the highest number a version may have \(9 digits\)"):
        import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    assert not [p for p in (root / "net").iterdir() if p.name.startswith(STAGE_PREFIX)]  # its stage removed
    assert storage.versions(root / "net") == [1, 999999999]


def test_an_import_whose_manifest_the_server_would_refuse_writes_nothing(tmp_path: Path) -> None:
    wide = {"in_features": 6, "hidden": [8], "out_features": 100_000}
    path, root = tmp_path / "weights.pth", tmp_path / "store"
    torch.save(models.build("mlp", **wide).state_dict(), path)
    labels = [f"a rather long class name, number {i:08d}" for i in range(100_000)]  # about 5 MB of JSON
    with pytest.raises(ImportFailure, match=r"config.json would be \d+ bytes, over the 4194304-byte limit"):
        import_model(path, root, "net", "mlp", FEATURES, arch_kwargs=wide, labels=labels, device=CPU)
    assert not (root / "net").exists()  # it had been written, and serve refused it
