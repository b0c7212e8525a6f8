"""Each engine's intra-op threads, chosen from its own forward's time."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import store
from halfserve.engine.core import Engine
from halfserve.engine.intraop import Settled, fixed_timing, set_intra_op_threads, settle
from halfserve.manifest import Precision
from halfserve.placement import (
    LOOP_SECONDS_PER_ROW,
    Placement,
    in_process,
    intra_op_threads,
    loop_bound,
)
from tests.conftest import save_tiny_mlp, tiny_engines


def on_event_loop(engine: Engine, setting: bool | None) -> bool:
    wanted = {True: Placement.EVENT_LOOP, False: Placement.INSTANCE_THREADS, None: None}[setting]
    return in_process(engine, wanted, traced=False) is Placement.EVENT_LOOP


def test_one_core_is_kept_for_the_event_loop_only_where_the_forward_is_shorter_than_its_work() -> None:
    rows = 64
    loop_work = rows * LOOP_SECONDS_PER_ROW
    assert intra_op_threads(loop_work / 10, rows, cores=2) == 1
    assert intra_op_threads(loop_work / 10, rows, cores=16) == 15
    assert intra_op_threads(loop_work * 10, rows, cores=2) == 2
    assert intra_op_threads(loop_work * 1.01, rows, cores=8) == 8
    assert intra_op_threads(loop_work / 10, rows, cores=1) == 1  # a single core is never given up


SHORT = fixed_timing(8 * LOOP_SECONDS_PER_ROW / 10)
"""A made-up forward of 8 rows, a tenth of the event loop's work on them."""


def test_settling_one_thread_is_a_step_of_the_timing_given_and_sets_that_thread_alone() -> None:
    """``settle`` without an engine: with a timing given, no forward runs; the thread it runs on gets the count
    chosen, and says what it had before (the count it warmed up at)."""
    forwards: list[int] = []

    def on_a_thread() -> tuple[Settled, int]:
        set_intra_op_threads(2)
        settled = settle(lambda: forwards.append(1), "tiny[0]", 8, 4, SHORT)
        return settled, torch.get_num_threads()

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        settled, after = pool.submit(on_a_thread).result()
    finally:
        pool.shutdown()
    assert settled == Settled(threads=3, warmed_at=2, loop_bound=True, batch_seconds=SHORT(3))
    assert after == 3
    assert forwards == []  # the made-up timing stands for every forward


def test_an_engine_settles_its_threads_on_its_instance_thread_only(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, torch.device("cpu"), max_batch_size=8)
    try:
        main_threads = torch.get_num_threads()
        chosen = engine.settle_threads(8, 4, SHORT)
        assert chosen == engine.threads == 3  # a forward shorter than the loop's work leaves the loop a core
        inst = engine.instances[0]
        assert inst.executor.submit(torch.get_num_threads).result() == chosen
        assert torch.get_num_threads() == main_threads  # the caller's thread keeps its own
        out = engine.forward(np.zeros((3, 16), dtype=np.float32), inst)
        assert out.shape == (3, 4)
    finally:
        engine.close()


def test_settling_decides_from_the_forwards_timing_alone(tmp_path: Path) -> None:
    rows, cores = 8, 4
    loop_work = rows * LOOP_SECONDS_PER_ROW
    asked: list[int] = []

    def timing(threads: int) -> float:  # made up: the forward halves on each thread given to it
        asked.append(threads)
        return factor * loop_work / threads

    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, torch.device("cpu"), max_batch_size=rows)
    try:
        factor = 8.0  # on 4 cores twice the loop's work: the forward bounds throughput, every core
        assert engine.settle_threads(rows, cores, timing) == cores
        assert asked == [cores]  # the settled count is the timed one: timed once
        assert (engine.loop_bound, engine.batch_seconds, engine.batch_rows, engine.cores) == (
            False,
            2 * loop_work,
            rows,
            cores,
        )
        asked.clear()
        factor = 0.4  # a tenth of the loop's work on 4 cores: the loop bounds it, one core is kept for the loop
        assert engine.settle_threads(rows, cores, timing) == cores - 1
        assert asked == [cores, cores - 1]  # the batch's time is taken again at the count it runs on
        assert engine.loop_bound is True
        assert engine.batch_seconds == pytest.approx(0.4 * loop_work / 3)
        assert engine.instances[0].executor.submit(torch.get_num_threads).result() == cores - 1
        asked.clear()
        assert engine.settle_threads(rows, 1, timing) == 1  # a single core is never given up
        assert asked == [1]
    finally:
        engine.close()


def test_batches_run_on_the_event_loop_where_the_forward_is_loop_bound_on_a_cpu_with_one_instance(
    tmp_path: Path,
) -> None:
    rows = 64
    assert loop_bound(rows * LOOP_SECONDS_PER_ROW / 10, rows)
    assert not loop_bound(rows * LOOP_SECONDS_PER_ROW * 1.01, rows)
    one, two = tiny_engines(tmp_path)
    try:
        assert not on_event_loop(one, None)  # not timed yet
        assert on_event_loop(one, True)
        one.settle_threads(8, 2, SHORT)
        two.settle_threads(8, 2, SHORT)
        assert one.loop_bound is two.loop_bound is True
        assert one.threads == 1
        assert on_event_loop(one, None)
        assert not on_event_loop(one, False)
        assert not on_event_loop(two, None)
        assert not on_event_loop(two, True)  # its instances run batches side by side, each on its thread
        one.threads = 3  # where a loop-bound forward gets more than one thread (4 cores), only when asked
        assert not on_event_loop(one, None)
        assert on_event_loop(one, True)
        one.settle_threads(8, 2, fixed_timing(8 * LOOP_SECONDS_PER_ROW * 1.01))  # longer than the loop's work
        assert (one.threads, one.loop_bound) == (2, False)
        assert not on_event_loop(one, None)
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("helper", [True, False])
def test_a_threads_count_set_before_its_first_use_stays_its_own_only_through_the_helper(helper: bool) -> None:
    # torch gives a fresh thread the process's last setting when the thread first asks, over a count it set before.
    set_first, changed = threading.Event(), threading.Event()
    seen: list[int] = []

    def fresh_thread() -> None:
        if helper:
            set_intra_op_threads(3)
        else:
            torch.set_num_threads(3)
        set_first.set()
        changed.wait(timeout=10)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    thread = threading.Thread(target=fresh_thread)
    thread.start()
    try:
        assert set_first.wait(timeout=10)
        torch.set_num_threads(1)  # another thread (another model's instance) sets its own count
    finally:
        changed.set()
        thread.join(timeout=10)
        torch.set_num_threads(before)
    # Without the helper the thread had the process's last setting (1, unless something else in the process set
    # another meanwhile), not its own.
    assert (seen == [3]) is helper, seen
