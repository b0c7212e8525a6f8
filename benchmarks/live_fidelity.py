"""What live fidelity costs the request path: p50 and p99 at a concurrency (64 by default) with live fidelity off
(``--live-fidelity-rate 0``) against on (its default rate, or the rates given), interleaved (off, on, off, on, ...),
each round in a fresh ``halfserve serve`` of the model in bf16 on this CPU, loaded by ``halfserve loadtest`` (its own
client process, one keep-alive connection per virtual user). Reports each arm's median over the rounds and its ratio
to off, with the rows live fidelity compared (from ``/models``), so a run that sampled nothing shows.

Usage:
    python benchmarks/live_fidelity.py --out benchmarks/results/live-fidelity-cpu/digits-mlp
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
from typing import Any

import common
import httpx
import numpy as np

from halfserve import hostinfo
from halfserve.loadtest.process import free_port


def run_once(store: Path, model: str, rate: float, concurrency: int, seconds: float) -> dict[str, float]:
    """One fresh server with live fidelity at ``rate``, one loadtest level; its latencies and live fidelity's rows."""
    port = free_port()
    args = ["--precision", "bf16", "--device", "cpu", "--live-fidelity-rate", str(rate)]
    proc = common.start_server(store, model, port, *args)
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "halfserve", "loadtest", "--url", f"http://127.0.0.1:{port}"]
            cmd += ["--model", model, "--concurrency", str(concurrency), "--duration", str(seconds)]
            cmd += ["--client-ceiling", "0", "--no-progress", "--out", out]
            subprocess.run(cmd, check=True, capture_output=True)
            level = json.loads((Path(out) / "loadtest.json").read_text())
        listed = httpx.get(f"http://127.0.0.1:{port}/models").json()
        models = listed["models"] if isinstance(listed, dict) else listed
        live = next(m for m in models if m["name"] == model)["live_fidelity"] or {}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    row = _level(level)
    row["rows_compared"] = live.get("rows_compared", 0)
    row["rows_dropped"] = live.get("rows_dropped", 0)
    row["rerun_seconds"] = live.get("rerun_seconds", 0.0)
    return row


def _level(result: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """The one level's p50, p99 (ms), throughput and errors from loadtest.json."""
    level = result["results"][0]
    keys = ("p50_ms", "p99_ms", "req_per_s", "errors", "requests", "mean_batch_size")
    return {k: level[k] for k in keys}


def tap_cost(store: Path, model: str, rate: float, rows: int, batches: int) -> dict[str, float]:
    """Microseconds the tap adds to a batch of ``rows`` rows on the event loop, in-process: sampling at ``rate`` and
    copying the sampled rows into the queue (no worker, so every sampled batch stays queued or is dropped)."""
    from halfserve import fidelity
    from halfserve import store as store_
    from halfserve.livefidelity import LiveFidelity, LiveSettings
    from halfserve.manifest import Precision
    from halfserve.settings import LiveFidelityAction

    loaded = store_.load(store, model)
    settings = LiveSettings(rate, 0.1, 1000, 100, LiveFidelityAction.DEMOTE)
    live = LiveFidelity(model, loaded, fidelity.DEFAULT_BAR, settings, lambda _: None)
    width = int(np.prod(loaded.manifest.inputs[0].shape))
    chunks = [np.zeros((1, width), np.float32) for _ in range(rows)]  # one-row requests, as the load test sends
    outcomes = [np.zeros((1, 10), np.float32) for _ in range(rows)]
    started = time.perf_counter()
    for _ in range(batches):
        live.offer(chunks, outcomes, Precision.BF16, live.taps)
    took = time.perf_counter() - started
    live.close()
    return {"rate": rate, "rows_per_batch": rows, "us_per_batch": took / batches * 1e6}


def render(result: dict[str, Any]) -> str:
    """The results' table: medians, their ratios to off, and the on/off ratios of each round."""
    arms: list[str] = list(result["medians"])
    medians, rounds, host = result["medians"], result["rounds"], result["host"]
    off = medians[arms[0]]
    lines = [
        f"# Live fidelity's cost on the request path: {result['model']}, bf16, c={result['concurrency']}",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Host: {host['cpu']}, {host['cores']} cores ({host['cpu_capability']}, native bf16 (avx512_bf16): "
        f"{host['native_bf16']}), {host['allocator']}, torch {host['torch']}; shared with other work, so rough.",
        "",
        f"{len(rounds)} rounds of {result['seconds']:g} s per arm, arms interleaved (off, on, ...), each in a fresh "
        "server; medians over the rounds.",
        "",
        "| live fidelity rate | p50 ms | p99 ms | req/s | p50 / off | p99 / off | rows compared | rows dropped | "
        "rerun s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        m = medians[arm]
        lines.append(
            f"| {float(arm):g}{' (off)' if float(arm) == 0 else ''} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
            f"{m['req_per_s']:.0f} | "
            f"{m['p50_ms'] / off['p50_ms']:.3f} | {m['p99_ms'] / off['p99_ms']:.3f} | {m['rows_compared']:.0f} | "
            f"{m['rows_dropped']:.0f} | {m['rerun_seconds']:.2f} | {m['errors']:.0f} |"
        )
    lines += ["", "Each round's on / off (the same round's off arm):", ""]
    lines += ["| live fidelity rate | p50 ratios | p99 ratios |", "|---|---|---|"]
    for arm in arms[1:]:
        p50 = ", ".join(f"{r[arm]['p50_ms'] / r[arms[0]]['p50_ms']:.2f}" for r in rounds)
        p99 = ", ".join(f"{r[arm]['p99_ms'] / r[arms[0]]['p99_ms']:.2f}" for r in rounds)
        lines.append(f"| {float(arm):g} | {p50} | {p99} |")
    if result.get("tap"):
        lines += ["", "The tap's own time per batch on the event loop, in-process (no server):", ""]
        lines += ["| rate | rows per batch | us per batch |", "|---|---|---|"]
        lines += [f"| {t['rate']:g} | {t['rows_per_batch']} | {t['us_per_batch']:.2f} |" for t in result["tap"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=common.ROOT / "model_store")
    p.add_argument("--model", default="digits_mlp")
    p.add_argument("--rates", default="0.001", help="live fidelity rates of the 'on' arms, comma-separated")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--render", type=Path, help="only render the table of a results JSON this script wrote")
    a = p.parse_args()
    if a.render is not None:
        common.write_results(a.out, json.loads(a.render.read_text()), render(json.loads(a.render.read_text())))
        return
    arms = [0.0, *(float(r) for r in a.rates.split(","))]
    tap = [tap_cost(a.store, a.model, rate, a.concurrency, 20_000) for rate in arms[1:]]
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(a.rounds):
        found = {}
        for rate in arms:  # off first, then each rate: interleaved round after round
            found[str(rate)] = run_once(a.store, a.model, rate, a.concurrency, a.seconds)
            print(f"round {i + 1} rate {rate}: {found[str(rate)]}", flush=True)
        rounds.append(found)
    medians = {
        str(rate): {k: statistics.median(r[str(rate)][k] for r in rounds) for k in rounds[0][str(rate)]}
        for rate in arms
    }
    result = {
        "command": "python benchmarks/live_fidelity.py " + " ".join(sys.argv[1:]),
        "host": hostinfo.describe(),
        "model": a.model,
        "concurrency": a.concurrency,
        "seconds": a.seconds,
        "rounds": rounds,
        "medians": medians,
        "tap": tap,
    }
    common.write_results(a.out, result, render(result))
    print(render(result))


if __name__ == "__main__":
    main()
