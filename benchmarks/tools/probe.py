"""Probe: server with UINT8 ResNet-50 images under wrk, per precision, with server CPU and a py-spy profile.

Run from the repository root with ``benchmarks`` on ``PYTHONPATH`` (for ``common`` and ``gpu_bench``) and wrk at
``.gpu/bin/wrk``: ``PYTHONPATH=benchmarks python benchmarks/tools/probe.py``. Env: ``OUT`` (default /tmp/out),
``PRECS``, ``CONC``, ``INSTANCES``, ``WIRE``, ``WRK_THREADS``, ``BUCKETS``, ``SERVER_ARGS``, ``PYSPY``, ``TAG``;
writes ``probe-<wire>-<TAG>.json`` and the servers' logs into ``OUT``.
"""

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import common
import gpu_bench
import httpx
import numpy as np
from common import ROOT

from halfserve.execution import Compile, Execution

OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
WRK = str(ROOT / ".gpu/bin/wrk")
ENV = {**os.environ, "LD_LIBRARY_PATH": str(ROOT / ".gpu/lib")}
store_dir = Path("/tmp/probe_store")
args = sys.argv[1:]
conc = [int(c) for c in os.environ.get("CONC", "16,64,128").split(",")]
precs = os.environ.get("PRECS", "fp16,fp32").split(",")
extra = os.environ.get("SERVER_ARGS", "").split()
instances = int(os.environ.get("INSTANCES", "2"))
wire = os.environ.get("WIRE", "uint8")
threads = int(os.environ.get("WRK_THREADS", "8"))

if not (store_dir / "resnet50").exists():
    t = time.time()
    gpu_bench.build_store(store_dir, 224, 128, Execution())
    print("built", time.time() - t, flush=True)
buckets = [int(b) for b in os.environ["BUCKETS"].split(",")] if os.environ.get("BUCKETS") else None
ex = Execution(instances=instances, compile=Compile.CUDA_GRAPHS, pad_to_bucket=True, batch_buckets=buckets)
gpu_bench.set_manifest(store_dir, ex, wire)

dt = {"uint8": ("UINT8", np.uint8, 1), "fp32": ("FP32", np.float32, 4)}[wire]
img = np.random.default_rng(0).integers(0, 256, (1, 3, 224, 224)).astype(dt[1])
raw = img.tobytes()
tensor = {"name": "image", "shape": [1, 3, 224, 224], "datatype": dt[0], "parameters": {"binary_data_size": len(raw)}}
header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
(OUT / "body").write_bytes(header + raw)
lua = OUT / "v2.lua"
lua.write_text(
    'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/octet-stream"\n'
    f'wrk.headers["Inference-Header-Content-Length"] = "{len(header)}"\n'
    'local f = io.open(os.getenv("HALFSERVE_BODY"), "rb")\nwrk.body = f:read("*a")\nf:close()\n'
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (the front-end processes)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [pid, *(int(k) for k in kids.read_text().split())] if kids.exists() else [pid]
    total = 0.0
    for p in pids:
        with contextlib.suppress(FileNotFoundError):  # a front-end that just ended
            total += cpu_seconds(p)
    return total


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


results = []
for prec in precs:
    port = 8100
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(store_dir), "--port", str(port)]
    cmd += ["--precision", prec, "--no-tf32", *extra]
    with (OUT / f"server-{prec}.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    waited = common.wait_ready(f"http://127.0.0.1:{port}/ready", proc, 600, 0.2, OUT / f"server-{prec}.log")
    print(prec, "ready in", round(waited, 1), flush=True)
    url = f"http://127.0.0.1:{port}/v2/models/resnet50/infer"
    wenv = {**ENV, "HALFSERVE_BODY": str(OUT / "body")}
    subprocess.run([WRK, "-t4", "-c64", "-d3s", "-s", str(lua), url], env=wenv, capture_output=True)
    for c in conc:
        rows0 = metric(port, "halfserve_batch_size_sum")
        n0 = metric(port, "halfserve_batch_size_count")
        comp0 = metric(port, "halfserve_compute_duration_seconds_sum")
        q0 = metric(port, "halfserve_queue_duration_seconds_sum")
        qn0 = metric(port, "halfserve_queue_duration_seconds_count")
        cpu0 = cpu_seconds(proc.pid)
        tree0 = tree_cpu_seconds(proc.pid)
        busy0, total0 = host_cpu()
        spy = None
        if c == 64 and os.environ.get("PYSPY"):
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-d",
                    "5",
                    "-r",
                    "250",
                    "--nonblocking",
                    "-f",
                    "raw",
                    "-t",
                    "-o",
                    str(OUT / f"pyspy-{prec}-c{c}.txt"),
                    "--pid",
                    str(proc.pid),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        t0 = time.time()
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        w = subprocess.run(
            [WRK, f"-t{min(threads, c)}", f"-c{c}", "-d8s", "--latency", "--timeout", "20s", "-s", str(lua), url],
            env=wenv,
            capture_output=True,
            text=True,
        ).stdout
        wall = time.time() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        wrk_cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / wall * 100
        cpu = (cpu_seconds(proc.pid) - cpu0) / wall * 100
        tree = (tree_cpu_seconds(proc.pid) - tree0) / wall * 100
        busy1, total1 = host_cpu()
        host_busy = (busy1 - busy0) / max(1, total1 - total0) * 100
        if spy:
            spy.wait()
        rows = metric(port, "halfserve_batch_size_sum") - rows0
        n = metric(port, "halfserve_batch_size_count") - n0
        comp = metric(port, "halfserve_compute_duration_seconds_sum") - comp0
        q = metric(port, "halfserve_queue_duration_seconds_sum") - q0
        qn = metric(port, "halfserve_queue_duration_seconds_count") - qn0
        parsed = common.parse_wrk(w)
        r = {
            "precision": prec,
            "concurrency": c,
            **parsed,
            "server_cpu_percent": round(cpu),
            "server_and_frontends_cpu_percent": round(tree),
            "host_cpu_busy_percent": round(host_busy, 1),
            "wrk_cpu_percent": round(wrk_cpu),
            "mean_batch": round(rows / max(n, 1), 1),
            "mean_compute_ms": round(1000 * comp / max(n, 1), 2),
            "mean_queue_ms": round(1000 * q / max(qn, 1), 2),
            "args": extra,
            "wire": wire,
            "instances": instances,
            "buckets": buckets,
        }
        print(json.dumps(r), flush=True)
        results.append(r)
    proc.terminate()
    proc.wait(timeout=60)
(OUT / f"probe-{wire}-{os.environ.get('TAG', 'x')}.json").write_text(json.dumps(results, indent=1))
