"""gRPC against V2 binary over HTTP: one server, the same model, the same concurrency levels, interleaved rounds.

One ``halfserve serve`` answers both protocols (HTTP on one port, gRPC on another, the same batcher behind them).
Each round runs ``halfserve loadtest --url`` once per protocol (alternating which goes first), over the same levels,
with the load test's own client (one connection per virtual user for both: an httpx client, or a gRPC channel). Per
protocol and level, the table gives the median of the rounds' req/s, p50/p99 and the client's CPU per request (the
client shares the machine's cores with the server: what it spends, the server cannot), and gRPC / HTTP req/s per
round. The server's own CPU per request, per protocol over all levels, is read from /proc around each run.

    python benchmarks/grpc_bench.py --model digits_mlp --concurrency 1,8,32,64 --rounds 3 \
        --out benchmarks/results/grpc-vs-http-cpu/grpc_vs_http
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common

from halfserve import hostinfo
from halfserve.loadtest.process import free_port, process_cpu_seconds

PROTOCOLS = ("v2-binary", "grpc")


def loadtest(url: str, grpc_url: str, model: str, protocol: str, concurrency: str, duration: float) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="grpc-bench-"))
    cmd = [sys.executable, "-m", "halfserve", "loadtest", "--url", url, "--grpc-url", grpc_url, "--model", model]
    cmd += ["--protocol", protocol, "--concurrency", concurrency, "--duration", str(duration), "--warmup", "1"]
    cmd += ["--client-ceiling", "0", "--no-progress", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=common.ROOT, stdout=subprocess.DEVNULL)
    results: list[dict] = json.loads((out / "loadtest.json").read_text())["results"]
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--store", type=Path, default=common.ROOT / "model_store")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for halfserve serve (repeatable)")
    p.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = p.parse_args()

    http_port, grpc_port = free_port(), free_port()
    serve = ["--grpc", "--grpc-port", str(grpc_port), *args.serve_arg]
    server = common.start_server(args.store, args.model, http_port, *serve)
    url, grpc_url = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    rounds: list[dict[str, list[dict]]] = []
    server_us: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
    try:
        for r in range(args.rounds):
            order = PROTOCOLS if r % 2 == 0 else PROTOCOLS[::-1]
            runs = {}
            for proto in order:
                # The server's CPU per request over the whole run (its warm-ups too: each request is one row).
                cpu0, rows0 = process_cpu_seconds(server.pid), common.stats(http_port, args.model)["rows"]
                runs[proto] = loadtest(url, grpc_url, args.model, proto, args.concurrency, args.duration)
                cpu1, rows1 = process_cpu_seconds(server.pid), common.stats(http_port, args.model)["rows"]
                if cpu0 is not None and cpu1 is not None and rows1 > rows0:
                    server_us[proto].append((cpu1 - cpu0) / (rows1 - rows0) * 1e6)
            rounds.append(runs)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)

    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for i, c in enumerate(levels):
        row: dict[str, Any] = {"concurrency": c}
        for proto in PROTOCOLS:
            per_round = [run[proto][i] for run in rounds]
            row[proto] = {
                "req_per_s": statistics.median(x["req_per_s"] for x in per_round),
                "p50_ms": statistics.median(x["p50_ms"] for x in per_round),
                "p99_ms": statistics.median(x["p99_ms"] for x in per_round),
                "mean_batch_size": statistics.median(x["mean_batch_size"] for x in per_round),
                "client_cpu_us_per_request": statistics.median(x["client_cpu_us_per_request"] for x in per_round),
                "errors": sum(x["errors"] for x in per_round),
                "served_precision": per_round[0]["served_precision"],
            }
        row["grpc/http"] = [round(run["grpc"][i]["req_per_s"] / run["v2-binary"][i]["req_per_s"], 3) for run in rounds]
        rows.append(row)

    lines = [
        f"{args.model}, one sample per request, {args.rounds} interleaved rounds of {args.duration:g} s per level; "
        "median of the rounds",
        "",
        "| concurrency | V2 binary HTTP req/s | p50 / p99 ms | client us/req | gRPC req/s | p50 / p99 ms "
        "| client us/req | gRPC / HTTP per round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        h, g = row["v2-binary"], row["grpc"]
        lines.append(
            f"| {row['concurrency']} | {h['req_per_s']:,.0f} | {h['p50_ms']:.2f} / {h['p99_ms']:.2f} "
            f"| {h['client_cpu_us_per_request']:.0f} | {g['req_per_s']:,.0f} | {g['p50_ms']:.2f} / {g['p99_ms']:.2f} "
            f"| {g['client_cpu_us_per_request']:.0f} "
            f"| {', '.join(f'{x:.2f}' for x in row['grpc/http'])} |"
        )
    cpu = {p: statistics.median(v) for p, v in server_us.items() if v}
    if len(cpu) == len(PROTOCOLS):
        lines += [
            "",
            f"Server CPU per request (all levels, median of rounds): V2 binary HTTP {cpu['v2-binary']:.0f} us, "
            f"gRPC {cpu['grpc']:.0f} us.",
        ]
    md = "\n".join(lines)
    print(md)
    if args.out is not None:
        result = {
            "model": args.model,
            "serve_args": serve,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "rows": rows,
            "server_cpu_us_per_request": server_us,
            "raw": rounds,
            "machine": hostinfo.describe(),
        }
        common.write_results(args.out, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
