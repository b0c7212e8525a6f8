"""AOTInductor's compile cache entries (a header of batch sizes, then the packages) and the refusal of a model that
does not export; packages themselves are built and loaded in tests/e2e/test_aoti.py."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from halfserve import aoti
from halfserve.compilecache import CorruptEntry, pack
from halfserve.engine.protocol import EngineError
from halfserve.manifest import Manifest


def test_an_entry_gives_back_its_packages_by_batch_size() -> None:
    packages = {aoti.DYNAMIC: b"dynamic package"}
    assert aoti.from_entry(aoti.to_entry(packages)) == packages
    per_bucket = {4: b"four", 1: b"one", 2: b"two"}
    assert aoti.from_entry(aoti.to_entry(per_bucket)) == per_bucket


@pytest.mark.parametrize(
    ("parts", "problem"),
    [
        ([b"not json", b"package"], "not an AOTInductor entry"),
        ([json.dumps({"batches": [0]}).encode(), b"package"], "not an AOTInductor entry"),
        ([json.dumps({"sizes": ["0"]}).encode(), b"package"], "sizes are not batch sizes"),
        ([json.dumps({"sizes": [-1]}).encode(), b"package"], "sizes are not batch sizes"),
        ([json.dumps({"sizes": [0, 1]}).encode(), b"package"], "names 2 packages and holds 1"),
        ([json.dumps({"sizes": [0] * 2000}).encode(), b"package"], "header too long"),
    ],
)
def test_an_entry_that_is_not_one_of_packages_is_corrupt(parts: list[bytes], problem: str) -> None:
    with pytest.raises(CorruptEntry, match=problem):
        aoti.from_entry(pack(parts))


class Branches(nn.Module):
    """A forward whose path depends on the values of its input: no exported program can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if x.sum() > 0 else -self.linear(x)


def test_a_model_that_does_not_export_is_refused_with_torchs_reason() -> None:
    model = Branches().eval()
    with pytest.raises(EngineError, match=r"execution.compile 'aoti': the model does not export: \w+"):
        aoti.build(model, model.forward, torch.zeros(1, 4), [1, 2])


def manifest(**execution: object) -> dict[str, object]:
    return {
        "name": "m",
        "architecture": "mlp",
        "inputs": [{"name": "a", "shape": [4]}, {"name": "b", "shape": [4]}],
        "outputs": [{"name": "y", "shape": [2]}],
        "execution": {"compile": "aoti", **execution},
    }


def test_a_manifest_asking_aoti_of_a_model_it_cannot_export_is_refused() -> None:
    with pytest.raises(ValidationError, match="execution.compile 'aoti' takes models with one input and one output"):
        Manifest.model_validate(manifest())
    one = {**manifest(pad_to_bucket=False), "inputs": [{"name": "a", "shape": [4]}]}
    with pytest.raises(ValidationError, match="compile 'aoti' runs fixed shapes: it needs pad_to_bucket"):
        Manifest.model_validate(one)
    variable = {**manifest(), "inputs": [{"name": "a", "shape": [-1], "max_length": 8}]}
    with pytest.raises(ValidationError, match="a model with variable dimensions runs eagerly"):
        Manifest.model_validate(variable)
