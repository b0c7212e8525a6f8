"""The store never runs code from a checkpoint and never leaves its folder, whatever the name or file holds."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from halfserve import storage, store
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp


class Exploit:
    """Unpickling it creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_a_torch_archive_posing_as_a_checkpoint_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    vdir = save_tiny_mlp(tmp_path)
    torch.save({"weight": Exploit(marker)}, vdir / storage.WEIGHTS)
    with pytest.raises(StoreError, match="cannot read safetensors checkpoint"):
        store.load(tmp_path, "tiny")
    assert not marker.exists()


def test_a_pickle_beside_the_checkpoint_is_never_read(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    vdir = save_tiny_mlp(tmp_path)
    for name in ("model.pt", "model.pth", "pytorch_model.bin", "model.ckpt"):
        torch.save({"weight": Exploit(marker)}, vdir / name)
    assert store.load(tmp_path, "tiny").version == 1
    assert not marker.exists()


def test_a_safetensors_header_that_lies_about_its_size_is_refused(tmp_path: Path) -> None:
    vdir = save_tiny_mlp(tmp_path)
    (vdir / storage.WEIGHTS).write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(StoreError, match="cannot read safetensors checkpoint"):
        store.load(tmp_path, "tiny")


@pytest.mark.parametrize("name", ["tiny\n", "tiny\x00", "..", ".", "/etc", "tiny/..", "a\\b", "tiny "])
def test_names_with_a_newline_or_path_characters_are_refused(name: str) -> None:
    with pytest.raises(StoreError, match="is invalid"):
        storage.check_name(name)
