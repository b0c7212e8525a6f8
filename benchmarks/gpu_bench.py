"""GPU fast-path benchmark: the in-process ceiling per batch size and precision, then the server under concurrency.

In one run, on one device:

  1. builds a ResNet-50 (random weights, BatchNorm calibrated on random images) into a temporary model store: a
     100 MB checkpoint is generated, never committed;
  2. the in-process ceiling, per precision (fp16 and fp32 on CUDA, bf16 and fp32 on a CPU) and batch size, through
     the same Engine code the server runs (numpy in, pinned staging, copy, cast on the device, forward, float32
     numpy out), eager and with CUDA graphs (capture time reported); beside it the bare device forward (input
     already on the device) and, for fp16, the same without channels_last;
  3. several engine instances driven from as many threads at the top batch size (copies overlap compute);
  4. weight memory per precision (bytes of the cast parameters, and what the CUDA allocator holds for them);
  5. the server (``halfserve serve`` started per precision) swept over concurrency with ``halfserve loadtest``'s
     client (KServe V2 binary tensors, several client processes), reporting server / ceiling and fp16 / fp32.

TF32 is off for fp32 (the server's default, ``--no-tf32``), so fp32 is IEEE fp32; the run also measures fp32 with
TF32 on in-process, for reference. Writes ``gpu_bench.json``, ``gpu_bench.md`` and ``gpu_bench.png`` into --out,
and the load test's own report into ``--out/loadtest``.

Usage (the commands of the committed runs are in benchmarks/README.md):
    python benchmarks/gpu_bench.py --out /tmp/gpu_bench                                # on a CUDA machine
    python benchmarks/gpu_bench.py --image-size 64 --batch-sizes 1,4,16 --concurrency 1,4,16 --duration 3 \\
        --instances 1 --instance-counts 1,2 --client-processes 1 \\
        --out benchmarks/results/gpu-bench-cpu                                         # the same paths on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np
import poisson
import torch
from closed_loop import closed_loop
from common import IMAGENET, ROOT

from halfserve import hostinfo, models, store
from halfserve.compilation import tune_cudnn
from halfserve.engine.core import Engine
from halfserve.execution import Batching, Compile, Execution
from halfserve.instance import bucket_for
from halfserve.loadtest.config import LoadtestConfig
from halfserve.loadtest.make_bench_model import calibrate
from halfserve.loadtest.payload import Protocol
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec, load_manifest
from halfserve.precision import set_tf32
from halfserve.store import LoadedModel

MODEL = "resnet50"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(fn: Callable[[], object], rows: int, seconds: float, device: torch.device, min_iters: int = 5) -> float:
    """Rows/s of ``fn`` (which runs ``rows`` rows) over about ``seconds``, after two unmeasured calls."""
    fn()
    fn()
    sync(device)
    n, start = 0, time.perf_counter()
    while n < min_iters or time.perf_counter() - start < seconds:
        fn()
        n += 1
    sync(device)
    return rows * n / (time.perf_counter() - start)


def build_store(
    root: Path, image_size: int, max_batch_size: int, execution: Execution, architecture: str = "resnet50"
) -> LoadedModel:
    """ResNet-50 with random weights and calibrated BatchNorm, saved through the real store code: the registered
    ``resnet50`` (torchvision's layer for layer, no torchvision needed) or ``torchvision:resnet50``."""
    shape = [3, image_size, image_size]
    manifest = Manifest(
        name=MODEL,
        architecture=architecture,
        arch_kwargs={"num_classes": 1000},
        inputs=[TensorSpec(name="image", shape=shape)],
        outputs=[TensorSpec(name="logits", shape=[1000])],
        batching=Batching(max_batch_size=max_batch_size, max_delay_ms=2.0, max_queue_rows=max(4096, max_batch_size)),
        execution=execution,
        description="ResNet-50 with random weights (seed 0), BatchNorm calibrated on random images: benchmark only.",
    )
    torch.manual_seed(0)
    module = models.build(architecture, num_classes=1000)
    calibrate(module, shape, seed=0)
    store.save(root, manifest, module, version=1)
    return store.load(root, MODEL)


def with_wire(manifest: Manifest, wire: str) -> Manifest:
    """The manifest with its input declared ``wire`` (FP32, FP16 or UINT8): what clients send and the engine stages.

    UINT8 images come with ImageNet's normalisation, done by the server on the device.
    """
    spec = manifest.inputs[0].model_copy(update={"datatype": DataType(wire.upper())})
    normalize = IMAGENET if spec.datatype is DataType.UINT8 else None
    return manifest.model_copy(update={"inputs": [spec], "normalize": normalize})


def set_manifest(root: Path, execution: Execution, wire: str) -> None:
    manifest = with_wire(load_manifest(root / MODEL), wire)
    store.write_manifest(root, manifest.model_copy(update={"execution": execution}))


def ceiling(
    loaded: LoadedModel,
    precision: str,
    device: torch.device,
    sizes: list[int],
    seconds: float,
    execution: Execution,
    *,
    device_only: bool = False,
) -> dict[str, Any]:
    """Rows/s per batch size through the Engine (and optionally of the bare device forward)."""
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    engine = Engine(loaded, Precision(precision), device, execution=execution)
    weights_on_device = torch.cuda.memory_allocated(device) - allocated if device.type == "cuda" else 0
    warmup = engine.warmup(max(sizes))
    shape = engine.sample_shape
    rng = np.random.default_rng(0)
    engine_rate: dict[str, float] = {}
    device_rate: dict[str, float] = {}
    for b in sizes:
        x = rng.uniform(0, 1, (b, *shape)).astype(engine.input_dtype)
        engine_rate[str(b)] = rate(lambda x=x: engine.forward(x), b, seconds, device)
        if device_only:
            xd = torch.from_numpy(x).to(device)
            device_rate[str(b)] = rate(lambda xd=xd: engine._on_device(xd), b, seconds, device)
    info = engine.info
    engine.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result: dict[str, Any] = {
        "precision": precision,
        "cuda_graphs": info.cuda_graphs,
        "channels_last": info.channels_last,
        "weight_bytes": info.weight_bytes,
        "weight_bytes_allocated_on_device": weights_on_device,
        "warmup_seconds": round(warmup, 3),
        "graph_capture_seconds": round(info.graph_capture_seconds, 3),
        "inductor_compile_seconds": round(info.inductor_compile_seconds, 3),
        "engine_rows_per_s": engine_rate,
    }
    if device_only:
        result["device_forward_rows_per_s"] = device_rate
    print(json.dumps({k: v for k, v in result.items()}), flush=True)
    return result


def instances_rate(
    loaded: LoadedModel,
    precision: str,
    device: torch.device,
    batch: int,
    counts: list[int],
    seconds: float,
    ex: Execution,
) -> dict[str, float]:
    """Rows/s with ``n`` instances each driven by its own thread at ``batch`` rows, for each ``n`` in ``counts``."""
    out: dict[str, float] = {}
    for n in counts:
        engine = Engine(loaded, Precision(precision), device, execution=ex.model_copy(update={"instances": n}))
        engine.warmup(batch)
        x = np.random.default_rng(0).uniform(0, 1, (batch, *engine.sample_shape)).astype(engine.input_dtype)
        done = [0] * n
        stop = threading.Event()

        def drive(
            i: int, engine: Engine = engine, done: list[int] = done, x: np.ndarray = x, stop: threading.Event = stop
        ) -> None:
            inst = engine.instances[i]
            while not stop.is_set():  # on the instance's own thread, where it warmed up, as the server runs it
                inst.executor.submit(engine.run_batch, [x], inst).result()
                done[i] += 1

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(min(1.0, seconds / 2))  # unmeasured
        base, start = sum(done), time.perf_counter()
        time.sleep(seconds)
        total, elapsed = sum(done) - base, time.perf_counter() - start
        stop.set()
        for t in threads:
            t.join()
        engine.close()
        out[str(n)] = total * batch / elapsed
        print(
            json.dumps({"precision": precision, "instances": n, "batch": batch, "rows_per_s": out[str(n)]}), flush=True
        )
    return out


def closed_loops(
    loaded: LoadedModel,
    precisions: list[str],
    device: torch.device,
    ex: Execution,
    concurrency: list[int],
    seconds: float,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per precision and concurrency c: c in-process clients in a closed loop through the Batcher and an Engine with
    the server's execution (its instance count, graphs or not), the manifest's batching: what c clients can get at
    all without HTTP (:mod:`closed_loop`)."""
    batching = loaded.manifest.batching
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for prec in precisions:
        engine = Engine(loaded, Precision(prec), device, execution=ex)
        engine.warmup(batching.max_batch_size)
        out[prec] = {}
        for c in concurrency:
            run = closed_loop(
                engine,
                c,
                seconds,
                max_batch_size=batching.max_batch_size,
                max_delay=batching.max_delay_ms / 1000,
                adaptive_delay=batching.adaptive_delay,
                warmup=min(1.0, seconds),
            )
            out[prec][str(c)] = asyncio.run(run)
            print(json.dumps({"closed_loop": prec, "instances": ex.instances, "c": c, **out[prec][str(c)]}), flush=True)
        engine.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def serve_sweep(
    root: Path, args: argparse.Namespace, precisions: list[str], out: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``halfserve loadtest`` (self-contained: a server per precision) over the concurrency levels."""
    from halfserve.loadtest import report
    from halfserve.loadtest.progress import SweepProgress
    from halfserve.loadtest.runner import Runner

    config = LoadtestConfig(
        model=MODEL,
        store=root,
        precisions=tuple(precisions),
        concurrency=tuple(args.concurrency),
        duration=args.duration,
        warmup=args.warmup,
        protocol=Protocol.V2_BINARY,
        out=out,
        device=args.device,
        progress=False,
        timeout=60.0,
        client_processes=args.client_processes,
        client_ceiling=args.client_ceiling,
        server_args=("--no-tf32", *extra),
    )
    with SweepProgress(enabled=False) as progress:
        sweep = Runner(config, progress).run()
    report.write(sweep, out)
    return report.to_json(sweep)


def wrk_sweep(
    root: Path, args: argparse.Namespace, precisions: list[str], wire: str, out: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The server swept with wrk (C, not the bottleneck) posting one V2 binary image per request.

    Same result shape as :func:`serve_sweep`; the mean batch comes from the server's ``/models/{model}/stats``
    before and after each level, the server's CPU from ``/proc`` (the engine process and its front-ends).
    """
    out.mkdir(parents=True, exist_ok=True)
    proto = wire_protocol(root, wire, out)
    port, results = free_port(), []
    for prec in precisions:
        server = common.start_server(root, MODEL, port, "--precision", prec, "--no-tf32", *extra)
        url = f"http://127.0.0.1:{port}{proto.path}"
        try:
            # No more connections than the levels use: the backlog of a wider warm-up (64 images take a CPU over a
            # second) would eat into the first level's seconds.
            warm = min(64, max(args.concurrency))
            common.wrk(url, warm, args.warmup, proto.script, proto.body, threads=min(args.wrk_threads, warm))
            for c in args.concurrency:
                before, cpu0, t0 = common.stats(port, MODEL), process_cpu(server.pid), time.perf_counter()
                r = common.wrk(url, c, args.duration, proto.script, proto.body, threads=min(args.wrk_threads, c))
                cpu = (process_cpu(server.pid) - cpu0) / (time.perf_counter() - t0) * 100
                after = common.stats(port, MODEL)
                batches = after["batches"] - before["batches"]
                row = {
                    "precision": prec,
                    "concurrency": c,
                    "rows_per_s": r["rps"],
                    "p50_ms": r["p50_ms"],
                    "p99_ms": r["p99_ms"],
                    "mean_batch_size": (after["rows"] - before["rows"]) / batches if batches else None,
                    "errors": r["non_2xx"],
                    "client_bound": False,
                    "server_cpu_percent": round(cpu),
                }
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            server.terminate()
            server.wait(timeout=120)
    sweep = {"load_generator": f"wrk -t{args.wrk_threads}", "server_args": list(extra), "results": results}
    (out / "sweep.json").write_text(json.dumps(sweep, indent=2) + "\n")
    return sweep


def wire_protocol(root: Path, wire: str, out: Path) -> common.Protocol:
    """The V2 binary request every load generator here sends: one seeded image of the input's ``wire`` datatype."""
    spec = load_manifest(root / MODEL).inputs[0]
    image = np.random.default_rng(0).integers(0, 256, spec.shape)
    sample = image if wire == "uint8" else image / 255
    return common.make_protocol("v2-binary", MODEL, spec.name, sample, out, wire.upper())


def poisson_run(url: str, proto: common.Protocol, args: argparse.Namespace, start: float) -> dict[str, Any]:
    """The Poisson sweep (:mod:`poisson`) against ``url``, from ``start`` requests/s, within the flags' bounds."""
    body = proto.body.read_bytes()

    def measure(rate: float) -> poisson.Trial:
        trial = poisson.measure_rate(
            url,
            body,
            proto.headers,
            rate,
            seconds=args.poisson_seconds,
            warmup=args.poisson_warmup,
            processes=args.poisson_processes,
        )
        print(json.dumps({"poisson": url, **trial.__dict__}), flush=True)
        return trial

    # A trial takes its warm-up and measured seconds, a second of client start-up, and the slowest answers' wait.
    per_rate = args.poisson_warmup + args.poisson_seconds + 1.5
    run = poisson.sweep(
        measure,
        args.p99_limit_ms,
        start=start,
        seconds_per_rate=per_rate,
        budget_seconds=args.poisson_budget,
        max_steps=args.poisson_steps,
    )
    run["client"] = (
        f"Python open loop (httpx), {args.poisson_processes} process(es), exponential inter-arrival times (seed 0), "
        f"latency from each request's scheduled send time; {args.poisson_warmup:g} s unmeasured + "
        f"{args.poisson_seconds:g} s per rate"
    )
    return run


def server_poisson(
    root: Path, args: argparse.Namespace, prec: str, wire: str, extra: tuple[str, ...], start: float, out: Path
) -> dict[str, Any]:
    """The Poisson sweep against ``halfserve serve`` at ``prec`` with the server flags ``extra``."""
    out.mkdir(parents=True, exist_ok=True)
    proto, port = wire_protocol(root, wire, out), free_port()
    server = common.start_server(root, MODEL, port, "--precision", prec, "--no-tf32", *extra)
    try:
        run = poisson_run(f"http://127.0.0.1:{port}{proto.path}", proto, args, start)
    finally:
        server.terminate()
        server.wait(timeout=120)
    return {"precision": prec, "wire": wire, "server_args": list(extra), **run}


def loaded_max_batch(root: Path) -> int:
    return load_manifest(root / MODEL).batching.max_batch_size


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports nothing listens on now (a peer takes HTTP, gRPC and metrics ports)."""
    for _ in range(100):
        first = free_port()
        try:
            for port in range(first + 1, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {n} consecutive free ports")


def v2_output(response: httpx.Response) -> np.ndarray:
    """The first output of a KServe V2 answer, binary (the binary tensor extension) or JSON."""
    size = response.headers.get(common.HEADER_LENGTH)
    header = json.loads(response.content[: int(size)] if size else response.content)
    out = header["outputs"][0]
    if size:
        return np.frombuffer(response.content[int(size) :], dtype="<f4").reshape(out["shape"])
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def peer_pytriton(
    root: Path, args: argparse.Namespace, prec: str, wire: str, device: torch.device, start: float, out: Path
) -> dict[str, Any]:
    """The same model from the same store served by PyTriton (:mod:`pytriton_peer`, under ``--pytriton-python``),
    its answer checked against halfserve's Engine, then driven by the same clients as halfserve: the levels (wrk)
    and the Poisson sweep."""
    out.mkdir(parents=True, exist_ok=True)
    proto, port = wire_protocol(root, wire, out), free_ports(3)
    python = args.pytriton_python
    # Triton's Python backend stub embeds libpython: it must find the interpreter's own.
    libdir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))}
    cmd = [python, str(ROOT / "benchmarks" / "pytriton_peer.py"), "--store", str(root), "--model", MODEL]
    cmd += ["--precision", prec, "--device", str(device), "--port", str(port), "--instances", str(args.instances)]
    if args.peer_max_batch:
        cmd += ["--max-batch-size", str(args.peer_max_batch)]
    url = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    with (out / "pytriton.log").open("w") as log:
        peer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        # The model, not only the server: PyTriton loads it after Triton is up.
        common.wait_ready(f"{url}/v2/models/{MODEL}/ready", peer, args.peer_start_timeout, 0.2, out / "pytriton.log")
        ready = time.perf_counter() - began
        response = httpx.post(url + proto.path, content=proto.body.read_bytes(), headers=proto.headers, timeout=60)
        if not response.is_success:
            raise RuntimeError(f"pytriton answered {response.status_code}: {response.text[:500]}")
        answer = v2_output(response)
        loaded = store.load(root, MODEL)
        engine = Engine(loaded, Precision(prec), device, execution=Execution(instances=1, compile=Compile.NONE))
        header = int(proto.headers[common.HEADER_LENGTH])
        sample = np.frombuffer(proto.body.read_bytes()[header:], dtype=common.WIRE_DTYPES[wire.upper()])
        expected = engine.forward(sample.reshape(1, *engine.sample_shape))
        engine.close()
        run: dict[str, Any] = {
            "precision": prec,
            "wire": wire,
            "server_args": [],
            "instances": args.instances,
            "max_batch_size": args.peer_max_batch or loaded_max_batch(root),
            "ready_seconds": round(ready, 1),
            "answer_max_abs_diff_from_halfserve": round(float(np.abs(answer - expected).max()), 6),
            "answer_argmax_agrees": bool((answer.argmax(-1) == expected.argmax(-1)).all()),
            "levels": [],
        }
        print(json.dumps({"peer": "pytriton", **run}), flush=True)
        if args.load_generator == "wrk":
            warm = min(64, max(args.concurrency))
            common.wrk(url + proto.path, warm, args.warmup, proto.script, proto.body, min(args.wrk_threads, warm))
            for c in args.concurrency:
                r = common.wrk(url + proto.path, c, args.duration, proto.script, proto.body, min(args.wrk_threads, c))
                row = {"concurrency": c, "rows_per_s": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}
                row["errors"] = r["non_2xx"]
                print(json.dumps({"peer": "pytriton", **row}), flush=True)
                run["levels"].append(row)
        if args.poisson:
            run["poisson"] = poisson_run(url + proto.path, proto, args, start)
        return run
    finally:
        # A peer that already exited (it failed to start: its log says why) has no process group left to signal.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(peer.pid, signal.SIGTERM)
        try:
            peer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(peer.pid, signal.SIGKILL)
            peer.wait()


def poisson_start(summary: dict[str, Any], prec: str) -> float:
    """Where the sweep starts unless told: half the server's rows/s at its lowest concurrency (a closed loop of
    that many clients sustains it, so an open loop at half should pass), at least 1."""
    levels = [r for r in summary["levels"] if r["precision"] == prec]
    return max(1.0, min(levels, key=lambda r: r["concurrency"])["rows_per_s"] / 2) if levels else 10.0


def _round(entries: list[str], i: int) -> str:
    """`` (n)`` for the n-th sweep of an entry that ``entries`` holds more than once, else nothing."""
    return f" ({entries[: i + 1].count(entries[i])})" if entries.count(entries[i]) > 1 else ""


def free_port() -> int:
    """A port nothing on this host listens on now: the sweep may run beside other servers (tests, other sweeps)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu(pid: int) -> float:
    """CPU seconds used by ``pid`` and its children (the front-end processes), from ``/proc``."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(c) for c in text.split()]


def best_upto(rates: dict[str, float], limit: int) -> float:
    """The best rate at a batch size the server could form with ``limit`` requests in flight."""
    eligible = [v for k, v in rates.items() if int(k) <= limit]
    return max(eligible) if eligible else max(rates.values())


def forward_batch(concurrency: int, instances: int, sizes: list[int]) -> int:
    """The batch the forward runs when ``concurrency`` requests are spread over ``instances``: c / instances rows
    (rounded up), padded to the smallest measured batch size holding them (the engine pads to buckets), at most the
    largest measured."""
    rows = -(-concurrency // max(1, instances))
    return min(bucket_for(rows, sorted(sizes)), max(sizes))


def summarize(
    sweep: dict[str, Any],
    ceilings: dict[str, dict[str, float]],
    half: str,
    instances: dict[str, Any] | None,
    loops: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Server / ceiling per precision and concurrency, and half / fp32 at each concurrency.

    The ceiling at concurrency c is the single-instance Engine's best rate at a batch size <= c (the largest batch
    c requests in flight can form); beside it, for the precision the instance sweep ran (the half one when
    measured), the rate of as many in-process instances as the server runs, driven flat out at batch 64. The two
    that match the question at c: the in-process closed loop of c clients with the server's instances
    (``loops``, :func:`closed_loops`), and the forward at the batch c allows (:func:`forward_batch`, one instance).
    """
    n_instances = int(instances["server_instances"]) if instances else 1
    table: list[dict[str, Any]] = []
    served: dict[tuple[str, int], float] = {}
    multi = instances["rows_per_s"].get(str(instances["server_instances"])) if instances else None
    swept = instances.get("precision", half) if instances else None
    for r in sweep["results"]:
        p, c = r["precision"], r["concurrency"]
        served[(p, c)] = r["rows_per_s"]
        ceil = best_upto(ceilings[p], c)
        row = {
            "precision": p,
            "concurrency": c,
            "rows_per_s": round(r["rows_per_s"], 1),
            "p50_ms": r["p50_ms"],
            "p99_ms": r["p99_ms"],
            "mean_batch": r["mean_batch_size"],
            "errors": r["errors"],
            "ceiling_rows_per_s": round(ceil, 1),
            "server_over_ceiling": round(r["rows_per_s"] / ceil, 3),
            "client_bound": r["client_bound"],
            "server_cpu_percent": r["server_cpu_percent"],
        }
        if p == swept and multi:
            row["server_over_instances_ceiling"] = round(r["rows_per_s"] / multi, 3)
        b = forward_batch(c, n_instances, [int(k) for k in ceilings[p]])
        row["forward_batch"] = b
        row["forward_rows_per_s"] = round(ceilings[p][str(b)], 1)
        row["server_over_forward"] = round(r["rows_per_s"] / ceilings[p][str(b)], 3)
        loop = (loops or {}).get(p, {}).get(str(c))
        if loop:
            row["closed_loop_rows_per_s"] = loop["rows_per_s"]
            row["closed_loop_p99_ms"] = loop["p99_ms"]
            row["closed_loop_mean_batch"] = loop["mean_batch"]
            row["server_over_closed_loop"] = round(r["rows_per_s"] / loop["rows_per_s"], 3)
        table.append(row)
    ratio = {
        str(c): round(served[(half, c)] / served[("fp32", c)], 3)
        for (p, c) in served
        if p == half and ("fp32", c) in served and served[("fp32", c)] > 0
    }
    return {"levels": table, f"{half}_over_fp32": ratio, "instances_ceiling_rows_per_s": multi}


def markdown(result: dict[str, Any], half: str) -> str:
    m = result["machine"]
    swept = result.get("instances", {}).get("precision", half)  # the instance sweep's precision (older runs: half)
    lines = [
        f"# GPU fast path: {MODEL} {result['input_shape']} on {m.get('gpu', m['cpu'])}",
        "",
        f"torch {m['torch']}, CUDA {m.get('cuda')}, TF32 for fp32: {result['tf32']}, allocator {m['allocator']}; "
        f"load: {result['load_generator']}",
        "",
        "## In-process ceiling (rows/s through the Engine: numpy in, staged, copied, cast, forward, numpy out)",
        "",
        "| mode | " + " | ".join(result["batch_sizes_str"]) + " | capture or compile s | weight MB |",
        "|---|" + "---:|" * (len(result["batch_sizes_str"]) + 2),
    ]
    for label, c in result["ceiling_runs"].items():
        rates = " | ".join(f"{c['engine_rows_per_s'].get(b, float('nan')):.0f}" for b in result["batch_sizes_str"])
        build = c["graph_capture_seconds"] + c.get("inductor_compile_seconds", 0.0)
        lines.append(f"| {label} | {rates} | {build:.2f} | {c['weight_bytes'] / 1e6:.1f} |")
        if "device_forward_rows_per_s" in c:
            dev = " | ".join(f"{c['device_forward_rows_per_s'][b]:.0f}" for b in result["batch_sizes_str"])
            lines.append(f"| {label}, bare device forward | {dev} | | |")
    if result.get("instances"):
        lines += ["", f"## Instances at batch {result['instances']['batch']} ({swept}, rows/s)", ""]
        lines += ["| instances | rows/s |", "|---:|---:|"]
        lines += [f"| {n} | {v:.0f} |" for n, v in result["instances"]["rows_per_s"].items()]
    for label, server in result.get("servers", {}).items():
        summary, wire = server["summary"], server["wire"]
        args = " ".join(server["server_args"]) or "defaults"
        lines += ["", f"## Server {label}: KServe V2 binary, one {wire.upper()} image per request; {args}", ""]
        lines += [
            f"Execution: {json.dumps(result['server_execution'])}; {swept} in-process with as many instances at "
            f"batch {result['instances']['batch']}: {summary['instances_ceiling_rows_per_s'] or 0:.0f} rows/s.",
            "",
            "| precision | concurrency | rows/s | p50 ms | p99 ms | mean batch | server CPU % | ceiling "
            "| server / ceiling | server / instances ceiling | closed loop rows/s | closed loop p99 ms "
            "| server / closed loop | forward batch | server / forward |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in summary["levels"]:
            mark = " (client-bound)" if r["client_bound"] else ""
            lines.append(
                f"| {r['precision']} | {r['concurrency']} | {r['rows_per_s']:.0f}{mark} | {r['p50_ms']:.1f} "
                f"| {r['p99_ms']:.1f} | {r['mean_batch'] or 0:.1f} | {r['server_cpu_percent'] or 0:.0f} "
                f"| {r['ceiling_rows_per_s']:.0f} | {r['server_over_ceiling']:.3f} "
                f"| {cell(r.get('server_over_instances_ceiling'), '.3f')} "
                f"| {cell(r.get('closed_loop_rows_per_s'), '.0f')} | {cell(r.get('closed_loop_p99_ms'), '.1f')} "
                f"| {cell(r.get('server_over_closed_loop'), '.3f')} | {r.get('forward_batch', '')} "
                f"| {cell(r.get('server_over_forward'), '.3f')} |"
            )
        lines += ["", f"{half} / fp32 (server rows/s): " + json.dumps(summary[f"{half}_over_fp32"])]
    for name, peer in result.get("peers", {}).items():
        ours = {
            r["concurrency"]: r
            for r in result["servers"][peer["beside"]]["summary"]["levels"]
            if r["precision"] == peer["precision"]
        }
        lines += [
            "",
            f"## Peer {name}, {peer['precision']}, {peer['instances']} instance(s), max batch "
            f"{peer['max_batch_size']}, one {peer['wire'].upper()} image per request, the same client; beside server "
            f"{peer['beside']}",
            "",
            f"Ready in {peer['ready_seconds']:g} s (every batch size warmed); its answer against halfserve's Engine: "
            f"max |diff| {peer['answer_max_abs_diff_from_halfserve']:g}, top class agrees: "
            f"{peer['answer_argmax_agrees']}.",
            "",
            f"| concurrency | {name} rows/s | {name} p50 ms | {name} p99 ms | errors | halfserve rows/s "
            f"| halfserve p99 ms | halfserve / {name} |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in peer["levels"]:
            h = ours.get(r["concurrency"])
            ratio = h["rows_per_s"] / r["rows_per_s"] if h and r["rows_per_s"] else None
            lines.append(
                f"| {r['concurrency']} | {r['rows_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} "
                f"| {cell(h and h['rows_per_s'], '.0f')} | {cell(h and h['p99_ms'], '.1f')} | {cell(ratio, '.3f')} |"
            )
    for name, run in result.get("poisson", {}).items():
        best = run["best_rate"]
        lines += [
            "",
            f"## Poisson arrivals, {name}: highest rate with p99 <= {run['limit_ms']:g} ms: "
            f"{'none passed' if best is None else f'{best:.0f} requests/s'}",
            "",
            f"{run['precision']}, one {run['wire'].upper()} image per request, server flags: "
            f"{' '.join(run['server_args']) or 'defaults'}; {run['client']}; sweep ended: {run['stopped']} after "
            f"{run['seconds']:g} s.",
            "",
            "| offered req/s | answered req/s | p50 ms | p99 ms | errors | client send lag p99 ms |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for t in run["trials"]:
            lines.append(
                f"| {t['rate']:.1f} | {t['answered_per_s']:.1f} | {cell(t['p50_ms'], '.1f')} "
                f"| {cell(t['p99_ms'], '.1f')} | {t['errors']} | {t['send_lag_p99_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def cell(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted, or empty where a run did not measure it (older runs, a level skipped)."""
    return "" if value is None else format(value, spec)


def plot(result: dict[str, Any], path: Path, half: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ax = axes[0]
    for label, c in result["ceiling_runs"].items():
        sizes = [int(b) for b in c["engine_rows_per_s"]]
        ax.plot(sizes, list(c["engine_rows_per_s"].values()), marker="o", label=label)
    ax.set(xscale="log", xlabel="batch size", ylabel="rows/s", title="in-process ceiling (Engine, one instance)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for n, (name, server) in enumerate(result.get("servers", {}).items()):
        summary = server["summary"]
        style = ["-", ":", "-."][n % 3]
        for p in result["precisions"]:
            levels = [r for r in summary["levels"] if r["precision"] == p]
            cs = [r["concurrency"] for r in levels]
            label = f"{p}, {name}"
            (line,) = axes[1].plot(cs, [r["rows_per_s"] for r in levels], marker="o", ls=style, label=label)
            if n == 0:
                ceil = [r["ceiling_rows_per_s"] for r in levels]
                axes[1].plot(cs, ceil, ls="--", color=line.get_color(), alpha=0.6, label=f"ceiling {p}")
            ratios = [r["server_over_ceiling"] for r in levels]
            axes[2].plot(cs, ratios, marker="o", ls=style, label=f"server / ceiling, {label}")
        ratio = summary[f"{half}_over_fp32"]
        if ratio:
            xs = [int(c) for c in ratio]
            axes[2].plot(xs, list(ratio.values()), marker="s", color="k", ls=style, label=f"{half} / fp32, {name}")
            for c, v in ratio.items():
                axes[2].annotate(
                    f"{v:.2f}", (int(c), v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7
                )
    if result.get("servers"):
        axes[1].set(xscale="log", xlabel="concurrency (one image per request)", ylabel="rows/s", title="server")
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[2].set(xscale="log", xlabel="concurrency", ylabel="ratio", title=f"server / ceiling and {half} / fp32")
        for ax in axes[1:]:
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
    m = result["machine"]
    fig.suptitle(
        f"{MODEL} {result['input_shape']} on {m.get('gpu', m['cpu'])}; torch {m['torch']}, CUDA {m.get('cuda')}, "
        f"TF32 {'on' if result['tf32'] else 'off'} for fp32",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-sizes", type=ints, default=None, help="default: 1,2,4,...,256 (CUDA) or 1,2,4,8,16")
    p.add_argument("--precisions", default=None, help="default: fp16,fp32 on CUDA, bf16,fp32 on a CPU")
    p.add_argument("--seconds", type=float, default=1.0, help="per ceiling measurement (default: 1)")
    p.add_argument("--instances", type=int, default=2, help="server engine instances (default: 2)")
    p.add_argument("--instance-counts", type=ints, default=[1, 2, 3], help="in-process instance sweep")
    p.add_argument(
        "--compile",
        choices=["auto", "none", "cuda_graphs"],
        default="auto",
        help="server: auto takes CUDA graphs where they measured faster in-process",
    )
    p.add_argument("--concurrency", type=ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per server level")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each server level")
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument("--client-ceiling", type=float, default=2.0)
    p.add_argument(
        "--wires",
        default="fp32",
        help="input datatypes the server is swept with, of fp32,fp16,uint8 (FP16 halves the bytes, UINT8 quarters)",
    )
    p.add_argument(
        "--baseline-switch-interval-ms",
        type=float,
        default=None,
        help="also sweep the server with this GIL switch interval (Python's default is 5) to measure the setting",
    )
    p.add_argument("--http-workers", type=int, default=1, help="server front-end processes (default: 1)")
    p.add_argument(
        "--serve-args",
        default="",
        help="more halfserve serve flags for every server swept, as one string (--serve-args='--threads 4')",
    )
    p.add_argument(
        "--load-generator",
        choices=["loadtest", "wrk"],
        default="loadtest",
        help="halfserve loadtest's client processes, or wrk (C: for rates a Python client cannot send)",
    )
    p.add_argument("--wrk-threads", type=int, default=8)
    p.add_argument(
        "--isolations",
        default="",
        help="sweep the server once per entry with its instances as threads or processes, in this order "
        "(--isolations thread,process,thread,process interleaves two rounds); default: one sweep, the server's default",
    )
    p.add_argument("--skip-server", action="store_true")
    p.add_argument(
        "--poisson",
        action="store_true",
        help="also find the highest request rate with p99 <= --p99-limit-ms under Poisson arrivals (open loop), "
        "against the first server swept, in its first precision",
    )
    p.add_argument(
        "--peer",
        choices=["pytriton"],
        default=None,
        help="also serve the same model with PyTriton (benchmarks/pytriton_peer.py; fp16 on CUDA, fp32 on a CPU) and "
        "drive it with the same clients: the levels (with --load-generator wrk) and the Poisson sweep",
    )
    p.add_argument(
        "--pytriton-python",
        default=os.environ.get("PYTRITON_PYTHON", "python3"),
        help="an interpreter with nvidia-pytriton, torch, safetensors and pydantic (default: $PYTRITON_PYTHON)",
    )
    p.add_argument(
        "--peer-max-batch",
        type=int,
        default=None,
        help="the peer's largest batch, every size up to it warmed before measuring (default: the manifest's)",
    )
    p.add_argument("--peer-start-timeout", type=float, default=300.0, help="seconds for the peer to get ready")
    p.add_argument("--p99-limit-ms", type=float, default=15.0, help="the Poisson sweep's p99 limit (default: 15)")
    p.add_argument("--poisson-start", type=float, default=None, help="first rate (default: half the lowest level's)")
    p.add_argument("--poisson-seconds", type=float, default=3.0, help="measured seconds per rate (default: 3)")
    p.add_argument("--poisson-warmup", type=float, default=1.0, help="unmeasured seconds per rate (default: 1)")
    p.add_argument("--poisson-budget", type=float, default=60.0, help="seconds for the whole sweep (default: 60)")
    p.add_argument("--poisson-steps", type=int, default=8, help="at most this many rates (default: 8)")
    p.add_argument(
        "--poisson-processes", type=int, default=None, help="client processes (default: 4 on CUDA, 1 on a CPU)"
    )
    p.add_argument(
        "--inductor",
        action="store_true",
        help="also measure forwards compiled by TorchInductor in-process (execution.compile inductor)",
    )
    p.add_argument(
        "--architecture",
        default="resnet50",
        help="resnet50 (registered, torchvision's layers; default) or torchvision:resnet50 (needs torchvision)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tmp" / "gpu_bench")
    args = p.parse_args()
    if args.load_generator == "wrk" and not (args.duration.is_integer() and args.warmup.is_integer()):
        p.error("--load-generator wrk takes whole seconds for --duration and --warmup (wrk -d)")

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cuda = device.type == "cuda"
    args.device = str(device)
    if args.poisson_processes is None:
        args.poisson_processes = 4 if cuda else 1
    half = "fp16" if cuda else "bf16"
    precisions = args.precisions.split(",") if args.precisions else [half, "fp32"]
    sizes = args.batch_sizes or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 2, 4, 8, 16])
    set_tf32(False)
    tune_cudnn(device, fixed_shapes=True)  # its engines pad to buckets, as the server's lifespan would set
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    try:
        t0 = time.perf_counter()
        eager = Execution(instances=1, compile=Compile.NONE, pad_to_bucket=True)
        graphs = eager.model_copy(update={"compile": Compile.CUDA_GRAPHS})
        loaded = build_store(tmp, args.image_size, max(sizes), eager, args.architecture)
        print(f"built {MODEL} in {time.perf_counter() - t0:.1f}s", flush=True)
        result: dict[str, Any] = {
            "model": MODEL,
            "input_shape": [3, args.image_size, args.image_size],
            "parameters": sum(q.numel() for q in loaded.module.parameters()),
            "device": str(device),
            "precisions": precisions,
            "batch_sizes": sizes,
            "batch_sizes_str": [str(b) for b in sizes],
            "tf32": False,
            "machine": hostinfo.describe(),
            "load_generator": (
                f"wrk -t{args.wrk_threads}, one keep-alive connection per virtual user, KServe V2 binary tensor, one "
                "image per request, on the same host"
                if args.load_generator == "wrk"
                else f"halfserve loadtest client: {args.client_processes} processes (httpx, uvloop), one keep-alive "
                "connection and one request in flight per virtual user, KServe V2 binary tensor (an image of the "
                "input's declared datatype), one image per request, on the same host"
            ),
            "ceiling_runs": {},
            "ceiling": {},
            "servers": {},
        }
        runs = result["ceiling_runs"]
        for prec in precisions:
            runs[f"{prec} eager"] = ceiling(loaded, prec, device, sizes, args.seconds, eager, device_only=cuda)
            if cuda:
                runs[f"{prec} CUDA graphs"] = ceiling(loaded, prec, device, sizes, args.seconds, graphs)
            if args.inductor:
                inductor = eager.model_copy(update={"compile": Compile.INDUCTOR})
                runs[f"{prec} inductor"] = ceiling(loaded, prec, device, sizes, args.seconds, inductor)
        if cuda and args.architecture == "resnet50":
            set_tf32(True)
            runs["fp32 eager, TF32 on"] = ceiling(loaded, "fp32", device, sizes, args.seconds, eager)
            set_tf32(False)
            # The model's own channels_last (weights and input) and the engine's, both off: plain NCHW.
            nchw_module = models.build("resnet50", num_classes=1000, channels_last=False)
            nchw_module.load_state_dict(loaded.module.state_dict())
            nchw = LoadedModel(loaded.manifest, loaded.version, nchw_module.eval(), loaded.path)
            no_cl = eager.model_copy(update={"channels_last": False})
            runs[f"{half} eager, NCHW"] = ceiling(nchw, half, device, sizes, args.seconds, no_cl)
        use_graphs = False
        if cuda and args.compile != "none":
            # Graphs win big at small batches (launch-bound) and roughly tie at large ones: take them when their mean
            # speed-up over the batch sizes the server forms at moderate load (<= 64) is above 1.
            g, e = runs[f"{half} CUDA graphs"]["engine_rows_per_s"], runs[f"{half} eager"]["engine_rows_per_s"]
            gains = [g[str(b)] / e[str(b)] for b in sizes if b <= 64]
            use_graphs = args.compile == "cuda_graphs" or sum(gains) / len(gains) > 1.0
        server_ex = (graphs if use_graphs else eager).model_copy(update={"instances": args.instances})
        for prec in precisions:
            mode = f"{prec} CUDA graphs" if use_graphs else f"{prec} eager"
            rates = runs[mode]["engine_rows_per_s"]
            result["ceiling"][prec] = {"mode": mode, "best_engine_rows_per_s": rates}
        result["server_execution"] = server_ex.model_dump(mode="json")
        batch = min(64, max(sizes))
        mode_ex = graphs if use_graphs else eager
        # The half precision's when it is measured; else the first asked for (not a precision nobody asked for).
        swept = half if half in precisions else precisions[0]
        result["instances"] = {
            "batch": batch,
            "precision": swept,
            "execution": mode_ex.model_dump(mode="json"),
            "rows_per_s": instances_rate(loaded, swept, device, batch, args.instance_counts, args.seconds * 2, mode_ex),
        }
        result["weight_bytes"] = {prec: runs[f"{prec} eager"]["weight_bytes"] for prec in precisions}
        result["instances"]["server_instances"] = args.instances
        write(result, args.out, half)  # the in-process part survives a server sweep that fails or runs out of time
        result["servers"] = {}
        flags = ("--http-workers", str(args.http_workers)) if args.http_workers > 1 else ()
        flags += tuple(shlex.split(args.serve_args))
        plans = [(wire, wire, flags) for wire in args.wires.split(",")]
        if args.isolations:
            isolations = args.isolations.split(",")
            plans = [
                (
                    f"{label}, instances as {iso}es{_round(isolations, i)}"
                    if iso == "process"
                    else f"{label}, instances as {iso}s{_round(isolations, i)}",
                    wire,
                    (*extra, "--placement", f"instance_{iso}{'es' if iso == 'process' else 's'}"),
                )
                for label, wire, extra in plans
                for i, iso in enumerate(isolations)
            ]
        if args.baseline_switch_interval_ms:
            ms = args.baseline_switch_interval_ms
            plans.append(
                (f"fp32, GIL switch interval {ms:g} ms", "fp32", (*flags, "--gil-switch-interval-ms", f"{ms:g}"))
            )
        wired_ceilings: dict[str, dict[str, dict[str, float]]] = {}  # measured once per wire, whatever the sweeps
        result["closed_loop"] = {}  # per wire, as the ceilings: the same clients whatever the server's flags
        for label, wire, extra in [] if args.skip_server else plans:
            ceilings = {prec: result["ceiling"][prec]["best_engine_rows_per_s"] for prec in precisions}
            if wire != "fp32" and wire in wired_ceilings:
                ceilings = wired_ceilings[wire]
            elif wire != "fp32":
                wired = LoadedModel(with_wire(loaded.manifest, wire), loaded.version, loaded.module, loaded.path)
                for prec in precisions:
                    run_label = f"{result['ceiling'][prec]['mode']}, {wire} input"
                    runs[run_label] = ceiling(wired, prec, device, sizes, args.seconds, mode_ex)
                    ceilings[prec] = runs[run_label]["engine_rows_per_s"]
                wired_ceilings[wire] = ceilings
            if wire not in result["closed_loop"]:
                wired = LoadedModel(with_wire(loaded.manifest, wire), loaded.version, loaded.module, loaded.path)
                loop_ex = mode_ex.model_copy(update={"instances": args.instances})
                loop_seconds = max(args.seconds, 0.5)
                result["closed_loop"][wire] = closed_loops(
                    wired, precisions, device, loop_ex, args.concurrency, loop_seconds
                )
            set_manifest(tmp, server_ex, wire)
            folder = args.out / ("loadtest-" + "".join(ch if ch.isalnum() else "-" for ch in label).strip("-"))
            if args.load_generator == "wrk":
                sweep = wrk_sweep(tmp, args, precisions, wire, folder, extra)
            else:
                sweep = serve_sweep(tmp, args, precisions, folder, extra)
            summary = summarize(sweep, ceilings, half, result["instances"], result["closed_loop"][wire])
            result["servers"][label] = {"wire": wire, "server_args": list(extra), "summary": summary, "loadtest": sweep}
            write(result, args.out, half)
            if args.poisson and "poisson" not in result:
                prec = precisions[0]
                start = args.poisson_start or poisson_start(summary, prec)
                run = server_poisson(tmp, args, prec, wire, extra, start, args.out / "poisson")
                result["poisson"] = {"halfserve": run}
                write(result, args.out, half)
        if args.peer == "pytriton" and plans and not args.skip_server:
            label, wire, extra = plans[0]
            set_manifest(tmp, server_ex, wire)
            halfserve_trials = result.get("poisson", {}).get("halfserve", {}).get("trials")
            start = args.poisson_start or (halfserve_trials[0]["rate"] if halfserve_trials else 10.0)
            peer_prec = "fp16" if cuda else "fp32"
            peer = peer_pytriton(tmp, args, peer_prec, wire, device, start, args.out / "pytriton")
            if "poisson" in peer:
                result.setdefault("poisson", {})["pytriton"] = {
                    "precision": peer_prec,
                    "wire": wire,
                    "server_args": [],
                    **peer.pop("poisson"),
                }
            result["peers"] = {"pytriton": {**peer, "beside": label}}
            write(result, args.out, half)
        result["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(write(result, args.out, half))


def write(result: dict[str, Any], out: Path, half: str) -> str:
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result, half)
    (out / "gpu_bench.md").write_text(md)
    plot(result, out / "gpu_bench.png", half)
    return md


if __name__ == "__main__":
    main()
