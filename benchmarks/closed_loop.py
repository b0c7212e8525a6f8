"""The in-process closed loop: C clients, one row each, through the server's Batcher and Engine, no HTTP.

What a closed loop of C clients can get from the batching schedule and the device at all: each client waits for its
answer before it sends again, so C clients with N instances never keep batches of more than about C / N forming.
The server at concurrency C is measured against this, not against the forward at the largest batch.

Imported by ``gpu_bench.py`` (per concurrency level, beside the server) and ``tools/engine_probe.py``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import common  # noqa: F401  (first: this tree's halfserve on sys.path)
import numpy as np

from halfserve.batching import Batcher
from halfserve.engine.core import Engine


async def closed_loop(
    engine: Engine,
    concurrency: int,
    seconds: float,
    *,
    max_batch_size: int,
    max_delay: float,
    adaptive_delay: bool = False,
    warmup: float = 1.0,
) -> dict[str, Any]:
    """Rows/s, p99 latency, mean batch and mean runner time of ``concurrency`` clients over ``seconds``, after
    ``warmup`` unmeasured seconds. The Batcher runs as many batches at once as the engine has instances, as the
    server's does."""
    batcher = Batcher(
        engine.run,
        max_batch_size=max_batch_size,
        max_delay=max_delay,
        max_queue_rows=max(4096, concurrency),
        concurrency=len(engine.instances),
        adaptive_delay=adaptive_delay,
    )
    batcher.start()
    rng = np.random.default_rng(0)
    sample = engine.sample_shape
    if np.dtype(engine.input_dtype).kind == "u":
        xs = [rng.integers(0, 256, (1, *sample), dtype=engine.input_dtype) for _ in range(concurrency)]
    else:
        xs = [rng.uniform(0, 1, (1, *sample)).astype(engine.input_dtype) for _ in range(concurrency)]
    measuring = False
    latencies: list[float] = []
    stop = False

    async def client(i: int) -> None:
        while not stop:
            start = time.perf_counter()
            await batcher.infer(xs[i])
            if measuring:
                latencies.append(time.perf_counter() - start)

    tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
    await asyncio.sleep(warmup)
    b0, r0, c0 = batcher.stats.batches, batcher.stats.rows, batcher.stats.compute_seconds
    measuring, start = True, time.perf_counter()
    await asyncio.sleep(seconds)
    measuring, elapsed = False, time.perf_counter() - start
    batches = batcher.stats.batches - b0
    rows = batcher.stats.rows - r0
    compute = batcher.stats.compute_seconds - c0
    stop = True
    await asyncio.gather(*tasks)
    await batcher.stop()
    return {
        "rows_per_s": round(len(latencies) / elapsed, 1),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 2) if latencies else None,
        "mean_batch": round(rows / max(1, batches), 1),
        "mean_runner_ms": round(1000 * compute / max(1, batches), 2),
    }
