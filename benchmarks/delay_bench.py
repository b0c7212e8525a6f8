"""The batching delay: server options for it against each other on one model, under wrk, interleaved rounds.

One server per variant (its ``halfserve serve`` options, e.g. ``--max-delay-ms 0``), all started first (an idle
server costs the others nothing measurable), then per round, per concurrency, each variant in turn: a 1 s wrk warm-up
and a measured wrk run of one sample per request, with the server's mean batch over the measured run (from
``/models/{m}/stats``). The table gives the median of the rounds.

With one engine instance a batch is cut when the instance is free: ``max_delay_ms`` only decides how long an idle
instance waits for more requests before it starts on those it has (requests that arrive while it is busy wait for it
anyway, and go together into the next batch).

    python benchmarks/delay_bench.py --model digits_mlp --concurrency 1,8,32,64 --rounds 3 \
        --variants="--max-delay-ms 2 --no-adaptive-delay" --variants="--max-delay-ms 0" \
        --variants="--max-delay-ms 2 --adaptive-delay" --out benchmarks/results/batching-delay-cpu/digits_mlp
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

from halfserve import hostinfo
from halfserve.loadtest.process import free_port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--store", type=Path, default=common.ROOT / "model_store")
    p.add_argument("--variants", action="append", help="the servers' options, one server each (repeatable)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--protocol", default="predict", choices=common.PROTOCOLS)
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for every server (repeatable)")
    p.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = p.parse_args()
    variants: list[str] = args.variants or ["--max-delay-ms 2 --no-adaptive-delay", "--max-delay-ms 0"]
    levels = [int(c) for c in args.concurrency.split(",")]

    servers: dict[str, tuple[int, Any]] = {}
    try:
        for variant in variants:
            port = free_port()
            proc = common.start_server(args.store, args.model, port, "--no-grpc", *variant.split(), *args.serve_arg)
            servers[variant] = (port, proc)
        port0 = servers[variants[0]][0]
        entry = next(m for m in httpx.get(f"http://127.0.0.1:{port0}/models").json()["models"])
        spec = entry["inputs"][0]
        sample = np.random.default_rng(0).random([int(d) for d in spec["shape"]]).astype(np.float32)
        folder = Path(tempfile.mkdtemp(prefix="delay-bench-"))
        proto = common.make_protocol(args.protocol, args.model, spec["name"], sample, folder, spec["datatype"])
        runs: dict[tuple[str, int], list[dict[str, float]]] = {(d, c): [] for d in variants for c in levels}
        for r in range(args.rounds):
            for c in levels:
                for variant in variants if r % 2 == 0 else variants[::-1]:
                    port = servers[variant][0]
                    url = f"http://127.0.0.1:{port}{proto.path}"
                    common.wrk(url, c, 1.0, proto.script, proto.body)
                    before = common.stats(port, args.model)
                    run = common.wrk(url, c, args.duration, proto.script, proto.body)
                    after = common.stats(port, args.model)
                    batches = after["batches"] - before["batches"]
                    run["mean_batch"] = (after["rows"] - before["rows"]) / batches if batches else 0.0
                    runs[(variant, c)].append(run)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=60)

    rows: list[dict[str, Any]] = []
    for c in levels:
        for variant in variants:
            rs = runs[(variant, c)]
            rows.append(
                {
                    "variant": variant,
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
        "| concurrency | server options | req/s | p50 ms | p99 ms | mean batch | req/s per round |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['concurrency']} | `{row['variant']}` | {row['rps']:,.0f} | {row['p50_ms']:.2f} "
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
            "runs": {f"{d} @ c={c}": v for (d, c), v in runs.items()},
        }
        common.write_results(args.out, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
