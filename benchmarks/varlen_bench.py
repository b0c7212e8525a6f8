"""Variable-length workload: a transformer encoder classifier served with requests of lengths drawn from a range.

For each precision and for length grouping on and off (``batching.group_lengths``) it measures, in one run:

  * the in-process ceiling: rows/s of ``Engine.run_batch`` on batches of ``--batch`` rows of random lengths from the
    same range (padded as the server pads them), with its padding waste;
  * the server at each concurrency: an asyncio httpx client (one keep-alive connection per virtual user, one request
    of one sequence in flight each, V2 JSON) for ``--duration`` seconds: req/s, p50/p99 latency, the server's mean
    batch and its padding waste (padded values / real values, from ``/models/seq/stats``).

The model is ``transformer_classifier`` (2 layers, width 64, random weights) built in a temp store:

    python benchmarks/varlen_bench.py --out benchmarks/results/varlen-cpu/varlen
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np
import torch

from halfserve import hostinfo, models, packing, store
from halfserve.engine.core import Engine
from halfserve.execution import Batching
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec

MODEL = "seq"
VOCAB = 1000


def build_store(root: Path, max_length: int, group: bool, max_batch: int) -> store.LoadedModel:
    kwargs = {"vocab": VOCAB, "classes": 10, "dim": 64, "heads": 4, "layers": 2, "max_length": max_length}
    manifest = Manifest(
        name=MODEL,
        architecture="transformer_classifier",
        arch_kwargs=kwargs,
        inputs=[
            TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=max_length),
            TensorSpec(name="mask", datatype=DataType.INT64, shape=[-1], mask_for="tokens"),
        ],
        outputs=[TensorSpec(name="logits", shape=[10])],
        batching=Batching(max_batch_size=max_batch, max_delay_ms=2.0, group_lengths=group),
    )
    torch.manual_seed(0)
    store.save(root, manifest, models.build("transformer_classifier", **kwargs), version=1)
    return store.load(root, MODEL)


def ceiling(
    loaded: store.LoadedModel, precision: str, lengths: tuple[int, int], batch: int, seconds: float
) -> dict[str, float]:
    engine = Engine(loaded, Precision(precision), torch.device("cpu"))
    rng = np.random.default_rng(0)

    def one() -> list[np.ndarray]:
        return [
            packing.pack(loaded.manifest, {"tokens": rng.integers(1, VOCAB, (1, int(n)))})
            for n in rng.integers(lengths[0], lengths[1] + 1, batch)
        ]

    batches = [one() for _ in range(8)]
    for b in batches[:2]:
        engine.run_batch(b)
    engine.real_elements = engine.padded_elements = 0
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 4:
        engine.run_batch(batches[n % len(batches)])
        n += 1
    elapsed = time.perf_counter() - start
    waste = engine.padded_elements / max(engine.real_elements, 1)
    engine.close()
    return {"rows_per_s": n * batch / elapsed, "padding_waste": waste}


async def load(url: str, concurrency: int, lengths: tuple[int, int], duration: float) -> dict[str, Any]:
    rng = np.random.default_rng(concurrency)
    bodies = []
    for n in rng.integers(lengths[0], lengths[1] + 1, 256):
        ids = rng.integers(1, VOCAB, int(n)).tolist()
        bodies.append({"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, int(n)], "data": ids}]})
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + duration

    async def user(i: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(timeout=30) as client:
            k = i
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = await client.post(url, json=bodies[k % len(bodies)])
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
                k += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "errors": errors,
        "req_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
    }


def served(port: int) -> dict[str, float]:
    s = httpx.get(f"http://127.0.0.1:{port}/models/{MODEL}/stats").json()
    return {k: s.get(k, 0) for k in ("rows", "batches", "real_elements", "padded_elements")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--min-length", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--batch", type=int, default=16, help="rows per in-process batch")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lengths = (args.min_length, args.max_length)
    levels = [int(c) for c in args.concurrency.split(",")]
    result: dict[str, Any] = {
        "model": "transformer_classifier (2 layers, width 64, vocab 1000, random weights)",
        "lengths": list(lengths),
        "machine": hostinfo.describe(),
        "duration_s": args.duration,
        "runs": [],
    }
    rows_md = []
    for group in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            loaded = build_store(Path(tmp), args.max_length, group, args.max_batch_size)
            for precision in args.precisions.split(","):
                ceil = ceiling(loaded, precision, lengths, args.batch, seconds=3.0)
                proc = common.start_server(Path(tmp), MODEL, args.port, "--precision", precision)
                try:
                    url = f"http://127.0.0.1:{args.port}/v2/models/{MODEL}/infer"
                    for c in levels:
                        before = served(args.port)
                        run = asyncio.run(load(url, c, lengths, args.duration))
                        after = served(args.port)
                        delta = {k: after[k] - before[k] for k in after}
                        run |= {
                            "precision": precision,
                            "group_lengths": group,
                            "concurrency": c,
                            "mean_batch": delta["rows"] / max(delta["batches"], 1),
                            "padding_waste": delta["padded_elements"] / max(delta["real_elements"], 1),
                            "ceiling_rows_per_s": ceil["rows_per_s"],
                            "ceiling_padding_waste": ceil["padding_waste"],
                        }
                        result["runs"].append(run)
                        print(run, flush=True)
                        rows_md.append(
                            f"| {precision} | {'on' if group else 'off'} | {c} | {run['req_per_s']:.0f} | "
                            f"{run['p50_ms']:.1f} | {run['p99_ms']:.1f} | {run['mean_batch']:.1f} | "
                            f"{run['padding_waste']:.2f} | {ceil['rows_per_s']:.0f} | {ceil['padding_waste']:.2f} |"
                        )
                finally:
                    proc.terminate()
                    proc.wait()
    m = result["machine"]
    md = "\n".join(
        [
            f"# Variable-length workload: {result['model']}, lengths {lengths[0]}..{lengths[1]}",
            "",
            f"{m.get('cpu')} ({m.get('cores')} cores, native bf16: {m.get('native_bf16')}); torch {m.get('torch')}; "
            f"allocator {m.get('allocator')}; client: asyncio httpx on the same host, V2 JSON, one sequence per "
            f"request; {args.duration:.0f} s per level. The in-process batches mix lengths (as with groups off).",
            "",
            "| precision | length groups | concurrency | req/s | p50 ms | p99 ms | mean batch | padding waste | "
            f"in-process rows/s (batch {args.batch}) | in-process padding waste |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows_md,
        ]
    )
    print(md)
    if args.out:
        common.write_results(args.out, result, md)
        plot(result, args.out.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for precision in sorted({r["precision"] for r in result["runs"]}):
        for group in (True, False):
            runs = [r for r in result["runs"] if r["precision"] == precision and r["group_lengths"] is group]
            label = f"{precision}, length groups {'on' if group else 'off'}"
            style = "-" if group else "--"
            left.plot([r["concurrency"] for r in runs], [r["req_per_s"] for r in runs], style, marker="o", label=label)
            right.plot(
                [r["concurrency"] for r in runs], [r["padding_waste"] for r in runs], style, marker="o", label=label
            )
    left.set(xlabel="concurrency", ylabel="req/s", xscale="log", title="throughput")
    right.set(xlabel="concurrency", ylabel="padded / real values", xscale="log", title="padding waste")
    left.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, lengths {result['lengths'][0]}..{result['lengths'][1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
