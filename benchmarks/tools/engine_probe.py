"""Probe: the engine and batcher without HTTP, UINT8 ResNet-50 images, CUDA graphs.

1. Instances driven back to back from their own threads at a fixed batch (what the device gives at that batch);
2. a closed loop of C in-process clients, one image each, through the server's Batcher and Engine (what the
   batching schedule gives without HTTP; ``closed_loop.py``, which gpu_bench.py runs per level too), with the mean
   batch and the mean runner time per batch.

Run from the repository root with ``benchmarks`` on ``PYTHONPATH`` (for ``common`` and ``gpu_bench``):
``PYTHONPATH=benchmarks python benchmarks/tools/engine_probe.py``. Env: ``OUT`` (default /tmp/out; writes
``engine_probe.json`` there), ``STORE``, ``IMAGE``, ``MAX_BATCH``, ``SECONDS``, ``DEVICE``, ``PRECISION``.
"""

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import gpu_bench
import numpy as np
import torch
from closed_loop import closed_loop

from halfserve import store
from halfserve.compilation import tune_cudnn
from halfserve.engine.core import Engine
from halfserve.execution import Compile, Execution
from halfserve.manifest import Precision

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
store_dir = Path(os.environ.get("STORE", "/tmp/probe_store"))
IMAGE = int(os.environ.get("IMAGE", "224"))
MAX_BATCH = int(os.environ.get("MAX_BATCH", "64"))
SECONDS = float(os.environ.get("SECONDS", "4"))
results: list[dict[str, object]] = []


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)
    results.append(row)


if not (store_dir / "resnet50").exists():
    gpu_bench.build_store(store_dir, IMAGE, 128, Execution())
gpu_bench.set_manifest(store_dir, Execution(), "uint8")
loaded = store.load(store_dir, "resnet50")
device = torch.device(os.environ.get("DEVICE", "cuda"))
tune_cudnn(device, fixed_shapes=True)  # its engines pad to buckets, as the server's lifespan would set


def engine_for(instances: int) -> Engine:
    ex = Execution(instances=instances, compile=Compile.CUDA_GRAPHS, pad_to_bucket=True)
    engine = Engine(loaded, Precision(os.environ.get("PRECISION", "fp16")), device, execution=ex)
    engine.warmup(MAX_BATCH)
    return engine


for n in (1, 2):
    engine = engine_for(n)
    for b in (16, 32, 64):
        # Not gpu_bench.instances_rate, which builds its own engine: this one's graphs are captured once.
        x = np.random.default_rng(0).integers(0, 256, (b, *engine.sample_shape), dtype=np.uint8)
        done = [0] * n
        stop = threading.Event()

        def drive(
            i: int, x: np.ndarray = x, done: list[int] = done, stop: threading.Event = stop, engine: Engine = engine
        ) -> None:
            inst = engine.instances[i]
            while not stop.is_set():
                inst.executor.submit(engine.run_batch, [x], inst).result()
                done[i] += 1

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        base, start = sum(done), time.perf_counter()
        time.sleep(SECONDS)
        total, elapsed = sum(done) - base, time.perf_counter() - start
        stop.set()
        for t in threads:
            t.join()
        emit({"probe": "instances", "instances": n, "batch": b, "rows_per_s": round(total * b / elapsed, 1)})
    for conc in (32, 64, 128, 256):
        for delay_ms in (0.0, 2.0):
            r = asyncio.run(closed_loop(engine, conc, SECONDS, max_batch_size=MAX_BATCH, max_delay=delay_ms / 1000))
            emit({"probe": "closed_loop", "instances": n, "c": conc, "max_delay_ms": delay_ms, **r})
    engine.close()
    torch.cuda.empty_cache()

(OUT / "engine_probe.json").write_text(json.dumps(results, indent=1))
