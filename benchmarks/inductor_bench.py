"""TorchInductor against eager forwards, in-process through the server's Engine, per model, precision and batch size.

For each model and precision it builds engines from the same store entry, one eager and one per compiled mode of
``--compile`` (``inductor``: ``torch.compile`` at warm-up, one shape per batch size asked for; ``aoti``: an
AOTInductor package, batch dimension dynamic, built at warm-up with no compile cache), reports the compile
time, then measures rows/s of both (numpy in, prepared, forward, float32 numpy out: what a batch costs the server)
in interleaved rounds, best of each, and the largest output difference between them.

    python benchmarks/inductor_bench.py --models resnet_bench,digits_mlp --out benchmarks/results/inductor-cpu/inductor
    python benchmarks/inductor_bench.py --compile inductor,aoti --batch-sizes 1,64 \
        --out benchmarks/results/aoti-cpu/forward

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
    loaded: store.LoadedModel,
    precision: Precision,
    sizes: list[int],
    rounds: int,
    seconds: float,
    modes: list[Compile],
    device: torch.device,
) -> dict[str, Any]:
    eager = Engine(loaded, precision, device, execution=Execution(pad_to_bucket=True, batch_buckets=sizes))
    eager.warmup(max(sizes))
    engines = {"eager": eager}
    for mode in modes:
        engines[mode.value] = Engine(loaded, precision, device, execution=Execution(compile=mode, batch_buckets=sizes))
        engines[mode.value].warmup(max(sizes))
    rng = np.random.default_rng(0)
    dtype = eager.input_dtype
    shape = (max(sizes), *eager.sample_shape)
    data = rng.integers(0, 256, shape) if dtype == np.uint8 else rng.uniform(0, 1, shape)
    inputs = {bs: np.ascontiguousarray(data[:bs]).astype(dtype) for bs in sizes}
    best = {name: dict.fromkeys(map(str, sizes), 0.0) for name in engines}
    for _ in range(rounds):
        for bs, x in inputs.items():
            for name, engine in engines.items():
                best[name][str(bs)] = max(best[name][str(bs)], rate(engine, x, seconds))
    x = inputs[max(sizes)]
    reference = eager.forward(x)
    compiled = {m.value: engines[m.value] for m in modes}
    result = {
        "precision": precision.value,
        "compile_seconds": {m: e.info.inductor_compile_seconds for m, e in compiled.items()},
        "rows_per_s": best,
        "over_eager": {m: {k: best[m][k] / best["eager"][k] for k in best["eager"]} for m in compiled},
        "max_abs_output_difference": {m: float(np.abs(reference - e.forward(x)).max()) for m, e in compiled.items()},
    }
    for engine in engines.values():
        engine.close()
    return result


def markdown(result: dict[str, Any]) -> str:
    sizes, modes = result["batch_sizes"], result["modes"]
    names = " / ".join(["eager", *modes])
    head = " | ".join(f"batch {s} {names}" for s in sizes)
    lines = [
        f"| model | precision | compile s ({', '.join(modes)}) | {head} | max abs diff |",
        "|---|---|---:|" + "---:|" * len(sizes) + "---:|",
    ]
    for run in result["runs"]:
        r = run["rows_per_s"]
        cells = " | ".join(
            " / ".join(f"{r[n][str(s)]:,.0f}" for n in ["eager", *modes])
            + " ("
            + ", ".join(f"{run['over_eager'][m][str(s)]:.2f}x" for m in modes)
            + ")"
            for s in sizes
        )
        compile_s = ", ".join(f"{run['compile_seconds'][m]:.1f}" for m in modes)
        diffs = ", ".join(f"{run['max_abs_output_difference'][m]:.1e}" for m in modes)
        lines.append(f"| {run['model']} | {run['precision']} | {compile_s} | {cells} | {diffs} |")
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
    p.add_argument("--device", default="cpu", type=torch.device)
    p.add_argument("--compile", default="inductor", help="compiled modes to measure against eager: inductor,aoti")
    p.add_argument("--out", type=Path, help="path prefix for .json and .md")
    args = p.parse_args()
    modes = [Compile(m) for m in args.compile.split(",")]
    result: dict[str, Any] = {
        "machine": hostinfo.describe(),
        "modes": [m.value for m in modes],
        "batch_sizes": args.batch_sizes,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "runs": [],
    }
    for model in args.models.split(","):
        loaded = store.load(args.store, model)
        for precision in args.precisions.split(","):
            measured = compare(
                loaded, Precision(precision), args.batch_sizes, args.rounds, args.seconds, modes, args.device
            )
            run = {"model": model, **measured}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    md = markdown(result)
    print(md)
    if args.out is not None:
        write_results(args.out, result, md)


if __name__ == "__main__":
    main()
