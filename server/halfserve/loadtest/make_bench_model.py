"""Write the benchmark model ``resnet_bench`` into a model store: a CIFAR-style ResNet with random weights.

    python -m halfserve.loadtest.make_bench_model                      # model_store/resnet_bench/1, the shipped one
    python -m halfserve.loadtest.make_bench_model --width 64 --blocks 3,4,6 --block bottleneck --image-size 64 \\
        --name resnet_gpu --max-batch-size 256                       # a heavier variant for a GPU

The weights are random (fixed seed) and BatchNorm's running statistics are calibrated on random inputs in [0, 1),
so activations keep a trained network's scale (no fp16 overflow from an uncalibrated stack of residual sums). Its
predictions mean nothing: it exists so that throughput tests have a model whose forward is real compute.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from halfserve import models, storage, store
from halfserve.execution import Batching
from halfserve.manifest import Manifest, Precision, TensorSpec

NAME = "resnet_bench"
CALIBRATION_BATCHES = 8
CALIBRATION_BATCH_SIZE = 32


def build_manifest(
    name: str,
    *,
    in_channels: int,
    num_classes: int,
    width: int,
    blocks: Sequence[int],
    block: str,
    image_size: int,
    max_batch_size: int,
    seed: int,
) -> Manifest:
    """The manifest of a ``resnet_bench`` model: signature, batching, and a description saying what it is."""
    depth = sum(blocks) * (2 if block == "basic" else 3) + 2
    shape = [in_channels, image_size, image_size]
    arch_kwargs = {
        "in_channels": in_channels,
        "num_classes": num_classes,
        "width": width,
        "blocks": list(blocks),
        "block": block,
        "channels_last": True,
    }
    return Manifest(
        name=name,
        architecture=NAME,
        arch_kwargs=arch_kwargs,
        inputs=[TensorSpec(name="image", shape=shape)],
        outputs=[TensorSpec(name="logits", shape=[num_classes])],
        labels=None,
        precision=Precision.AUTO,
        batching=Batching(max_batch_size=max_batch_size, max_delay_ms=2.0, max_queue_rows=max(4096, max_batch_size)),
        description=(
            f"Random weights (seed {seed}), for throughput tests only: its outputs mean nothing. A CIFAR-style "
            f"ResNet-{depth} ({block} blocks {list(blocks)}, width {width}, channels_last) taking {shape} float "
            f"images in [0, 1) and returning {num_classes} logits. "
            "Regenerate with: python -m halfserve.loadtest.make_bench_model"
        ),
    )


def calibrate(module: nn.Module, input_shape: Sequence[int], seed: int) -> None:
    """Set BatchNorm running statistics from random inputs (a cumulative average over a few batches)."""
    gen = torch.Generator().manual_seed(seed + 1)
    bns = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    module.train()
    with torch.no_grad():
        for _ in range(CALIBRATION_BATCHES):
            module(torch.rand((CALIBRATION_BATCH_SIZE, *input_shape), generator=gen))
    for bn in bns:
        bn.momentum = 0.1
    module.eval()


def make(
    root: Path,
    *,
    name: str = NAME,
    width: int = 32,
    blocks: Sequence[int] = (3, 3, 3),
    block: str = "basic",
    image_size: int = 32,
    in_channels: int = 3,
    num_classes: int = 10,
    max_batch_size: int = 32,
    seed: int = 0,
    version: int = 1,
) -> Path:
    """Build, calibrate and save the model as ``<root>/<name>/<version>``; returns the version folder."""
    manifest = build_manifest(
        name,
        in_channels=in_channels,
        num_classes=num_classes,
        width=width,
        blocks=blocks,
        block=block,
        image_size=image_size,
        max_batch_size=max_batch_size,
        seed=seed,
    )
    threads = torch.get_num_threads()
    # One thread: the same seed gives the same running statistics whatever the machine's core count.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        module = models.build(NAME, **manifest.arch_kwargs)
        calibrate(module, manifest.inputs[0].shape, seed)
    finally:
        torch.set_num_threads(threads)
    return store.save(root, manifest, module, version=version)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m halfserve.loadtest.make_bench_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", type=Path, default=Path("model_store"), help="model store (default: %(default)s)")
    parser.add_argument("--name", default=NAME, help="model name (default: %(default)s)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage (default: %(default)s)")
    parser.add_argument(
        "--blocks",
        default="3,3,3",
        type=lambda s: [int(x) for x in s.split(",")],
        help="blocks per stage (default: 3,3,3, ResNet-20)",
    )
    parser.add_argument("--block", choices=["basic", "bottleneck"], default="basic")
    parser.add_argument("--image-size", type=int, default=32, help="square input side (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="manifest batching (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--version", type=int, default=1, help="version folder to (over)write (default: 1)")
    args = parser.parse_args(argv)
    try:
        vdir = make(
            args.store,
            name=args.name,
            width=args.width,
            blocks=args.blocks,
            block=args.block,
            image_size=args.image_size,
            max_batch_size=args.max_batch_size,
            seed=args.seed,
            version=args.version,
        )
    except (storage.StoreError, ValueError) as e:
        print(f"make_bench_model: error: {e}", file=sys.stderr)
        return 2
    size = (vdir / storage.WEIGHTS).stat().st_size
    print(f"wrote {vdir} ({size / 1e6:.2f} MB of fp32 weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
