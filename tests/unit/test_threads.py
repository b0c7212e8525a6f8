"""Where torch work runs: loading in threads that end with it (so no OpenMP pool outlives it beside the engine's),
and each engine's intra-op threads chosen from its own forward's time."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from server import store
from server.engine import LOOP_SECONDS_PER_ROW, Engine, intra_op_threads
from server.precision import Precision
from server.threads import available_cores, in_passing_thread
from tests.conftest import save_tiny_mlp

several_cores = pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores for a pool of OpenMP workers")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_torch_work() -> float:
    """Work torch spreads over its intra-op threads (OpenMP workers, started by the thread that runs it)."""
    x = torch.randn(512, 512)
    return float((x @ x).sum())


async def threads_after(settled: int) -> int:
    """The process's OS threads once they stop changing (a thread that returned is gone within moments)."""
    count = os_threads()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if os_threads() == count and count <= settled:
            break
        count = os_threads()
    return count


async def test_a_passing_thread_returns_the_result_and_ends() -> None:
    seen: list[threading.Thread] = []

    def work(a: int, b: int) -> int:
        seen.append(threading.current_thread())
        return a + b

    assert await in_passing_thread(work, 2, 3) == 5
    assert seen[0] is not threading.main_thread()
    seen[0].join(timeout=5)
    assert not seen[0].is_alive()


async def test_a_passing_thread_raises_what_the_function_raised() -> None:
    def fails() -> None:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        await in_passing_thread(fails)


@several_cores
async def test_torch_work_in_a_passing_thread_leaves_no_openmp_pool_behind() -> None:
    await asyncio.to_thread(lambda: None)  # the default executor's thread, started before counting
    before = os_threads()
    await in_passing_thread(parallel_torch_work)
    assert await threads_after(before) == before
    # The same work in the default executor's long-lived thread keeps its pool of workers for the process's life.
    await asyncio.to_thread(parallel_torch_work)
    assert await threads_after(before) > before


def test_one_core_is_kept_for_the_event_loop_only_where_the_forward_is_shorter_than_its_work() -> None:
    rows = 64
    loop_work = rows * LOOP_SECONDS_PER_ROW
    assert intra_op_threads(loop_work / 10, rows, cores=2) == 1
    assert intra_op_threads(loop_work / 10, rows, cores=16) == 15
    assert intra_op_threads(loop_work * 10, rows, cores=2) == 2
    assert intra_op_threads(loop_work * 1.01, rows, cores=8) == 8
    assert intra_op_threads(loop_work / 10, rows, cores=1) == 1  # a single core is never given up


@several_cores
def test_an_engine_settles_its_threads_on_its_instance_thread_only(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, torch.device("cpu"), max_batch_size=8)
    try:
        main_threads = torch.get_num_threads()
        cores = available_cores()
        start = time.perf_counter()
        chosen = engine.settle_threads(8, cores)
        assert time.perf_counter() - start < 30
        assert chosen == engine.threads == cores - 1  # a tiny MLP's forward is far shorter than the loop's work
        inst = engine.instances[0]
        assert inst.executor.submit(torch.get_num_threads).result() == chosen
        assert torch.get_num_threads() == main_threads  # the caller's thread keeps its own
        out = engine.forward(np.zeros((3, 16), dtype=np.float32), inst)
        assert out.shape == (3, 4)
    finally:
        engine.close()
