"""TorchInductor against eager forwards, in-process through the server's Engine, per model, precision and batch size.

For each model and precision it builds two engines from the same store entry, one eager and one with
``execution.compile: "inductor"`` (compiled at warm-up, one shape per batch size asked for), reports the compile
time, then measures rows/s of both (numpy in, prepared, forward, float32 numpy out: what a batch costs the server)
in interleaved rounds, best of each, and the largest output difference between them.

    python benchmarks/inductor_bench.py --models resnet_bench,digits_mlp --out benchmarks/results/inductor-cpu/inductor

The allocator matters on a CPU (glibc malloc page-faults fresh pages in for every large activation; inductor plans
its buffers): it is in the results' ``machine`` (``LD_PRELOAD=.../libjemalloc.so.2`` to compare).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import ROOT, write_results

from halfserve import hostinfo, store
from halfserve.engine.core import Engine
from halfserve.execution import Compile, Execution
from halfserve.manifest import Precision


def rate(engine: Engine, x: np.ndarray, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        engine.forward(x)
        n += 1
    return n * len(x) / (time.perf_counter() - start)


def compare(
    loaded: store.LoadedModel, precision: Precision, sizes: list[int], rounds: int, seconds: float
) -> dict[str, Any]:
    cpu = torch.device("cpu")
    eager = Engine(loaded, precision, cpu, execution=Execution(pad_to_bucket=True, batch_buckets=sizes))
    eager.warmup(max(sizes))
    compiled = Engine(loaded, precision, cpu, execution=Execution(compile=Compile.INDUCTOR, batch_buckets=sizes))
    compiled.warmup(max(sizes))
    rng = np.random.default_rng(0)
    dtype = eager.input_dtype
    shape = (max(sizes), *eager.sample_shape)
    data = rng.integers(0, 256, shape) if dtype == np.uint8 else rng.uniform(0, 1, shape)
    inputs = {bs: np.ascontiguousarray(data[:bs]).astype(dtype) for bs in sizes}
    best = {name: dict.fromkeys(map(str, sizes), 0.0) for name in ("eager", "inductor")}
    for _ in range(rounds):
        for bs, x in inputs.items():
            for name, engine in (("eager", eager), ("inductor", compiled)):
                best[name][str(bs)] = max(best[name][str(bs)], rate(engine, x, seconds))
    x = inputs[max(sizes)]
    diff = float(np.abs(eager.forward(x) - compiled.forward(x)).max())
    result = {
        "precision": precision.value,
        "compile_seconds": compiled.info.inductor_compile_seconds,
        "rows_per_s": best,
        "inductor_over_eager": {k: best["inductor"][k] / best["eager"][k] for k in best["eager"]},
        "max_abs_output_difference": diff,
    }
    eager.close()
    compiled.close()
    return result


def markdown(result: dict[str, Any]) -> str:
    sizes = result["batch_sizes"]
    head = " | ".join(f"batch {s} eager / inductor" for s in sizes)
    lines = [
        f"| model | precision | compile s | {head} | max abs diff |",
        "|---|---|---:|" + "---:|" * len(sizes) + "---:|",
    ]
    for run in result["runs"]:
        r = run["rows_per_s"]
        cells = " | ".join(
            f"{r['eager'][str(s)]:,.0f} / {r['inductor'][str(s)]:,.0f} ({run['inductor_over_eager'][str(s)]:.2f}x)"
            for s in sizes
        )
        lines.append(
            f"| {run['model']} | {run['precision']} | {run['compile_seconds']:.1f} | {cells} | "
            f"{run['max_abs_output_difference']:.1e} |"
        )
    m = result["machine"]
    lines.append(
        f"\nrows/s, best of {result['rounds']} interleaved rounds of {result['seconds']:g} s; {m['cpu']} "
        f"({m['cores']} cores, {m['cpu_capability']}, native bf16 {m['native_bf16']}), {m['allocator']}, "
        f"torch {m['torch']} with {m['torch_threads']} threads."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=ROOT / "model_store")
    p.add_argument("--models", default="resnet_bench,digits_mlp")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--batch-sizes", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    p.add_argument("--out", type=Path, help="path prefix for .json and .md")
    args = p.parse_args()
    result: dict[str, Any] = {
        "machine": hostinfo.describe(),
        "batch_sizes": args.batch_sizes,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "runs": [],
    }
    for model in args.models.split(","):
        loaded = store.load(args.store, model)
        for precision in args.precisions.split(","):
            run = {"model": model, **compare(loaded, Precision(precision), args.batch_sizes, args.rounds, args.seconds)}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    md = markdown(result)
    print(md)
    if args.out is not None:
        write_results(args.out, result, md)


if __name__ == "__main__":
    main()
