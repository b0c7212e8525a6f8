"""Serving-path cost: CPU time per request in each part of the server under wrk, compared between source trees.

Everything but the model's forward is the serving path: HTTP parsing and encoding in the front-ends, the backplane
hop, batching and answering on the engine process's event loop. On a GPU host it decides how far the server stays
from the device's ceiling (docs/gpu.md, "Where the time goes at concurrency 64"); here it is measured where no GPU
is needed, as CPU seconds per request (from /proc) of:

  * ``event_loop``: the engine process's main thread (the backplane, the batchers, answering);
  * ``engine_threads``: the engine process's other threads (instances, torch's intra-op pool);
  * ``front_ends``: the front-end processes together;
  * ``wrk``: the load generator;

with the request rate and the mean batch. The default workload is the serving path's worst case per row: one
224x224 RGB image per request as UINT8 (150 KB, KServe V2 binary, binary output) into a model whose forward is cheap
(an MLP with one hidden layer of 8 units after ImageNet normalisation on the device).

Source trees run interleaved (A, B, A, B, ...), since runs on a shared host move by 10-20% between minutes; a rev is
a commit, checked out in a temporary git worktree, or ``.`` for this working tree:

    python benchmarks/path_cost.py --revs HEAD~1,. --rounds 3 --out /tmp/path-cost

``--protocols`` (comma-separated) compares ways of sending the image, interleaved too; ``v2-shm`` sends it through the
system shared memory extension: the server reads it from a registered region (one region, read by every request), so
only a few hundred bytes of JSON travel per request:

    python benchmarks/path_cost.py --protocols v2-binary,v2-shm --rounds 3

``--variants`` compares server options the same way (each one's runs for every rev); a ``NAME=value`` word in a
variant sets an environment variable of the server instead (``--variants=OMP_WAIT_POLICY=PASSIVE``):

    python benchmarks/path_cost.py --model resnet_bench --store model_store --http-workers 1 \
        --variants="--threads 1" --variants="--threads 2"
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import tempfile
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import common
import httpx
import numpy as np
import torch
from common import IMAGENET

from halfserve import hostinfo, models, store
from halfserve.execution import Batching
from halfserve.manifest import DataType, Manifest, TensorSpec, load_manifest

MODEL = "image_mlp"
PARTS = ("event_loop", "engine_threads", "front_ends", "wrk")
HZ = os.sysconf("SC_CLK_TCK")


def build_store(root: Path) -> None:
    """The default workload's model: UINT8 3x224x224 images, ImageNet normalisation, an MLP 150528 -> 8 -> 1000."""
    kwargs = {"in_features": 3 * 224 * 224, "hidden": [8], "out_features": 1000}
    manifest = Manifest(
        name=MODEL,
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="image", datatype=DataType.UINT8, shape=[3, 224, 224])],
        outputs=[TensorSpec(name="logits", shape=[1000])],
        normalize=IMAGENET,
        batching=Batching(max_batch_size=64, max_delay_ms=2.0),
        description="Random weights (seed 0): a big input into a cheap forward, for serving-path benchmarks.",
    )
    torch.manual_seed(0)
    store.save(root, manifest, models.build("mlp", **kwargs), version=1)


def cpu_seconds(stat: str) -> float:
    """utime + stime of a ``/proc/.../stat`` file (a process's counts all its threads, a task's only its own)."""
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # a process that just ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / HZ


def front_ends(pid: int) -> list[int]:
    """The engine process's front-end children (spawned processes; not multiprocessing's resource tracker)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except FileNotFoundError:
            continue
    return found


def server_cpu(pid: int) -> dict[str, float]:
    loop = cpu_seconds(f"/proc/{pid}/task/{pid}/stat")
    return {
        "event_loop": loop,
        "engine_threads": cpu_seconds(f"/proc/{pid}/stat") - loop,
        "front_ends": sum(cpu_seconds(f"/proc/{k}/stat") for k in front_ends(pid)),
    }


def children_cpu() -> float:
    """CPU seconds of this process's finished children (wrk, once it has been waited for)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(args: argparse.Namespace, source: Path, variant: str, proto: common.Protocol) -> dict[str, Any]:
    """One server of the tree at ``source`` with the options ``variant`` adds: warm up, then one wrk run with every
    part's CPU time around it."""
    server_args = ["--http-workers", str(args.http_workers), "--precision", args.precision, "--log-level", "warning"]
    words = variant.split()
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    server_args += [w for w in words if "=" not in w or w.startswith("-")]
    if proto.name == "v2-shm":
        server_args += ["--admin-token", SHM_TOKEN]
    proc = common.start_server(args.store, args.model, args.port, *server_args, source=source, env=env)
    url = f"http://127.0.0.1:{args.port}{proto.path}"
    try:
        if proto.name == "v2-shm":
            register_region(args.port, args.region)
        common.wrk(url, args.concurrency, 2, proto.script, proto.body)
        before, wrk_before, batches_before = (
            server_cpu(proc.pid),
            children_cpu(),
            common.stats(args.port, args.model),
        )
        result = common.wrk(url, args.concurrency, args.duration, proto.script, proto.body)
        after, wrk_after, batches_after = server_cpu(proc.pid), children_cpu(), common.stats(args.port, args.model)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    n = result["requests"]
    cpu = {part: (after[part] - before[part]) / n * 1e6 for part in PARTS[:-1]}
    cpu["wrk"] = (wrk_after - wrk_before) / n * 1e6
    batches = batches_after["batches"] - batches_before["batches"]
    rows = batches_after["rows"] - batches_before["rows"]
    return {**result, "mean_batch": rows / batches if batches else 0.0, "cpu_us_per_request": cpu}


SHM_TOKEN = "path-cost-admin-token"
SHM_REGION = "image"


def shm_protocol(
    model: str, input_name: str, sample: np.ndarray, datatype: str, folder: Path
) -> tuple[common.Protocol, shared_memory.SharedMemory]:
    """A V2 request naming ``sample`` in a shared memory object (written here) instead of carrying it."""
    raw = sample.astype(common.WIRE_DTYPES[datatype]).tobytes()
    region = shared_memory.SharedMemory(create=True, size=len(raw))
    region.buf[: len(raw)] = raw
    params = {"shared_memory_region": SHM_REGION, "shared_memory_byte_size": len(raw)}
    tensor = {"name": input_name, "shape": [1, *sample.shape], "datatype": datatype, "parameters": params}
    body = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
    # Naming a region needs the admin token, as registering it does.
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {SHM_TOKEN}"}
    proto = common.write_protocol("v2-shm", f"/v2/models/{model}/infer", body, headers, folder)
    return proto, region


def register_region(port: int, region: shared_memory.SharedMemory) -> None:
    r = httpx.post(
        f"http://127.0.0.1:{port}/v2/systemsharedmemory/region/{SHM_REGION}/register",
        json={"key": "/" + region.name.lstrip("/"), "byte_size": region.size},
        headers={"Authorization": f"Bearer {SHM_TOKEN}"},
    )
    r.raise_for_status()


def summary(result: dict[str, Any]) -> str:
    lines = [
        "| rev | commit | options | protocol | req/s | mean batch | " + " | ".join(f"{p} us/req" for p in PARTS) + " |",
        "|---|---|---|---|---:|---:|" + "---:|" * len(PARTS),
    ]
    cases = itertools.product(result["revs"].items(), result["variants"], result["protocols"])
    for (rev, commit), variant, protocol in cases:
        runs = [r for r in result["runs"] if (r["rev"], r["variant"], r["protocol"]) == (rev, variant, protocol)]
        med = {p: statistics.median(r["cpu_us_per_request"][p] for r in runs) for p in PARTS}
        rps = statistics.median(r["rps"] for r in runs)
        batch = statistics.median(r["mean_batch"] for r in runs)
        cells = " | ".join(f"{med[p]:.0f}" for p in PARTS)
        lines.append(f"| {rev} | {commit} | {variant or '-'} | {protocol} | {rps:.0f} | {batch:.1f} | {cells} |")
    rounds = len(result["runs"]) // max(1, len(result["revs"]) * len(result["variants"]) * len(result["protocols"]))
    lines.append(f"\nMedians of {rounds} interleaved rounds; every run is in the JSON.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revs", default=".", type=lambda s: s.split(","), help="comma-separated (default: .)")
    p.add_argument("--variants", action="append", help="server options to compare, one flag each (default: none added)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--protocols",
        default=["v2-binary"],
        type=lambda s: s.split(","),
        help=f"comma-separated, of {', '.join([*common.PROTOCOLS, 'v2-shm'])} (default: v2-binary)",
    )
    p.add_argument("--http-workers", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--store", type=Path, help="model store (default: the workload above, built in a temp folder)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--port", type=int, default=8472)
    p.add_argument("--out", type=Path, help="path prefix for .json and .md")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="path-cost-"))
    if args.store is None:
        args.store = tmp / "store"
        build_store(args.store)
    spec = load_manifest(args.store / args.model).inputs[0]
    rng = np.random.default_rng(0)
    sample = rng.integers(0, 256, spec.shape) if spec.datatype is DataType.UINT8 else rng.uniform(0, 1, spec.shape)
    args.region = None
    protos: dict[str, common.Protocol] = {}
    for name in args.protocols:
        if name == "v2-shm":
            protos[name], args.region = shm_protocol(args.model, spec.name, sample, spec.datatype.value, tmp)
        else:
            protos[name] = common.make_protocol(name, args.model, spec.name, sample, tmp, spec.datatype.value)
    trees: dict[str, Path] = {}
    result: dict[str, Any] = {
        "workload": {"model": args.model, "input": spec.model_dump(mode="json")},
        "server": {"http_workers": args.http_workers, "precision": args.precision},
        "load_generator": f"wrk -t1 -c{args.concurrency}, {args.duration:g} s per run",
        "machine": hostinfo.describe(),
        "revs": {},
        "variants": args.variants or [""],
        "protocols": args.protocols,
        "runs": [],
    }
    try:
        for i, rev in enumerate(args.revs):
            trees[rev], result["revs"][rev] = common.checkout(rev, tmp / f"tree-{i}")
        for r in range(args.rounds):
            for rev, variant, protocol in itertools.product(args.revs, result["variants"], args.protocols):
                run = {"rev": rev, "variant": variant, "protocol": protocol, "round": r}
                run |= measure(args, trees[rev], variant, protos[protocol])
                print(json.dumps(run), flush=True)
                result["runs"].append(run)
    finally:
        if args.region is not None:
            args.region.close()
            args.region.unlink()
        for tree in trees.values():
            common.remove_checkout(tree)
    md = summary(result)
    print(md)
    if args.out is not None:
        common.write_results(args.out, result, md)


if __name__ == "__main__":
    main()
