"""TorchServe against halfserve on the same ``.mar``: photos in, at one or more concurrencies (issue 51).

Per model, one archive made with ``torch-model-archiver`` (``--model-file`` a one-class ResNet, ``--serialized-file``
its seeded random state dict, ``--handler image_classifier``, ``--extra-files index_to_name.json`` and this folder's
``torchserve_handler.py`` packed as ``image_classifier.py``, which TorchServe imports in place of its stock handler,
since its venv has no torchvision). TorchServe serves the archive at its default settings (its venv from the peers
kit, ``setup.sh torchserve``; its own ports on 127.0.0.1; a WARN-level log4j config); halfserve imports it
(``halfserve import --trust-model-file --code-path``) and serves it with its defaults.

Load: a closed loop in this process (asyncio and httpx): ``c`` workers post one request each at a time, a warm-up
first, every status checked, for a bounded time. Per system and protocol: rows/s, p50/p99, the bytes of a request
and its answer on the wire (HTTP/1.1 head and body), and the server's CPU seconds per request (utime + stime of the
server's process group from ``/proc``, over the measured window). Protocols: TorchServe and halfserve take the JPEG
as it is (``curl -T``); halfserve also takes the same image pre-resized and cropped by the client as a UINT8 tensor
over V2 binary (a second store entry, ``<name>_uint8``, with ``normalize``). Rounds interleave the systems; the table
has medians and the spread.

Models: ``resnet50`` (torchvision's ResNet-50, 500x375-ish JPEGs: the forward dominates) and ``small`` (a two-block
ResNet of width 16: phone photos of 1-12 megapixels, quality 90: decoding dominates). ``--draft`` also times Pillow's
reduced-size JPEG decoding (``Image.draft``) against the full decode on the phone photos, with the pixel difference
after the transforms. ``--smoke``: a tiny model, small images, 2 s, one round (the test runs it against halfserve).

    python benchmarks/torchserve_bench.py --out benchmarks/results/torchserve-cpu
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common
import httpx
import numpy as np
import torch
from PIL import Image, ImageDraw

from halfserve import store as store_api
from halfserve.images import crop_box, resized_size
from halfserve.manifest import DataType, load_manifest

HERE = Path(__file__).resolve().parent
HANDLER = HERE / "torchserve_handler.py"
LOG4J = HERE / "torchserve_log4j2.xml"
ARCHIVER = "from model_archiver.model_packaging import generate_model_archive; generate_model_archive()"
PEERS_WORK = Path(os.environ.get("PEERS_WORK", "/work/peers-work"))
TS_VENV = PEERS_WORK / "venv" / "torchserve"
CROP = 224

MODEL_FILE = '''"""{doc}"""

import torch
from torch import nn

WIDTH = {width}
BLOCKS = {blocks}
EXPANSION = {expansion}
CLASSES = {classes}


def conv_bn(cin, cout, kernel, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout))


class Net(nn.Module):
    """halfserve's ResNetBench with the ImageNet stem (resnet50 at width 64, bottlenecks 3-4-6-3), in one class:
    TorchServe and halfserve take the one nn.Module a model file defines."""

    def __init__(self):
        super().__init__()
        stem = [nn.Conv2d(3, WIDTH, 7, 2, 3, bias=False), nn.BatchNorm2d(WIDTH), nn.ReLU(inplace=True)]
        self.stem = nn.Sequential(*stem, nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.ModuleList()
        cin = WIDTH
        for stage, count in enumerate(BLOCKS):
            channels = WIDTH * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                cout = channels * EXPANSION
                if EXPANSION == 4:
                    convs = [conv_bn(cin, channels, 1, 1), conv_bn(channels, channels, 3, stride)]
                    convs.append(conv_bn(channels, cout, 1, 1))
                else:
                    convs = [conv_bn(cin, channels, 3, stride), conv_bn(channels, cout, 3, 1)]
                shortcut = nn.Identity() if stride == 1 and cin == cout else conv_bn(cin, cout, 1, stride)
                self.blocks.append(nn.ModuleDict({{"convs": nn.ModuleList(convs), "shortcut": shortcut}}))
                cin = cout
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)

    def forward(self, x):
        x = self.stem(x.contiguous(memory_format=torch.channels_last))
        for block in self.blocks:
            y = x
            convs = block["convs"]
            for j, conv in enumerate(convs):
                y = conv(y)
                if j < len(convs) - 1:
                    y = torch.relu(y)
            x = torch.relu(y + block["shortcut"](x))
        return self.head(self.pool(x).flatten(1))
'''


@dataclass(frozen=True)
class Spec:
    """One benchmarked model and the photos it is fed."""

    name: str
    width: int
    blocks: tuple[int, ...]
    expansion: int
    classes: int
    sizes: tuple[tuple[int, int], ...]
    """(width, height) of the photos posted, in turn."""


SPECS = {
    "resnet50": Spec(
        "resnet50", 64, (3, 4, 6, 3), 4, 1000, ((500, 375), (375, 500), (500, 333), (480, 360), (500, 400), (640, 427))
    ),
    "small": Spec(
        "small", 16, (1, 1), 1, 10, ((1280, 960), (2016, 1512), (2592, 1944), (3264, 2448), (4032, 3024), (3024, 4032))
    ),
    "smoke": Spec("smoke", 8, (1,), 1, 10, ((320, 240), (240, 320))),
}


def photo(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    """A photo-like JPEG: smooth colour fields (low-resolution noise upscaled), shapes, and a little sensor noise."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray((rng.random((12, 16, 3)) * 255).astype(np.uint8)).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(base)
    for _ in range(12):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(width // 20, width // 4))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r // 2, x + r, y + r // 2), fill=fill)
    pixels = np.asarray(base, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
    return out.getvalue()


def cropped(data: bytes) -> np.ndarray:
    """What a client doing the work sends: the photo resized (shorter side 256) and centre-cropped, UINT8 3x224x224."""
    with Image.open(io.BytesIO(data)) as opened:
        image = opened.convert("RGB")
    image = image.resize(resized_size(image.width, image.height, 256), Image.Resampling.BILINEAR)
    image = image.crop(crop_box(image.width, image.height, (CROP, CROP)))
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))


def archive(spec: Spec, work: Path) -> Path:
    """The ``.mar`` of ``spec``'s model with seeded random weights, made by ``torch-model-archiver``."""
    src = work / f"{spec.name}-src"
    src.mkdir(parents=True, exist_ok=True)
    doc = f"{spec.name}: width {spec.width}, blocks {list(spec.blocks)}, {spec.classes} classes (torchserve_bench.py)"
    text = MODEL_FILE.format(
        doc=doc, width=spec.width, blocks=spec.blocks, expansion=spec.expansion, classes=spec.classes
    )
    (src / "model.py").write_text(text)
    scope: dict[str, object] = {}
    exec(compile(text, str(src / "model.py"), "exec"), scope)  # this script's own model file
    torch.manual_seed(0)
    net: torch.nn.Module = scope["Net"]()  # type: ignore[operator]
    torch.save(net.state_dict(), src / "model.pt")
    (src / "index_to_name.json").write_text(json.dumps({str(i): f"class_{i}" for i in range(spec.classes)}))
    shutil.copy(HANDLER, src / "image_classifier.py")
    out = work / "mar"
    out.mkdir(exist_ok=True)
    args = f"--model-name {spec.name} --version 1.0 --model-file model.py --serialized-file model.pt "
    args += "--handler image_classifier --extra-files index_to_name.json,image_classifier.py "
    args += f"--export-path {out} --force"
    subprocess.run([sys.executable, "-c", ARCHIVER, *args.split()], cwd=src, check=True, capture_output=True)
    return out / f"{spec.name}.mar"


def free_ports(n: int) -> list[int]:
    """``n`` ports nothing listens on now, on 127.0.0.1 (so that runs beside the peers kit's or another don't clash)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def halfserve(*args: str | Path, capture: bool = True) -> str:
    run = subprocess.run([sys.executable, "-m", "halfserve", *map(str, args)], capture_output=capture, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"halfserve {' '.join(map(str, args[:2]))}: {run.stderr[-3000:]}")
    return run.stdout


def import_both(spec: Spec, mar: Path, store: Path, code: Path, calibration: Path, draft: bool = False) -> None:
    """``halfserve import`` of the archive (with ``--image-draft on`` where ``draft``, else ``off``: every pixel
    decoded, whatever the calibration photos would choose), then ``<name>_uint8``: the same
    weights taking UINT8 3x224x224 tensors, normalised on the server (the manifest's ``normalize``), for clients that
    resize and crop themselves."""
    drafted = ["--image-draft", "on" if draft else "off"]
    halfserve(
        "import", mar, "--store", store, "--trust-model-file", "--code-path", code, "--calibration", calibration,
        *drafted,
    )  # fmt: skip
    src = mar.parent.parent / f"{spec.name}-src"
    samples = src / "uint8-calibration.npy"  # the photos as such clients send them, 0-255
    np.save(samples, np.stack([cropped(p.read_bytes()) for p in sorted(calibration.iterdir())]).astype(np.float32))
    halfserve(
        "import", src / "model.pt", "--name", f"{spec.name}_uint8", "--architecture", f"mar_{spec.name}:Net",
        "--store", store, "--code-path", code, "--input", "input:FP32:3x224x224",
        "--labels", src / "index_to_name.json", "--calibration", samples,
    )  # fmt: skip
    # no import flag declares a UINT8 input with its normalize block: the manifest is rewritten, as gpu_bench.py does
    written = load_manifest(store / f"{spec.name}_uint8")
    wire = written.inputs[0].model_copy(update={"datatype": DataType.UINT8})
    store_api.write_manifest(store, written.model_copy(update={"inputs": [wire], "normalize": common.IMAGENET}))


def start(cmd: list[str], cwd: Path, env: dict[str, str], ready: str) -> subprocess.Popen[bytes]:
    """A server in a session (and process group) of its own, its output into ``cwd/server.log``, once ``ready``
    answers 200."""
    log = open(cwd / "server.log", "wb")  # noqa: SIM115 - the server writes it for as long as it runs
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        common.wait_ready(ready, proc, 300, 0.5, cwd / "server.log")
    except RuntimeError:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """TERM to the server's process group, KILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes in process group ``pgid``, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...; utime and stime are 12 and 13
            total += int(fields[11]) + int(fields[12])
    return total / tick


@dataclass(frozen=True)
class Target:
    """One way of posting one model's photos to one server."""

    system: str
    protocol: str
    url: str
    bodies: list[bytes]
    headers: list[dict[str, str]]
    pgid: int


def wire_bytes(response: httpx.Response) -> tuple[int, int]:
    """HTTP/1.1 bytes of the request and of its answer: request line or status line, headers, body."""
    req = response.request
    sent = len(f"{req.method} {req.url.raw_path.decode()} HTTP/1.1\r\n") + len(req.content) + 2
    sent += sum(len(k) + len(v) + 4 for k, v in req.headers.raw)
    got = len(f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n") + len(response.content) + 2
    got += sum(len(k) + len(v) + 4 for k, v in response.headers.raw)
    return sent, got


async def load(target: Target, concurrency: int, warmup: float, duration: float) -> dict[str, float]:
    """A closed loop of ``concurrency`` workers: ``warmup`` seconds, then ``duration`` measured seconds."""
    latencies: list[float] = []
    sent = got = 0
    state = {"measuring": False, "stop": False, "next": 0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:

        async def worker() -> None:
            nonlocal sent, got
            while not state["stop"]:
                i = state["next"] % len(target.bodies)
                state["next"] += 1
                t0 = time.perf_counter()
                r = await client.post(target.url, content=target.bodies[i], headers=target.headers[i])
                if r.status_code != 200:
                    raise RuntimeError(f"{target.system} {target.protocol}: {r.status_code} {r.text[:300]}")
                if state["measuring"] and not state["stop"]:
                    latencies.append(time.perf_counter() - t0)
                    s, g = wire_bytes(r)
                    sent, got = sent + s, got + g

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        state["measuring"] = True
        cpu0, t0 = group_cpu(target.pgid), time.perf_counter()
        await asyncio.sleep(duration)
        cpu1, elapsed = group_cpu(target.pgid), time.perf_counter() - t0
        state["stop"] = True
        await asyncio.gather(*tasks)
    n = len(latencies)
    if n == 0:
        raise RuntimeError(f"{target.system} {target.protocol}: no request answered in {duration} s")
    ms = np.percentile(np.array(latencies) * 1000, [50, 99])
    return {
        "rows_s": n / elapsed,
        "p50_ms": float(ms[0]),
        "p99_ms": float(ms[1]),
        "sent_b": sent / n,
        "got_b": got / n,
        "cpu_ms": (cpu1 - cpu0) * 1000 / n,
        "requests": n,
    }


def jpeg_target(system: str, url: str, photos: list[bytes], pgid: int) -> Target:
    return Target(system, "jpeg", url, photos, [{"Content-Type": "image/jpeg"}] * len(photos), pgid)


def uint8_target(name: str, port: int, photos: list[bytes], pgid: int) -> Target:
    bodies, headers = [], []
    for data in photos:
        pixels = cropped(data)[None]
        tensor = {"name": "input", "shape": list(pixels.shape), "datatype": "UINT8"}
        tensor["parameters"] = {"binary_data_size": pixels.nbytes}
        head = json.dumps({"inputs": [tensor]}).encode()
        bodies.append(head + pixels.tobytes())
        headers.append({"Content-Type": "application/octet-stream", common.HEADER_LENGTH: str(len(head))})
    return Target("halfserve", "uint8", f"http://127.0.0.1:{port}/v2/models/{name}_uint8/infer", bodies, headers, pgid)


def top1(answer: object) -> str:
    """The top label of a ``/predictions`` answer (TorchServe's shape: label -> probability, or a list of one)."""
    if isinstance(answer, list):
        answer = answer[0]
    assert isinstance(answer, dict), answer
    return str(max(answer, key=lambda k: answer[k]))


def agreement(urls: dict[str, str], photos: list[bytes], uint8: Target | None = None) -> dict[str, object]:
    """Top-1 labels of each photo from each server's ``/predictions`` (and the UINT8 entry's argmax), and on how many
    photos every one agrees with the first."""
    labels = {s: [top1(httpx.post(u, content=p, timeout=120).json()) for p in photos] for s, u in urls.items()}
    if uint8 is not None:  # the same photos resized and cropped by the client, as V2 UINT8: the output's argmax
        answers = [
            httpx.post(uint8.url, content=b, headers=h, timeout=120)
            for b, h in zip(uint8.bodies, uint8.headers, strict=True)
        ]
        labels["halfserve uint8"] = [f"class_{int(np.argmax(a.json()['outputs'][0]['data']))}" for a in answers]
    first, *others = labels.values()
    same = [all(other[i] == first[i] for other in others) for i in range(len(photos))]
    return {"labels": labels, "agreed": sum(same), "of": len(photos)}


def draft_report(photos: list[bytes], sizes: tuple[tuple[int, int], ...]) -> list[dict[str, float | str]]:
    """Per photo: ms to decode and transform it (resize 256, crop 224) in full and with ``Image.draft`` to the
    resized size and to twice it (best of 3 each), and the mean and largest pixel difference (0-255 levels) from the
    full path after the transforms."""

    def path(data: bytes, draft: int) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            if draft:
                want = resized_size(image.width, image.height, 256)
                image.draft("RGB", (want[0] * draft, want[1] * draft))
            image = image.convert("RGB")
            image = image.resize(resized_size(image.width, image.height, 256), Image.Resampling.BILINEAR)
            return np.asarray(image.crop(crop_box(image.width, image.height, (CROP, CROP))), dtype=np.float32)

    rows: list[dict[str, float | str]] = []
    for data, (w, h) in zip(photos, sizes, strict=True):
        row: dict[str, float | str] = {"photo": f"{w}x{h}", "kb": len(data) / 1024}
        full = path(data, 0)
        for draft, key in ((0, "full"), (1, "draft1x"), (2, "draft2x")):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = path(data, draft)
                times.append(time.perf_counter() - t0)
            row[f"{key}_ms"] = min(times) * 1000
            if draft:
                row[f"{key}_mean_diff"] = float(np.abs(out - full).mean())
                row[f"{key}_max_diff"] = float(np.abs(out - full).max())
        rows.append(row)
    return rows


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def table(results: dict[str, dict[str, list[dict[str, float]]]]) -> str:
    """Medians over rounds (min-max in brackets) per model, concurrency and system/protocol."""
    lines = [
        "| model | c | server, body | rows/s | p50 ms | p99 ms | request B | answer B | server CPU ms/req |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        model, c = key.split("@")
        for target, rounds in runs.items():
            cells = [spread([r[k] for r in rounds]) for k in ("rows_s", "p50_ms", "p99_ms")]
            cells += [f"{statistics.median(r[k] for r in rounds):,.0f}" for k in ("sent_b", "got_b")]
            cells.append(spread([r["cpu_ms"] for r in rounds]))
            lines.append(f"| {model} | {c} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(results: dict[str, dict[str, list[dict[str, float]]]]) -> str:
    """halfserve against TorchServe's JPEG rows/s, per round (rounds interleave, so round i's are neighbours)."""
    lines = []
    for key, runs in results.items():
        ts = runs.get("torchserve jpeg")
        if not ts:
            continue
        for target in ("halfserve jpeg", "halfserve uint8"):
            per_round = [h["rows_s"] / t["rows_s"] for h, t in zip(runs[target], ts, strict=True)]
            lines.append(f"- {key}: {target} / torchserve jpeg rows/s: {spread(per_round)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,small", help=f"comma-separated, of {', '.join(SPECS)}")
    ap.add_argument("--concurrency", default="64", help="comma-separated client concurrencies")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before each measured window")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per system, protocol and round")
    ap.add_argument("--no-torchserve", action="store_true", help="halfserve only (no TorchServe venv needed)")
    ap.add_argument(
        "--torchserve-threads",
        type=int,
        help="OMP_NUM_THREADS for TorchServe's workers (default: unset, torch's own count per worker, TorchServe's "
        "default)",
    )
    ap.add_argument("--draft", action="store_true", help="also time Pillow's draft decoding on the phone photos")
    ap.add_argument(
        "--halfserve-draft", action="store_true", help="import with --image-draft on: halfserve decodes JPEGs reduced"
    )
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 2 s, one round, c=4")
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    args = ap.parse_args()
    if args.smoke:
        args.models, args.concurrency, args.rounds, args.warmup, args.duration = "smoke", "4", 1, 0.5, 2.0
    specs = [SPECS[m] for m in args.models.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    with_ts = not args.no_torchserve
    if with_ts and not (TS_VENV / "bin" / "torchserve").exists():
        sys.exit(f"no TorchServe venv at {TS_VENV}: run PEERS_WORK={PEERS_WORK} ../shared/peers/setup.sh torchserve")

    hs_port, ts_port, ts_management, ts_metrics = free_ports(4)
    work = Path(tempfile.mkdtemp(prefix="torchserve-bench-"))
    store, code, ts_store = work / "store", work / "code", work / "ts-store"
    ts_store.mkdir()
    meta: dict[str, object] = {"command": " ".join(sys.argv), "torch": torch.__version__, "models": {}}
    meta["torchserve_threads"] = args.torchserve_threads
    meta["halfserve_draft"] = args.halfserve_draft
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    photos: dict[str, list[bytes]] = {}
    try:
        for spec in specs:
            photos[spec.name] = [photo(w, h, seed) for seed, (w, h) in enumerate(spec.sizes)]
            calibration = work / f"{spec.name}-calibration"
            calibration.mkdir()
            for i, data in enumerate(photos[spec.name][:4]):
                (calibration / f"{i}.jpg").write_bytes(data)
            mar = archive(spec, work)
            shutil.copy(mar, ts_store)
            import_both(spec, mar, store, code, calibration, args.halfserve_draft)
            print(f"{spec.name}: archive {mar.stat().st_size / 1e6:.1f} MB, imported", flush=True)

        env = {**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"]}
        names = ",".join(n for s in specs for n in (s.name, f"{s.name}_uint8"))
        (work / "hs").mkdir()
        hs_cmd = [sys.executable, "-m", "halfserve", "serve", "--store", str(store), "--code-path", str(code)]
        hs_cmd += ["--models", names, "--port", str(hs_port)]
        hs = start(hs_cmd, work / "hs", env, f"http://127.0.0.1:{hs_port}/ready")
        servers = [hs]
        listing = httpx.get(f"http://127.0.0.1:{hs_port}/models", timeout=30).json()
        for entry in listing["models"]:
            entry.pop("labels", None)  # a thousand class names say nothing about the run
        meta["halfserve_models"] = listing
        ts = None
        if with_ts:
            (work / "ts").mkdir()
            config = work / "ts" / "config.properties"
            config.write_text(
                f"inference_address=http://127.0.0.1:{ts_port}\n"
                f"management_address=http://127.0.0.1:{ts_management}\n"
                f"metrics_address=http://127.0.0.1:{ts_metrics}\n"
                f"load_models={','.join(f'{s.name}.mar' for s in specs)}\n"
                "disable_token_authorization=true\ninstall_py_dep_per_model=false\n"
            )
            ts_cmd = [str(TS_VENV / "bin" / "torchserve"), "--start", "--foreground", "--ncs", "--ts-config"]
            ts_cmd += [str(config), "--model-store", str(ts_store), "--disable-token-auth", "--log-config", str(LOG4J)]
            ts_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            ts_env["PATH"] = f"{TS_VENV / 'bin'}:{ts_env['PATH']}"
            if args.torchserve_threads:
                ts_env["OMP_NUM_THREADS"] = str(args.torchserve_threads)
            ts = start(ts_cmd, work / "ts", ts_env, f"http://127.0.0.1:{ts_port}/ping")
            servers.append(ts)
            for spec in specs:  # ping answers before the workers load: wait for each model's first answer
                url = f"http://127.0.0.1:{ts_port}/predictions/{spec.name}"
                deadline = time.monotonic() + 300
                while httpx.post(url, content=photos[spec.name][0], timeout=120).status_code != 200:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"TorchServe: {spec.name} does not answer")
                    time.sleep(1)
                described = httpx.get(f"http://127.0.0.1:{ts_management}/models/{spec.name}", timeout=30).json()
                meta["models"][spec.name] = {"torchserve": described}  # type: ignore[index]
        for spec in specs:
            urls = {"halfserve": f"http://127.0.0.1:{hs_port}/predictions/{spec.name}"}
            if ts is not None:
                urls["torchserve"] = f"http://127.0.0.1:{ts_port}/predictions/{spec.name}"
            checked = agreement(urls, photos[spec.name], uint8_target(spec.name, hs_port, photos[spec.name], hs.pid))
            entry = meta["models"].setdefault(spec.name, {})  # type: ignore[attr-defined]
            entry["agreement"] = checked
            entry["photos"] = [f"{w}x{h}" for w, h in spec.sizes]
            entry["photo_kb"] = [round(len(p) / 1024, 1) for p in photos[spec.name]]
            print(f"{spec.name}: top-1 agreed on {checked['agreed']} of {checked['of']} photos", flush=True)
            for c in levels:
                targets = [jpeg_target("halfserve", urls["halfserve"], photos[spec.name], hs.pid)]
                targets.append(uint8_target(spec.name, hs_port, photos[spec.name], hs.pid))
                if ts is not None:
                    targets.insert(0, jpeg_target("torchserve", urls["torchserve"], photos[spec.name], ts.pid))
                runs = results.setdefault(f"{spec.name}@{c}", {})
                for r in range(args.rounds):
                    for target in targets:
                        row = asyncio.run(load(target, c, args.warmup, args.duration))
                        runs.setdefault(f"{target.system} {target.protocol}", []).append(row)
                        print(f"{spec.name} c={c} round {r + 1} {target.system} {target.protocol}: "
                              f"{row['rows_s']:.1f} rows/s, p99 {row['p99_ms']:.0f} ms, "
                              f"cpu {row['cpu_ms']:.1f} ms/req", flush=True)  # fmt: skip
    finally:
        for proc in locals().get("servers", []):
            stop(proc)
        if not os.environ.get("KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    md = table(results) + "\n\n" + ratios(results)
    if args.draft and "small" in photos:
        rows = draft_report(photos["small"], SPECS["small"].sizes)
        meta["draft"] = rows
        md += "\n\n| photo | KB | full ms | draft 1x ms | mean diff | max diff | draft 2x ms | mean diff | max diff |\n"
        md += "|---|---|---|---|---|---|---|---|---|\n"
        for row in rows:
            md += (f"| {row['photo']} | {row['kb']:,.0f} | {row['full_ms']:.1f} | {row['draft1x_ms']:.1f} | "
                   f"{row['draft1x_mean_diff']:.2f} | {row['draft1x_max_diff']:.0f} | {row['draft2x_ms']:.1f} | "
                   f"{row['draft2x_mean_diff']:.2f} | {row['draft2x_max_diff']:.0f} |\n")  # fmt: skip
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        (args.out / "results.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
