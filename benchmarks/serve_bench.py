"""Serving benchmark: throughput and latency against concurrency, beside the in-process ceiling.

For each precision it measures, in one run:
  * the ceiling: the model's own batched forward in-process, through the same Engine code the server uses
    (numpy in, cast, forward, float32 numpy out), in rows/s at each batch size;
  * the HTTP ceiling: wrk against the server's trivial GET /health (what the HTTP stack and the load generator
    manage with no model and no JSON at all);
  * the server with dynamic batching, and with batching off (max_batch_size 1), at each concurrency level, driven by
    wrk (one sample per request), with the server's observed mean batch size, for each protocol asked for:
    ``predict`` (POST /predict, JSON), ``v2-json`` (KServe V2 inference, JSON tensor data) and ``v2-binary`` (KServe
    V2 with the binary tensor extension: JSON header plus raw float32 input, binary output).

Usage (wrk from Debian's package), from the repository root:
    python benchmarks/serve_bench.py --model digits_mlp --precisions bf16,fp32 --out /tmp/serve_bench
    python benchmarks/serve_bench.py --model digits_mlp --precisions fp32,bf16 --protocols predict,v2-json,v2-binary \\
        --duration 5 --out benchmarks/results/serve-throughput-cpu/digits_mlp      # the committed run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import PROTOCOLS, ROOT, Protocol, make_protocol, start_server, stats, write_results, wrk

from halfserve import hostinfo, store
from halfserve.engine.core import Engine
from halfserve.manifest import Precision, load_manifest


def ceiling(store_dir: Path, model: str, precision: str, sizes: list[int], rounds: int = 5) -> dict[str, float]:
    """Rows/s of the in-process batched forward per batch size: the best of ``rounds`` interleaved 0.4 s rounds.

    Best-of and interleaving, because a shared 2-core machine stalls single runs by 2x or more.
    """
    loaded = store.load(store_dir, model)
    engine = Engine(loaded, Precision(precision), torch.device("cpu"))
    shape = tuple(loaded.manifest.inputs[0].shape)
    rng = np.random.default_rng(0)
    inputs = {bs: rng.uniform(0, 1, size=(bs, *shape)).astype(np.float32) for bs in sizes}
    for x in inputs.values():
        for _ in range(10):
            engine.forward(x)
    best = dict.fromkeys(sizes, 0.0)
    for _ in range(rounds):
        for bs, x in inputs.items():
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.4:
                engine.forward(x)
                n += 1
            best[bs] = max(best[bs], n * bs / (time.perf_counter() - start))
    engine.close()
    return {str(bs): v for bs, v in best.items()}


def sweep(
    args: argparse.Namespace, precision: str, batching: bool, protocols: list[Protocol]
) -> list[dict[str, object]]:
    port = args.port
    extra = ["--precision", precision]
    if not batching:
        extra += ["--max-batch-size", "1", "--max-queue-rows", "4096"]
    proc = start_server(args.store, args.model, port, *extra)
    rows: list[dict[str, object]] = []
    try:
        for proto in protocols:
            url = f"http://127.0.0.1:{port}{proto.path}"
            wrk(url, 8, 2, proto.script, proto.body)  # warm the connection pool and allocator
            for c in args.concurrency:
                before = stats(port, args.model)
                result = wrk(url, c, args.duration, proto.script, proto.body)
                after = stats(port, args.model)
                batches = after["batches"] - before["batches"]
                mean_batch = (after["rows"] - before["rows"]) / batches if batches else 0.0
                row = {
                    "precision": precision,
                    "batching": batching,
                    "protocol": proto.name,
                    "concurrency": c,
                    **result,
                    "mean_batch": mean_batch,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        if batching:
            health = wrk(f"http://127.0.0.1:{port}/health", max(args.concurrency), args.duration, None, None)
            rows.append(
                {
                    "precision": precision,
                    "batching": None,
                    "concurrency": max(args.concurrency),
                    "endpoint": "GET /health",
                    **health,
                }
            )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return rows


def table(result: dict[str, object]) -> str:
    lines = [
        "| precision | batching | protocol | concurrency | req/s | p50 ms | p99 ms | mean batch "
        "| / forward ceiling | / HTTP ceiling |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    http = {r["precision"]: r["rps"] for r in result["runs"] if r.get("endpoint")}  # type: ignore[attr-defined]
    ceilings = result["ceiling_rows_per_s"]
    assert isinstance(ceilings, dict)
    for r in result["runs"]:  # type: ignore[attr-defined]
        if r.get("endpoint"):
            continue
        ceil = max(ceilings[r["precision"]].values())
        lines.append(
            f"| {r['precision']} | {'on' if r['batching'] else 'off (max_batch_size 1)'} "
            f"| {r.get('protocol', 'predict')} | {r['concurrency']} "
            f"| {r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_batch']:.1f} "
            f"| {r['rps'] / ceil:.3f} | {r['rps'] / http[r['precision']]:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=ROOT / "model_store")
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--concurrency", default="1,8,32,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    p.add_argument(
        "--protocols",
        default="predict",
        type=lambda s: s.split(","),
        help=f"comma-separated, of {', '.join(PROTOCOLS)} (default: predict)",
    )
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tmp" / "serve_bench")
    args = p.parse_args()
    unknown = [x for x in args.protocols if x not in PROTOCOLS]
    if unknown:
        p.error(f"--protocols: unknown {', '.join(unknown)} (known: {', '.join(PROTOCOLS)})")

    manifest = load_manifest(args.store / args.model)
    shape = manifest.inputs[0].shape
    sample = np.random.default_rng(0).uniform(0, 1, size=shape).round(6)
    tmp = Path(tempfile.mkdtemp())
    protocols = [make_protocol(x, args.model, manifest.inputs[0].name, sample, tmp) for x in args.protocols]

    precisions = args.precisions.split(",")
    sizes = sorted({1, 8, 32, manifest.batching.max_batch_size})
    result: dict[str, object] = {
        "model": args.model,
        "input_shape": shape,
        "max_batch_size": manifest.batching.max_batch_size,
        "max_delay_ms": manifest.batching.max_delay_ms,
        "protocols": args.protocols,
        "machine": {
            **hostinfo.describe(),
            "load_generator": "wrk -t1 (one thread), one sample per request, keep-alive",
        },
        "ceiling_rows_per_s": {},
        "runs": [],
    }
    for prec in precisions:
        result["ceiling_rows_per_s"][prec] = ceiling(args.store, args.model, prec, sizes)  # type: ignore[index]
        print(prec, "ceiling", result["ceiling_rows_per_s"][prec], flush=True)  # type: ignore[index]
        for batching in (True, False):
            result["runs"] += sweep(args, prec, batching, protocols)  # type: ignore[operator]
    md = table(result)
    write_results(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
