"""GIL hand-offs: what one torch call costs a worker thread while the process's event loop is busy.

The engine runs each batch on an instance thread, beside the event loop that answers requests (the front-ends'
frames, with ``--http-workers``). Every torch call lets go of the GIL and must take it back; while the loop thread
runs Python, taking it back waits for the loop to let go (at a system call, or after the switch interval). This
measures that wait, per call, with the loop idle and with it doing per-request work like the engine process's
(decode a frame header, send a frame over a Unix socket, receive it), at a few switch intervals.

Usage:
    python benchmarks/gil_bench.py --out benchmarks/results/cpu-gil
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import common  # noqa: F401  (the repository root on sys.path, for server)
import numpy as np
import orjson
import torch

from halfserve import hostinfo

CALLS_PER_SAMPLE = 20


def worker(stop: threading.Event, samples: list[float]) -> None:
    """Time batches of a tiny in-place torch op (it releases and retakes the GIL), then rest 1 ms as a batch would."""
    t = torch.zeros(4)
    while not stop.is_set():
        start = time.perf_counter()
        for _ in range(CALLS_PER_SAMPLE):
            t.add_(1)
        samples.append((time.perf_counter() - start) / CALLS_PER_SAMPLE)
        time.sleep(0.001)


async def event_loop(burst: int, seconds: float) -> int:
    """Idle (``burst`` 0: sleeping) or busy with request-like frames, ``burst`` of them per receive as a loaded
    front-end's socket delivers them: per frame, decode its header, take a numpy view of its slot, resolve a future
    and encode a reply. Returns the frames handled."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    memory = bytearray(1 << 20)
    header = {"op": "infer", "id": 1, "model": "resnet50", "version": 1, "slot": 3, "shape": [1, 3, 224, 224]}
    sizes = orjson.dumps(header)
    frames = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if not burst:
            await asyncio.sleep(0.001)
            continue
        a.send(sizes * burst)
        data = await loop.sock_recv(b, 65536)
        for i in range(burst):
            head = orjson.loads(data[i * len(sizes) : (i + 1) * len(sizes)])
            x = np.frombuffer(memory, np.uint8, 150528, 0).reshape(head["shape"])
            future = loop.create_future()
            future.set_result(x)
            orjson.dumps({"id": head["id"], "status": 200, "dtype": "float32", "shape": [1, 1000]})
            frames += 1
        await asyncio.sleep(0)
    a.close()
    b.close()
    return frames


def measure(burst: int, switch_interval: float, seconds: float) -> dict[str, object]:
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    stop, samples = threading.Event(), []
    thread = threading.Thread(target=worker, args=(stop, samples))
    thread.start()
    try:
        frames = asyncio.run(event_loop(burst, seconds))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(default)
    samples.sort()
    n = len(samples)
    return {
        "loop": f"busy, {burst} frame{'s' if burst > 1 else ''} per receive" if burst else "idle",
        "switch_interval_ms": switch_interval * 1000,
        "loop_frames_per_s": round(frames / seconds),
        "samples": n,
        "us_per_call_p50": round(samples[n // 2] * 1e6, 1),
        "us_per_call_mean": round(sum(samples) / n * 1e6, 1),
        "us_per_call_p99": round(samples[int(n * 0.99)] * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [measure(0, 0.005, args.seconds)]
    for burst in (1, 16):
        for interval in (0.005, 0.0005):
            rows.append(measure(burst, interval, args.seconds))
    for r in rows:
        print(json.dumps(r), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"host": hostinfo.describe(), "torch": torch.__version__, "python": sys.version.split()[0], "rows": rows}
    (args.out / "gil_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# One torch call on a worker thread, beside an event loop (us per call)",
        "",
        f"{hostinfo.cpu_model()}; torch {result['torch']}, Python {result['python']}",
        "",
        "| event loop | switch interval ms | loop frames/s | p50 | mean | p99 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['loop']} | {r['switch_interval_ms']:g} | {r['loop_frames_per_s']} | {r['us_per_call_p50']} | "
        f"{r['us_per_call_mean']} | {r['us_per_call_p99']} |"
        for r in rows
    ]
    (args.out / "gil_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
