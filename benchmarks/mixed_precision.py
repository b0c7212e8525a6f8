"""Mixed precision by measurement on a CPU: a classifier with one fragile layer, served with only that layer in fp32,
against the whole model in fp32 and the whole model in half precision.

In one run: imports an MLP (512 -> 2048 -> 2048 -> 2048 -> 1000; its last projection's class weights are one vector
plus 1e-3 noise, so its scores differ by less than bf16 resolves) with ``halfserve import`` into a temporary store,
with ``--labels`` (1,000 class names) as a classifier is imported, so that it is judged as one: by top-1 agreement
alone (without labels its scores would be held to ``min_cosine`` too, which no plan short of the whole model meets
here: whichever hidden projection is left in half precision turns the scores' direction past it); searches its plan
as a load does (:func:`halfserve.mixed.find`), then times the in-process batched forward (``Engine.compute``, the
server's own path: numpy in, cast, forward, float32 numpy out) for fp32, the half precision and the plan,
interleaved, at a few batch sizes, and reports rows/s, the ratios to fp32, the weight bytes and the top-1 agreement
of each with fp32 on the samples.

Usage (the committed run's command is in benchmarks/README.md):
    python benchmarks/mixed_precision.py --out benchmarks/results/mixed-precision-cpu
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import common
import numpy as np
import torch

from halfserve import cli, fidelity, hostinfo, mixed, models, store
from halfserve import precision as prec
from halfserve.engine.core import Engine
from halfserve.manifest import Precision

CLASSES = 1000
KWARGS = {"in_features": 512, "hidden": [2048, 2048, 2048], "out_features": CLASSES}


def fragile(path: Path) -> Path:
    torch.manual_seed(0)
    module = models.build("mlp", **KWARGS)
    head = module.net[-1]
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, head.in_features) + 1e-3 * torch.randn(head.out_features, head.in_features))
        head.bias.zero_()
    torch.save(module.state_dict(), path)
    return path


def weight_bytes(engine: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def rate(engine: Engine, x: np.ndarray, seconds: float) -> float:
    engine.compute(x)  # warm
    rows, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        engine.compute(x)
        rows += len(x)
    return rows / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cpu")
    half = prec.resolve(Precision.AUTO, device)
    if half is Precision.FP32:
        half = Precision.BF16  # no native bf16 here: measured anyway, and said so below
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        labels = root / "labels.txt"
        labels.write_text("".join(f"class{i}\n" for i in range(CLASSES)))
        cmd = ["import", str(fragile(root / "w.pth")), "--store", str(root / "store"), "--name", "fragile"]
        cmd += ["--architecture", "mlp", "--arch-kwargs", json.dumps(KWARGS), "--input", "x:512", "--device", "cpu"]
        cmd += ["--labels", str(labels)]
        assert cli.main(cmd) == 0
        loaded = store.load(root / "store", "fragile")
        held_to = fidelity.bar(loaded.manifest)
        found = mixed.find(loaded, half, device, held_to, 600.0, 64)
        assert found.plan is not None, found.reason
        plan = found.plan.modules
        engines = {
            "fp32": Engine(loaded, Precision.FP32, device),
            half.value: Engine(loaded, half, device),
            "mixed": Engine(loaded, half, device, fp32_modules=plan),
        }
        samples = fidelity.samples(loaded)
        agreement = {
            k: fidelity.measure(e, loaded, samples.rows, 64, samples.source).top1_agreement for k, e in engines.items()
        }
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        rng = np.random.default_rng(0)
        runs: dict[str, dict[str, list[float]]] = {k: {str(b): [] for b in sizes} for k in engines}
        for _ in range(args.rounds):  # interleaved: each round times every engine at every size
            for b in sizes:
                x = rng.standard_normal((b, 512)).astype(np.float32)
                for k, e in engines.items():
                    runs[k][str(b)].append(rate(e, x, args.seconds))
        best = {k: {b: max(v) for b, v in per.items()} for k, per in runs.items()}
        result = {
            "host": hostinfo.describe(),
            "model": {
                "architecture": "mlp",
                **KWARGS,
                "fragile": "last projection: one vector + 1e-3 noise",
                "labels": f"{CLASSES} class names: judged by top-1 agreement alone",
            },
            "half": half.value,
            "native_bf16": prec.cpu_has_native_bf16(),
            "plan": found.as_dict(),
            "top1_agreement_with_fp32": agreement,
            "weight_bytes": {k: weight_bytes(e) for k, e in engines.items()},
            "rows_per_s": runs,
            "best_rows_per_s": best,
            "over_fp32": {k: {b: best[k][b] / best["fp32"][b] for b in best[k]} for k in best},
        }
        for e in engines.values():
            e.close()
    host = result["host"]
    lines = [
        "# Mixed precision on a CPU: one fragile layer in fp32",
        "",
        f"Host: {host['cpu']}, {host['cores']} cores, {host['cpu_capability']}, native bf16: {host['native_bf16']}, "
        f"{host['allocator']}, torch {host['torch']}; "
        f"plan: {list(plan)} ({found.plan.parameters_fp32:.1%} of the parameters in fp32), "
        f"found in {found.plan.seconds:.1f} s with {found.plan.measurements} measurements.",
        "",
        "| engine | top-1 agreement with fp32 | weight MB | "
        + " | ".join(f"rows/s b={b}" for b in sizes)
        + " | "
        + " | ".join(f"/fp32 b={b}" for b in sizes)
        + " |",
        "|---" * (3 + 2 * len(sizes)) + "|",
    ]
    for k in engines:
        lines.append(
            f"| {k} | {agreement[k]:.4f} | {result['weight_bytes'][k] / 1e6:.1f} | "  # type: ignore[index]
            + " | ".join(f"{best[k][str(b)]:,.0f}" for b in sizes)
            + " | "
            + " | ".join(f"{best[k][str(b)] / best['fp32'][str(b)]:.2f}" for b in sizes)
            + " |"
        )
    common.write_results(args.out / "mixed", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
