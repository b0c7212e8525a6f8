"""The benchmark model: the resnet_bench architecture, its generator, and the shipped copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import models, store
from halfserve.engine.core import Engine
from halfserve.loadtest.make_bench_model import main as make_main
from halfserve.loadtest.make_bench_model import make
from halfserve.manifest import Precision
from tests.conftest import SHIPPED_STORE


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_architecture_runs_any_block_kind_and_image_size(block: str) -> None:
    model = models.build("resnet_bench", width=8, blocks=[1, 2], block=block).eval()
    with torch.inference_mode():
        assert model(torch.rand(2, 3, 20, 20)).shape == (2, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"blocks": []}, "blocks"), ({"block": "dense"}, "block"), ({"width": 0}, "width")]
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        models.build("resnet_bench", **kwargs)


def test_generated_model_keeps_channels_last_through_the_store_and_the_engine(tmp_path: Path) -> None:
    vdir = make(tmp_path, width=8, blocks=(1, 1, 1), max_batch_size=8)
    assert vdir == tmp_path / "resnet_bench" / "1"
    loaded = store.load(tmp_path, "resnet_bench")
    manifest = loaded.manifest
    assert manifest.labels is None
    assert "random" in manifest.description.lower()
    assert "throughput tests only" in manifest.description
    assert manifest.inputs[0].shape == [3, 32, 32]
    assert manifest.batching.max_batch_size == 8
    engine = Engine(loaded, Precision.BF16, torch.device("cpu"))
    try:
        conv = next(m for m in engine.model.modules() if isinstance(m, torch.nn.Conv2d))
        assert conv.weight.dtype is torch.bfloat16
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        out = engine.forward(np.random.default_rng(0).uniform(0, 1, (8, 3, 32, 32)).astype(np.float32))
        assert out.shape == (8, 10)
        assert np.isfinite(out).all()
    finally:
        engine.close()


def test_generation_is_reproducible(tmp_path: Path) -> None:
    make(tmp_path / "a", width=8, blocks=(1, 1, 1))
    make(tmp_path / "b", width=8, blocks=(1, 1, 1))
    a = store.load(tmp_path / "a", "resnet_bench").module.state_dict()
    b = store.load(tmp_path / "b", "resnet_bench").module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--store", str(tmp_path), "--name", "tiny_resnet", "--width", "4", "--blocks", "1,1", "--image-size", "16"]
    assert make_main(argv) == 0
    assert "tiny_resnet/1" in capsys.readouterr().out
    assert store.load(tmp_path, "tiny_resnet").manifest.inputs[0].shape == [3, 16, 16]


def test_shipped_bench_model_is_small_and_fp16_safe() -> None:
    loaded = store.load(SHIPPED_STORE, "resnet_bench")
    assert loaded.path.stat().st_size < 5_000_000
    x = np.random.default_rng(0).uniform(0, 1, (8, *loaded.manifest.inputs[0].shape)).astype(np.float32)
    outputs = {}
    for precision in (Precision.FP32, Precision.FP16, Precision.BF16):
        engine = Engine(loaded, precision, torch.device("cpu"))
        try:
            outputs[precision] = engine.forward(x)
        finally:
            engine.close()
    assert all(np.isfinite(o).all() for o in outputs.values())
    # Calibrated BatchNorm keeps activations at a trained network's scale, so half precision stays close.
    assert np.abs(outputs[Precision.FP16] - outputs[Precision.FP32]).max() < 0.05
    assert np.abs(outputs[Precision.BF16] - outputs[Precision.FP32]).max() < 0.2
