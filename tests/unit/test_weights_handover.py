"""The weights an instance process gets (halfserve.store.weights_bytes / from_weights_bytes): exactly the module's,
whatever their memory layout or sharing."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from torch import nn

from halfserve import models, store
from halfserve.manifest import Manifest, TensorSpec


def round_trip(root: Path, manifest: Manifest, module: nn.Module) -> nn.Module:
    store.save(root, manifest, module)
    return store.from_weights_bytes(root, manifest, 1, store.weights_bytes(module)).module


def test_channels_last_weights_travel_and_answer_as_before(tmp_path: Path) -> None:
    torch.manual_seed(0)
    kwargs = {"num_classes": 5, "channels_last": True}
    module = models.build("resnet_bench", **kwargs).eval()
    assert any(not p.is_contiguous() for p in module.parameters())  # NHWC convolution weights
    manifest = Manifest(
        name="cnn",
        architecture="resnet_bench",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="image", shape=[3, 32, 32])],
        outputs=[TensorSpec(name="logits", shape=[5])],
    )
    copy = round_trip(tmp_path, manifest, module)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(copy(x), module(x))


def test_tied_weights_travel_as_copies_and_load(tmp_path: Path) -> None:
    kwargs = {"in_features": 4, "hidden": [4], "out_features": 4}
    module = models.build("mlp", **kwargs)
    module.net[0].weight = module.net[-1].weight  # two names, one tensor: safetensors refuses shared storage as is
    manifest = Manifest(
        name="tied",
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="x", shape=[4])],
        outputs=[TensorSpec(name="y", shape=[4])],
    )
    data = store.weights_bytes(module)
    state = dict(load_tensors(data))
    torch.testing.assert_close(state["net.0.weight"], module.net[0].weight.detach())
    copy = store.from_weights_bytes(tmp_path, manifest, 1, data)
    torch.testing.assert_close(copy.module.net[0].weight, module.net[0].weight.detach())
