"""The peer gpu_bench.py measures beside halfserve: the same model from the same store served by NVIDIA PyTriton
(Triton Inference Server's C++ HTTP/gRPC front end and dynamic batcher; the model a Python callable).

Run by ``gpu_bench.py --peer pytriton`` under the interpreter of a virtual environment holding ``nvidia-pytriton``
(``--pytriton-python``), with this tree's ``server/`` on ``PYTHONPATH`` and torch, safetensors and pydantic
importable (a ``.pth`` file naming the project's site-packages): the weights come through ``halfserve.store``
(safetensors, nothing unpickled). A fair configuration: as many model instances as halfserve's engine instances,
the same maximum batch and queue delay, UINT8 images normalised on the device by halfserve's own code,
channels_last and cudnn.benchmark on CUDA, and every batch size from 1 to the maximum run once before serving (each
new shape is tuned on first use, as halfserve's warm-up tunes its buckets).

    python benchmarks/pytriton_peer.py --store STORE --model resnet50 --precision fp16 --device cuda --port 8105
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from halfserve import store
from halfserve.engine.inputs import Normalizer

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--precision", choices=list(DTYPES), default="fp16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=8105, help="HTTP; gRPC on the next port, metrics on the one after")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=None, help="default: the manifest's (every size is warmed)")
    args = p.parse_args()

    loaded = store.load(args.store, args.model)
    manifest = loaded.manifest
    device, dtype = torch.device(args.device), DTYPES[args.precision]
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda
    layout = torch.channels_last if cuda else torch.contiguous_format
    module = loaded.module.eval().to(device=device, dtype=dtype, memory_format=layout)
    spec, out_spec = manifest.inputs[0], manifest.outputs[0]
    # halfserve's own normalisation (one fused multiply-add in fp32 on the device): the same work, the same answers.
    normalize = Normalizer(manifest.normalize, len(spec.shape), device) if manifest.normalize else None

    def forward(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            t = torch.from_numpy(x).to(device, non_blocking=True)
            t = normalize(t) if normalize else t
            y = module(t.to(dtype).contiguous(memory_format=layout))
            return y.float().cpu().numpy()

    wire = np.dtype(spec.datatype.numpy)
    max_batch = args.max_batch_size or manifest.batching.max_batch_size
    began = time.perf_counter()
    for size in range(1, max_batch + 1):
        forward(np.zeros((size, *spec.shape), dtype=wire))
    print(f"warmed batch sizes 1-{max_batch} in {time.perf_counter() - began:.1f}s", flush=True)

    def instance() -> Any:
        @batch  # type: ignore[misc]
        def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
            return {out_spec.name: forward(inputs[spec.name])}

        return infer

    config = TritonConfig(  # loopback only, as the halfserve servers it is measured beside
        http_address="127.0.0.1",
        http_port=args.port,
        grpc_address="127.0.0.1",
        grpc_port=args.port + 1,
        metrics_address="127.0.0.1",
        metrics_port=args.port + 2,
        log_verbose=0,
    )
    delay_us = int(manifest.batching.max_delay_ms * 1000)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=args.model,
            infer_func=[instance() for _ in range(args.instances)],
            inputs=[Tensor(name=spec.name, dtype=wire.type, shape=tuple(spec.shape))],
            outputs=[Tensor(name=out_spec.name, dtype=np.float32, shape=tuple(out_spec.shape))],
            config=ModelConfig(
                max_batch_size=max_batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us),
            ),
            strict=True,
        )
        triton.serve()


if __name__ == "__main__":
    main()
