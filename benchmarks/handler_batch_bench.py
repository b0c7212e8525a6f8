"""A team's handler called per HTTP request against per batch (issue 51): one small photo model, JPEG bodies on
``/predictions`` at c=16, the source trees of two revisions (the one before handler batches and this one) served in
turn from fresh servers, rounds interleaved.

The model: ``small_cnn`` (width 16) on 3x64x64 pixels, seeded random weights. Its handler (written to a
``--code-path`` folder here) decodes each JPEG with Pillow, resizes it to 64x64 and scales it, and answers the top
class and its probability: what a team's own photo handler does. The photo: a 640x480 JPEG (quality 90), the same one
in every request.

Load: torchserve_bench.py's closed loop in this process (httpx, ``c`` workers, a warm-up, every status checked), one
photo per request (rows/s is requests/s): p50 and p99, the server's CPU per request (its process group, from
``/proc``) and the model's mean batch from its stats. Each run starts a fresh server.

    python benchmarks/handler_batch_bench.py --revs 0e21536,. --out benchmarks/results/handler-batch-cpu

With ``--placement instance_processes``, the same against the revision before a handler batch ran in the instance
process (its calls on the server process's handler threads):

    python benchmarks/handler_batch_bench.py --revs c315fd9,. --calls "server threads,instance process" \
      --placement instance_processes --out benchmarks/results/handler-instance-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import common
import numpy as np
import torchserve_bench
from PIL import Image

HANDLER = textwrap.dedent(
    '''
    """JPEG bodies in, 64x64 RGB pixels scaled to [0, 1]; the top class and its probability out."""
    import io

    import numpy as np
    from PIL import Image


    class Photos:
        def preprocess(self, requests):
            rows = []
            for request in requests:
                with Image.open(io.BytesIO(request.get("data") or request.get("body"))) as opened:
                    image = opened.convert("RGB").resize((64, 64), Image.Resampling.BILINEAR)
                rows.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255)
            return np.stack(rows)

        def postprocess(self, outputs, requests):
            answers = []
            for row in outputs:
                p = np.exp(row - row.max())
                p /= p.sum()
                answers.append({"class": int(p.argmax()), "probability": float(p.max())})
            return answers
    '''
)
MODEL = "photos"


def build_store(root: Path, code: Path) -> None:
    """The model's seeded weights imported with the handler, by this tree's ``halfserve import``."""
    import torch
    from safetensors.torch import save_file

    from halfserve import models

    code.mkdir(parents=True, exist_ok=True)
    (code / "photo_handler.py").write_text(HANDLER)
    torch.manual_seed(0)
    kwargs = {"in_channels": 3, "num_classes": 10, "width": 16}
    module = models.build("small_cnn", **kwargs)
    weights = root.parent / "photos.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
    cmd = ["import", str(weights), "--name", MODEL, "--architecture", "small_cnn", "--arch-kwargs", json.dumps(kwargs)]
    cmd += ["--input", "pixels:FP32:3x64x64", "--handler", "photo_handler:Photos", "--code-path", str(code)]
    cmd += ["--samples", "8", "--store", str(root)]
    subprocess.run([sys.executable, "-m", "halfserve", *cmd], check=True, capture_output=True, cwd=common.ROOT)


def photo() -> bytes:
    rng = np.random.default_rng(0)
    small = (rng.random((12, 16, 3)) * 255).astype(np.uint8)
    pixels = np.asarray(Image.fromarray(small).resize((640, 480), Image.Resampling.BICUBIC), dtype=np.int16)
    pixels = (pixels + rng.normal(0, 6, pixels.shape).astype(np.int16)).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


def archive(rev: str, folder: Path) -> tuple[Path, str]:
    """``rev``'s tree (``.``: this one) and its commit; another revision's ``server/`` is read out of git, which
    leaves the repository's worktrees as they are."""
    if rev == ".":
        return common.checkout(".", folder)
    folder.mkdir(parents=True)
    tar = subprocess.run(["git", "archive", rev, "server"], cwd=common.ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tar, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=common.ROOT, capture_output=True, text=True)
    return folder, commit.stdout.strip()


def measure(args: argparse.Namespace, tree: Path, store: Path, code: Path, body: bytes, work: Path) -> dict[str, Any]:
    """One fresh server of ``tree`` under the closed loop: rows/s, p50/p99, server CPU per request, the model's mean
    batch."""
    port = args.port
    cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(store), "--models", MODEL, "--port", str(port)]
    cmd += ["--code-path", str(code)]
    if args.placement is not None:
        cmd += ["--placement", args.placement]
    env = {**os.environ, "PYTHONPATH": common.source_path(tree)}
    work.mkdir(exist_ok=True)  # the server's log goes here, never into a source tree
    proc = torchserve_bench.start(cmd, work, env, f"http://127.0.0.1:{port}/ready")
    try:
        target = torchserve_bench.jpeg_target(
            "halfserve", f"http://127.0.0.1:{port}/predictions/{MODEL}", [body], proc.pid
        )
        before = common.stats(port, MODEL)
        run = asyncio.run(torchserve_bench.load(target, args.concurrency, args.warmup, args.duration))
        after = common.stats(port, MODEL)
    finally:
        torchserve_bench.stop(proc)
    batches = after["batches"] - before["batches"]
    run["mean_batch"] = (after["rows"] - before["rows"]) / batches if batches else 0.0
    return run


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"c={result['concurrency']}, {result['duration']} s per run, {result['rounds']} rounds interleaved: medians "
        "(and the spread over rounds)",
        "",
        "| revision | handler calls | rows/s | p50 ms | p99 ms | server CPU ms/request | model's mean batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for rev, commit in result["revs"].items():
        runs = [r for r in result["runs"] if r["rev"] == rev]

        def cell(key: str, digits: int, runs: list[dict[str, Any]] = runs) -> str:
            values = [r[key] for r in runs]
            return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

        calls = result["calls"].get(rev, "")
        lines.append(
            f"| {commit} | {calls} | {cell('rows_s', 0)} | {cell('p50_ms', 1)} | {cell('p99_ms', 1)} | "
            f"{cell('cpu_ms', 2)} | {cell('mean_batch', 1)} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--revs", default="0e21536,.", type=lambda s: s.split(","), help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--calls", default="per request,per batch", type=lambda s: s.split(","), help="each rev's label")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--placement", help="the servers' --placement (default: theirs)")
    p.add_argument("--out", type=Path, help="folder for handler_batch.{json,md}")
    args = p.parse_args()
    result: dict[str, Any] = {
        "concurrency": args.concurrency,
        "duration": args.duration,
        "rounds": args.rounds,
        "revs": {},
        "calls": dict(zip(args.revs, args.calls, strict=False)),
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        store, code = tmp / "store", tmp / "code"
        build_store(store, code)
        body = photo()
        trees = {}
        for i, rev in enumerate(args.revs):
            trees[rev], result["revs"][rev] = archive(rev, tmp / f"tree-{i}")
        for round_ in range(args.rounds):
            for rev in args.revs:
                run = measure(args, trees[rev], store, code, body, tmp / f"run-{rev.replace('/', '_')}")
                result["runs"].append({"rev": rev, "round": round_, **run})
                print(
                    rev, round_, {k: round(run[k], 2) for k in ("rows_s", "p50_ms", "p99_ms", "cpu_ms", "mean_batch")}
                )
    md = summary(result)
    print(md)
    if args.out is not None:
        common.write_results(args.out / "handler_batch", result, md)


if __name__ == "__main__":
    main()
