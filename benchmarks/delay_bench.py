"""The batching delay: ``max_delay_ms`` values against each other on one model, under wrk, interleaved rounds.

One server per delay, all started first (an idle server costs the others nothing measurable), then per round, per
concurrency, each delay in turn: a 1 s wrk warm-up and a measured wrk run of one sample per request, with the
server's mean batch over the measured run (from ``/models/{m}/stats``). The table gives the median of the rounds.

With one engine instance a batch is cut when the instance is free: ``max_delay_ms`` only decides how long an idle
instance waits for more requests before it starts on those it has (requests that arrive while it is busy wait for it
anyway, and go together into the next batch).

    python benchmarks/delay_bench.py --model digits_mlp --delays 2,0 --concurrency 1,8,32,64 --rounds 3 \
        --out benchmarks/results/batching-delay-cpu/digits_mlp
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np

from server import hostinfo
from server.loadtest.process import free_port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--store", type=Path, default=common.ROOT / "model_store")
    p.add_argument("--delays", default="2,0", help="max_delay_ms values, comma-separated")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--protocol", default="predict", choices=common.PROTOCOLS)
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for every server (repeatable)")
    p.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = p.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]

    servers: dict[float, tuple[int, Any]] = {}
    try:
        for delay in delays:
            port = free_port()
            proc = common.start_server(
                args.store, args.model, port, "--no-grpc", "--max-delay-ms", f"{delay:g}", *args.serve_arg
            )
            servers[delay] = (port, proc)
        port0 = servers[delays[0]][0]
        entry = next(m for m in httpx.get(f"http://127.0.0.1:{port0}/models").json()["models"])
        spec = entry["inputs"][0]
        sample = np.random.default_rng(0).random([int(d) for d in spec["shape"]]).astype(np.float32)
        folder = Path(tempfile.mkdtemp(prefix="delay-bench-"))
        proto = common.make_protocol(args.protocol, args.model, spec["name"], sample, folder, spec["datatype"])
        runs: dict[tuple[float, int], list[dict[str, float]]] = {(d, c): [] for d in delays for c in levels}
        for r in range(args.rounds):
            for c in levels:
                for delay in delays if r % 2 == 0 else delays[::-1]:
                    port = servers[delay][0]
                    url = f"http://127.0.0.1:{port}{proto.path}"
                    common.wrk(url, c, 1.0, proto.script, proto.body)
                    before = common.stats(port, args.model)
                    run = common.wrk(url, c, args.duration, proto.script, proto.body)
                    after = common.stats(port, args.model)
                    batches = after["batches"] - before["batches"]
                    run["mean_batch"] = (after["rows"] - before["rows"]) / batches if batches else 0.0
                    runs[(delay, c)].append(run)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=60)

    rows: list[dict[str, Any]] = []
    for c in levels:
        for delay in delays:
            rs = runs[(delay, c)]
            rows.append(
                {
                    "max_delay_ms": delay,
                    "concurrency": c,
                    **{k: statistics.median(x[k] for x in rs) for k in ("rps", "p50_ms", "p99_ms", "mean_batch")},
                    "errors": sum(int(x["non_2xx"]) for x in rs),
                    "rps_per_round": [round(x["rps"]) for x in rs],
                }
            )
    served = entry.get("precision")
    lines = [
        f"{args.model} ({served}), {args.protocol}, one sample per request, wrk -t1, {args.rounds} interleaved rounds "
        f"of {args.duration:g} s; median of the rounds",
        "",
        "| concurrency | max_delay_ms | req/s | p50 ms | p99 ms | mean batch | req/s per round |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['concurrency']} | {row['max_delay_ms']:g} | {row['rps']:,.0f} | {row['p50_ms']:.2f} "
            f"| {row['p99_ms']:.2f} | {row['mean_batch']:.1f} | {', '.join(map(str, row['rps_per_round']))} |"
        )
    md = "\n".join(lines)
    print(md)
    if args.out is not None:
        result = {
            "model": args.model,
            "precision": served,
            "protocol": args.protocol,
            "serve_args": args.serve_arg,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "rows": rows,
            "machine": hostinfo.describe(),
            "runs": {f"{d:g}@{c}": v for (d, c), v in runs.items()},
        }
        common.write_results(args.out, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
