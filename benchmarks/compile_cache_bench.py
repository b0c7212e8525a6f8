"""Ready time of an ``inductor`` (or ``aoti``) model with a cold and a warm compile cache, through real ``halfserve
serve`` starts.

For each model it copies the store entry with ``execution.compile: "inductor"`` (``--compile``) into a scratch
store, then starts the server three times on one ``--compile-cache`` folder, empty at first: the first start compiles
and writes the entry (``cold``), the second loads it (``warm``); each gets an empty ``TORCHINDUCTOR_CACHE_DIR`` of its
own, so torch's own cache cannot stand in for the compile cache. The third (``warm+kernels``) loads the entry with
torch's cache as the second left it: on a CPU, where the entry does not hold the C++ kernels, that is what a restart
on the same host gets from torch's default ``/tmp/torchinductor_<user>``. It reports the seconds from spawning the
server to its ``/ready``, the warm-up, the compile time and the compile cache fields of ``GET /models``.

    python benchmarks/compile_cache_bench.py --models resnet_bench,digits_mlp \
        --out benchmarks/results/compile-cache-cpu/compile-cache
    python benchmarks/compile_cache_bench.py --compile aoti --models digits_mlp,resnet_bench \
        --out benchmarks/results/aoti-cpu/ready-aoti

With ``--compile aoti`` the package holds its kernels, but loading one on a CPU first has torch find the vector
instructions it may use by compiling probes into its own cache: ``warm`` pays for them, ``warm+kernels`` finds them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, wait_ready, write_results

from halfserve import hostinfo, store
from halfserve.execution import Compile
from halfserve.manifest import load_manifest

STARTS = ("cold", "warm", "warm+kernels")
"""An empty compile cache and torch cache; the entry the first wrote, torch's cache empty; the entry, and torch's cache
as the second left it (the C++ kernels it built: TorchInductor's FX graph artifacts do not bundle them on a CPU)."""
FIELDS = ("compile_cache", "compile_cache_load_seconds", "compiled_graphs", "cached_graphs", "inductor_compile_seconds")


def compiled_copy(source: Path, model: str, scratch: Path, mode: Compile) -> Path:
    """A store in ``scratch`` holding ``model`` from ``source`` with ``execution.compile`` ``mode``."""
    root = scratch / "store"
    shutil.copytree(source / model, root / model)
    manifest = load_manifest(root / model)
    execution = manifest.execution.model_copy(update={"compile": mode})
    store.write_manifest(root, manifest.model_copy(update={"execution": execution}))
    return root


def start(
    root: Path, model: str, cache: Path, run: Path, kernels: Path, args: list[str], timeout: float
) -> dict[str, Any]:
    """One start with torch's own cache in ``kernels``: seconds to ready, then what ``/models`` says of the model."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(root), "--models", model, "--port", str(port)]
    cmd += ["--no-grpc", "--compile-cache", str(cache), *args]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(kernels)}
    began = time.perf_counter()
    with (run / "server.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, timeout, interval=0.05, log=run / "server.log")
        ready = time.perf_counter() - began
        (entry,) = httpx.get(f"http://127.0.0.1:{port}/models").json()["models"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    execution = entry["execution"]
    return {
        "ready_seconds": round(ready, 2),
        "warmup_seconds": entry["warmup_seconds"],
        "buckets": execution["buckets"],
        **{k: execution[k] for k in FIELDS},
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| model | start | ready s | warm-up s | compile s | cache | load s | graphs compiled | graphs cached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['model']} | {r['start']} | {r['ready_seconds']:.1f} | {r['warmup_seconds']:.1f} | "
            f"{r['inductor_compile_seconds']:.1f} | {r['compile_cache']} | {r['compile_cache_load_seconds']:.2f} | "
            f"{r['compiled_graphs']} | {r['cached_graphs']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=ROOT / "model_store")
    p.add_argument("--models", default="resnet_bench,digits_mlp")
    p.add_argument("--precision", default="fp32", help="fp32: no fidelity check at load, whose reference compiles too")
    p.add_argument("--serve-args", default="--threads 1", help="more `halfserve serve` flags, space-separated")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take to be ready")
    p.add_argument("--compile", default="inductor", type=Compile, help="inductor or aoti")
    p.add_argument("--out", type=Path, help="path prefix for .json and .md")
    args = p.parse_args()
    serve_args = ["--precision", args.precision, *args.serve_args.split()]
    result: dict[str, Any] = {
        "machine": hostinfo.describe(),
        "compile": args.compile.value,
        "serve_args": serve_args,
        "runs": [],
    }
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as tmp:
            scratch = Path(tmp)
            root = compiled_copy(args.store, model, scratch, args.compile)
            for name in STARTS:
                run = scratch / name
                kernels = scratch / ("warm" if name == "warm+kernels" else name) / "torchinductor"
                run.mkdir()
                measured = start(root, model, scratch / "cache", run, kernels, serve_args, args.timeout)
                row = {"model": model, "start": name, **measured}
                print(json.dumps(row), flush=True)
                result["runs"].append(row)
    md = markdown(result)
    print(md)
    if args.out is not None:
        write_results(args.out, result, md)


if __name__ == "__main__":
    main()
