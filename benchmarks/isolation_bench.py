"""Instance threads against instance processes: an instance's per-batch host work beside a busy event loop.

On a GPU an instance makes dozens of small torch calls per batch (copies, launches, a sync); each lets go of the GIL
and takes it back, and in thread mode taking it back waits on the event loop, which holds it while it serves
requests. This measures that without a GPU: the model (``benchmarks/tools/hostwork.py``) makes ``--calls`` tiny torch
calls per batch and then sleeps ``--device-ms`` without the GIL (the device's time), and answers how long the calls
took. A probe client reads that host time from its answers, once with the server otherwise idle and once while wrk
keeps ``--concurrency`` requests in flight on the same model; thread and process mode alternate, round after round,
each in a fresh server.

Usage:
    python benchmarks/isolation_bench.py --out benchmarks/results/isolation-cpu/hostwork
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import httpx
import numpy as np

from halfserve import hostinfo, store
from halfserve.execution import Batching
from halfserve.loadtest.process import free_port
from halfserve.manifest import Manifest, TensorSpec

TOOLS = common.ROOT / "benchmarks" / "tools"
MODES = ("thread", "process")


def save_model(root: Path, calls: int, device_ms: float, waits: int, max_batch_size: int) -> None:
    sys.path.insert(0, str(TOOLS))
    import hostwork

    kwargs = {"features": 16, "calls": calls, "device_ms": device_ms, "waits": waits}
    manifest = Manifest(
        name="hostwork",
        architecture="hostwork:build",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="x", shape=[16])],
        outputs=[TensorSpec(name="timing", shape=[2])],
        precision="fp32",
        batching=Batching(max_batch_size=max_batch_size, max_delay_ms=2.0),
    )
    store.save(root, manifest, hostwork.build(**kwargs))


def probe(url: str, count: int, gap: float) -> list[float]:
    """The host milliseconds of the batches ``count`` requests ran in, ``gap`` seconds apart."""
    body = {"model": "hostwork", "inputs": [[0.5] * 16]}
    out = []
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            r = client.post(f"{url}/predict", json=body)
            r.raise_for_status()
            out.append(float(r.json()["outputs"][0][0]))
            time.sleep(gap)
    return out


def one_round(root: Path, mode: str, args: argparse.Namespace, folder: Path) -> dict[str, object]:
    port = free_port()
    placement = "instance_processes" if mode == "process" else "instance_threads"
    extra = ["--placement", placement, "--gil-switch-interval-ms", str(args.switch_interval_ms)]
    extra += ["--code-path", str(TOOLS), "--no-grpc", "--threads", "1"]
    proc = common.start_server(root, "hostwork", port, *extra)
    url = f"http://127.0.0.1:{port}"
    try:
        idle = probe(url, args.probes, args.gap)
        protocol = common.make_protocol("predict", "hostwork", "x", np.full(16, 0.5, np.float32), folder)
        cmd = [
            "wrk",
            "-t1",
            f"-c{args.concurrency}",
            f"-d{args.seconds:g}s",
            "--latency",
            "-s",
            str(protocol.script),
            f"{url}{protocol.path}",
        ]
        load = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env={"HALFSERVE_BODY": str(protocol.body), "PATH": "/usr/bin"}
        )
        time.sleep(1.0)
        busy = probe(url, args.probes, args.gap)
        out, _ = load.communicate(timeout=args.seconds + 30)
        served = common.stats(port, "hostwork")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    wrk = common.parse_wrk(out)
    return {
        "mode": mode,
        "idle_host_ms": statistics.median(idle),
        "busy_host_ms": statistics.median(busy),
        "busy_over_idle": statistics.median(busy) / statistics.median(idle),
        "idle_samples": idle,
        "busy_samples": busy,
        "wrk": wrk,
        "mean_batch": served["rows"] / max(served["batches"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results prefix: writes <out>.json and <out>.md")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200, help="tiny torch calls per batch (the host work)")
    parser.add_argument("--device-ms", type=float, default=2.0, help="GIL-free sleep per batch (the device's time)")
    parser.add_argument("--waits", type=int, default=4, help="GIL-free waits the sleep is cut into (stream syncs)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0, help="wrk's run; the probe runs inside it")
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between probe requests")
    parser.add_argument("--switch-interval-ms", type=float, default=0.5, help="as the server sets on CUDA")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        save_model(root, args.calls, args.device_ms, args.waits, args.max_batch_size)
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                result = one_round(root, mode, args, Path(tmp))
                result["round"] = r + 1
                runs.append(result)
                print(
                    f"round {r + 1} {mode:>7}: host ms per batch idle {result['idle_host_ms']:.3f}, "
                    f"busy {result['busy_host_ms']:.3f} ({result['busy_over_idle']:.2f}x); "
                    f"{result['wrk']['rps']:.0f} req/s, mean batch {result['mean_batch']:.1f}",
                    flush=True,
                )
    summary = {
        mode: {
            "busy_over_idle": [r["busy_over_idle"] for r in runs if r["mode"] == mode],
            "rps": [r["wrk"]["rps"] for r in runs if r["mode"] == mode],  # type: ignore[index]
        }
        for mode in MODES
    }
    settings = vars(args) | {"out": str(args.out)}
    result = {"host": hostinfo.describe(), "args": settings, "runs": runs, "summary": summary}
    lines = [
        "| round | mode | host ms/batch idle | busy | busy / idle | req/s | p99 ms | mean batch |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        w = r["wrk"]
        lines.append(
            f"| {r['round']} | {r['mode']} | {r['idle_host_ms']:.3f} | {r['busy_host_ms']:.3f} | "
            f"{r['busy_over_idle']:.2f} | {w['rps']:.0f} | {w['p99_ms']:.1f} | {r['mean_batch']:.1f} |"  # type: ignore[index]
        )
    common.write_results(args.out, result, "\n".join(lines))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
