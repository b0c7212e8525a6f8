"""The model store: manifests, versions, safe loading."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from halfserve import storage, store
from halfserve.manifest import load_manifest
from halfserve.storage import StoreError
from tests.conftest import save_tiny_mlp


def edit_manifest(root: Path, name: str, **changes: object) -> Path:
    path = root / name / storage.MANIFEST
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def test_saved_model_loads_back_with_identical_weights(tmp_path: Path) -> None:
    vdir = save_tiny_mlp(tmp_path)
    assert vdir == tmp_path / "tiny" / "1"
    assert (vdir / storage.WEIGHTS).is_file()
    loaded = store.load(tmp_path, "tiny")
    torch.manual_seed(0)
    from halfserve import models

    fresh = models.build("mlp", in_features=16, hidden=[32], out_features=4)
    for (k, a), (_, b) in zip(loaded.module.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert loaded.version == 1
    assert loaded.manifest.labels == ["a", "b", "c", "d"]


def test_next_save_gets_the_next_version_and_highest_is_served(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    assert save_tiny_mlp(tmp_path, seed=1).name == "2"
    assert storage.versions(tmp_path / "tiny") == [1, 2]
    assert store.load(tmp_path, "tiny").version == 2
    assert store.load(tmp_path, "tiny", version=1).version == 1


@pytest.mark.parametrize(
    ("changes", "field", "problem"),
    [
        ({"architecture": "resnet9000"}, "architecture", "unknown architecture 'resnet9000'"),
        ({"batching": {"max_batch_size": 0}}, "batching.max_batch_size", "greater than or equal to 1"),
        ({"batching": {"max_batch_size": 64, "max_queue_rows": 8}}, "batching", "max_queue_rows (8)"),
        ({"precision": "fp8"}, "precision", "Input should be"),
        ({"inputs": []}, "inputs", "at least 1 item"),
        ({"inputs": [{"name": "x", "shape": [0]}]}, "inputs.0.shape", "positive integer"),
        ({"inputs": [{"name": "x", "shape": []}]}, "inputs", "'x': shape [] (one value per row) is for outputs"),
        (
            {"outputs": [{"name": "value", "shape": []}]},
            "(top level)",
            "labels name the classes of the first output's last dimension; 'value' has one value per row",
        ),
        ({"labels": ["only", "three", "labels"]}, "(top level)", "labels has 3 entries"),
        ({"unexpected": 1}, "unexpected", "Extra inputs are not permitted"),
        ({"version": 7}, "version", "7 is pinned but not present"),
    ],
)
def test_bad_manifest_names_file_and_field(
    tmp_path: Path, changes: dict[str, object], field: str, problem: str
) -> None:
    save_tiny_mlp(tmp_path)
    path = edit_manifest(tmp_path, "tiny", **changes)
    with pytest.raises(StoreError) as err:
        store.load(tmp_path, "tiny")
    assert str(path) in str(err.value)
    assert f"{field}: " in str(err.value) or field in str(err.value)
    assert problem in str(err.value)


def test_manifest_that_is_not_json_is_named(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    (tmp_path / "tiny" / storage.MANIFEST).write_text("{oops")
    with pytest.raises(StoreError, match="config.json: not valid JSON"):
        load_manifest(tmp_path / "tiny")


def test_checkpoint_that_does_not_fit_the_architecture_is_refused(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    edit_manifest(tmp_path, "tiny", arch_kwargs={"in_features": 16, "hidden": [64], "out_features": 4})
    with pytest.raises(StoreError, match="does not fit architecture 'mlp'"):
        store.load(tmp_path, "tiny")


def test_a_pickle_posing_as_a_checkpoint_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    vdir = save_tiny_mlp(tmp_path)
    (vdir / storage.WEIGHTS).write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(StoreError, match="cannot read safetensors checkpoint"):
        store.load(tmp_path, "tiny")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "x" * 65])
def test_model_names_cannot_escape_the_store(tmp_path: Path, name: str) -> None:
    with pytest.raises(StoreError, match="is invalid"):
        store.load(tmp_path, name)


def test_store_listing_only_counts_folders_with_a_manifest(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "one")
    save_tiny_mlp(tmp_path, "two")
    (tmp_path / "empty").mkdir()
    assert storage.model_names(tmp_path) == ["one", "two"]
    with pytest.raises(StoreError, match="does not exist"):
        storage.model_names(tmp_path / "missing")


@pytest.mark.parametrize("datatype", ["INT8", "UINT16", "UINT64"])
def test_a_manifest_declares_only_the_datatypes_a_model_is_served_in(datatype: str) -> None:
    """One datatype enum serves the wire and the manifest; a request may send INT8, a model may not declare it."""
    from pydantic import ValidationError

    from halfserve.manifest import SERVED_TYPES, DataType, TensorSpec

    assert DataType(datatype) not in SERVED_TYPES
    assert DataType(datatype).wire_dtype.itemsize >= 1  # it crosses the wire
    with pytest.raises(ValidationError, match=f"{datatype} is not a datatype a model may declare; one of FP32"):
        TensorSpec(name="x", datatype=DataType(datatype), shape=[4])
    assert TensorSpec(name="x", datatype=DataType.UINT8, shape=[4]).datatype.numpy == "uint8"


def test_a_checkpoint_whose_parameters_hold_nan_is_refused_naming_the_parameter(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_mlp(tmp_path, seed=0)
    vdir = save_tiny_mlp(tmp_path, seed=1)
    weights = load_file(vdir / storage.WEIGHTS)
    name = next(k for k in weights if k.endswith("weight"))
    weights[name][0, 0] = float("nan")  # one value is enough: it reaches every row it feeds
    save_file(weights, vdir / storage.WEIGHTS)
    with pytest.raises(
        StoreError, match=rf"parameter '{name}' holds NaN or infinite values: the checkpoint is damaged"
    ):
        store.load(tmp_path, "tiny")
    assert store.load(tmp_path, "tiny", 1).version == 1  # the version before it loads
    weights[name][0, 0] = float("inf")
    save_file(weights, vdir / storage.WEIGHTS)
    with pytest.raises(StoreError, match="holds NaN or infinite values"):
        store.load(tmp_path, "tiny")


def test_a_buffer_may_hold_an_infinity_by_design() -> None:
    module = torch.nn.Linear(2, 2)
    module.register_buffer("mask", torch.tensor([0.0, -float("inf")]))  # as an attention mask does
    assert store.nonfinite_parameter(module) is None
    assert store.nonfinite_buffer(module) is None
    with torch.no_grad():
        module.bias[1] = float("nan")
    assert store.nonfinite_parameter(module) == "bias"
    module.mask[0] = float("nan")  # no design puts a NaN in a buffer
    assert store.nonfinite_buffer(module) == "mask"


@pytest.mark.parametrize(
    ("buffer", "value"),
    [("features.1.running_var", float("nan")), ("features.4.running_mean", float("inf"))],
    ids=["nan-variance", "infinite-mean"],
)
def test_a_checkpoint_whose_running_statistics_are_not_finite_is_refused_naming_the_buffer(
    tmp_path: Path, buffer: str, value: float
) -> None:
    """A BatchNorm's statistics from a diverged run: every answer would be NaN, as with a NaN weight."""
    from safetensors.torch import load_file, save_file

    from halfserve import models
    from halfserve.manifest import Manifest, TensorSpec

    manifest = Manifest(
        name="cnn",
        architecture="small_cnn",
        arch_kwargs={"width": 4},
        inputs=[TensorSpec(name="image", shape=[1, 8, 8])],
        outputs=[TensorSpec(name="logits", shape=[10])],
    )
    vdir = store.save(tmp_path, manifest, models.build("small_cnn", width=4))
    weights = load_file(vdir / storage.WEIGHTS)
    weights[buffer][0] = value
    save_file(weights, vdir / storage.WEIGHTS)
    with pytest.raises(StoreError) as caught:
        store.load(tmp_path, "cnn")
    assert str(caught.value) == (
        f"{vdir / storage.WEIGHTS}: buffer {buffer!r} holds NaN or infinite values: the checkpoint is damaged (a "
        "training run that diverged?), and every answer would be NaN"
    )
