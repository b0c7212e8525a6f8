"""Probe: the CUDA-only levers docs/gpu.md lists for concurrency 64, each timed as its own host work (CUDA only; on a
CPU it says so and measures nothing).

1. ``stream``: an instance makes its stream current for every batch (``Instance.on_stream``: ``torch.cuda.stream``
   entered and left), against once per thread;
2. ``output``: the output's copy to the host as ``Instance.fetch`` makes it (``copy_(non_blocking=True)`` into a
   page-locked buffer, then ``Stream.synchronize``) against one blocking ``copy_``, for a batch's float32 outputs;
   each on an idle thread and beside an event loop busy in Python on another thread (every torch call lets go of the
   GIL and takes it back, as in the engine process in thread mode);
3. ``pin``: what page-locking a front-end's shared memory (128 slots of 2 MiB, ``instance.pin_host``) costs the
   engine process, which in process placement no longer reads it: the seconds to pin and, in a fresh process, the
   device memory of the CUDA context pinning creates (``nvidia-smi``).

Run from the repository root: ``PYTHONPATH=benchmarks python benchmarks/tools/torch_calls.py``. Env: ``OUT`` (writes
``torch_calls.json`` there when set), ``ROWS`` (default 32), ``WIDTH`` (1000), ``REPS`` (2000).
"""

import asyncio
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import common  # this tree's halfserve first on sys.path
import torch

from halfserve import hostinfo
from halfserve.instance import pin_host

ROWS = int(os.environ.get("ROWS", "32"))
WIDTH = int(os.environ.get("WIDTH", "1000"))
REPS = int(os.environ.get("REPS", "2000"))
FRONT_END_BYTES = 128 * 2 * 1024 * 1024


def us_per_call(step: Callable[[], object]) -> float:
    for _ in range(REPS // 10):
        step()
    means = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(REPS):
            step()
        means.append((time.perf_counter() - began) / REPS * 1e6)
    return round(statistics.median(means), 2)


def busy_loop(stop: threading.Event) -> None:
    """An event loop running Python between awaits, as one relaying requests does."""

    async def spin() -> None:
        while not stop.is_set():
            sum(range(200))
            await asyncio.sleep(0)

    asyncio.run(spin())


def steps() -> dict[str, Callable[[], object]]:
    stream = torch.cuda.Stream()
    y = torch.rand(ROWS, WIDTH, device="cuda")
    out = torch.empty(ROWS, WIDTH, pin_memory=True)

    def stream_per_batch() -> object:
        with torch.cuda.stream(stream):
            return None

    def copy_and_sync() -> object:
        out.copy_(y, non_blocking=True)
        stream.synchronize()
        return out

    def blocking_copy() -> object:
        return out.copy_(y)

    def on_stream(step: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.cuda.stream(stream):
                return step()

        return run

    # The copies run on the instance's stream, made current once (what the thread would keep).
    return {
        "stream_per_batch": stream_per_batch,
        "copy_and_sync": on_stream(copy_and_sync),
        "blocking_copy": on_stream(blocking_copy),
    }


PIN_CHILD = """
import json, mmap, os, subprocess, sys, time
from halfserve.instance import pin_host
fd = os.memfd_create("front-end")
os.ftruncate(fd, int(sys.argv[1]))
m = mmap.mmap(fd, int(sys.argv[1]))
began = time.perf_counter()
unpin = pin_host(m)
seconds = time.perf_counter() - began
used = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                      capture_output=True, text=True).stdout
mine = [int(line.split(",")[1]) for line in used.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
print(json.dumps({"pinned": unpin is not None, "first_pin_seconds": round(seconds, 3),
                  "context_mib": mine[0] if mine else None}))
"""


def pin() -> dict[str, object]:
    """Pinning in a fresh process (its first CUDA call: the context is created there), then once more here."""
    child = subprocess.run([sys.executable, "-c", PIN_CHILD, str(FRONT_END_BYTES)], capture_output=True, text=True)
    first = json.loads(child.stdout) if child.returncode == 0 else {"error": child.stderr[-2000:]}
    fd = os.memfd_create("front-end")
    os.ftruncate(fd, FRONT_END_BYTES)
    with mmap.mmap(fd, FRONT_END_BYTES) as m:
        began = time.perf_counter()
        unpin = pin_host(m)
        again = time.perf_counter() - began
        if unpin is not None:
            unpin()
    os.close(fd)
    return {"bytes": FRONT_END_BYTES, "fresh_process": first, "pin_seconds_with_a_context": round(again, 3)}


def main() -> None:
    result: dict[str, object] = {"machine": hostinfo.describe(), "rows": ROWS, "width": WIDTH, "reps": REPS}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device: these levers are CUDA-only"
    else:
        result["gpu"] = torch.cuda.get_device_name()
        calls = steps()
        result["idle_us"] = {name: us_per_call(step) for name, step in calls.items()}
        stop = threading.Event()
        loop = threading.Thread(target=busy_loop, args=(stop,), daemon=True)
        loop.start()
        try:
            result["beside_busy_loop_us"] = {name: us_per_call(step) for name, step in calls.items()}
        finally:
            stop.set()
            loop.join()
        result["pin"] = pin()
    common.emit("torch_calls", result)


main()
