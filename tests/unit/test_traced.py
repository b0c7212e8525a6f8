"""A CPU forward traced and run beside the event loop (halfserve.engine.traced, halfserve.engine.pipelined,
halfserve.placement.in_process)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from halfserve import store
from halfserve.engine import runners
from halfserve.engine.core import Engine
from halfserve.engine.intraop import fixed_timing
from halfserve.engine.traced import TracedForward, TraceRefused
from halfserve.manifest import Precision
from halfserve.placement import (
    BESIDE_LOOP_MIN_ROWS,
    BESIDE_LOOP_MIN_SHARE,
    LOOP_SECONDS_PER_ROW,
    Placement,
    in_process,
)
from halfserve.serving import Output
from tests.conftest import save_tiny_mlp, tiny_engines
from tests.waiting import DEADLINE_S

CPU = torch.device("cpu")


def beside_loop(engine: Engine, setting: bool | None) -> bool:
    if setting is False:  # never beside the loop, otherwise as the timing says
        return in_process(engine, None, traced=False) is Placement.BESIDE_LOOP
    return in_process(engine, Placement.BESIDE_LOOP if setting else None) is Placement.BESIDE_LOOP


class Branchy(nn.Module):
    """Branches in Python on its input's values: a trace would keep one branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x * 3


class Counting(nn.Module):
    """Reads Python state that changes between calls: a trace would keep the value it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.calls


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x * 2


def test_a_traced_forward_gives_the_models_outputs() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    batches = [torch.randn(8, 16), torch.randn(1, 16)]
    traced = TracedForward.trace(model, model, batches)
    x = torch.randn(5, 16)
    future = traced.launch(x)
    future.wait()
    with torch.inference_mode():
        want = model(x)
    # Close, not equal: the graph runs on the inter-op pool's thread, whose OpenMP thread count is the one of the
    # thread that started the pool (an earlier test may have set another), and a GEMM split another way rounds
    # otherwise in the last bits.
    torch.testing.assert_close(future.value(), want, rtol=1e-5, atol=1e-6)


def test_a_failing_graph_fails_its_future() -> None:
    model = nn.Linear(16, 4).eval()
    traced = TracedForward.trace(model, model, [torch.randn(2, 16)])
    future = traced.launch(torch.randn(2, 15))
    with pytest.raises(RuntimeError):
        future.wait()


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (Branchy(), "tracing warned"),
        (Counting(), "differs"),
        (Pair(), "differs"),  # a tuple of outputs, not a tensor
    ],
)
def test_a_model_a_trace_would_get_wrong_is_refused(model: nn.Module, why: str) -> None:
    batches = [torch.randn(4, 16), -torch.ones(1, 16)]
    with pytest.raises(TraceRefused, match=why):
        TracedForward.trace(model, model, batches)


async def test_an_engine_beside_the_loop_answers_as_it_runs_batches_eagerly(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, CPU, max_batch_size=8)
    try:
        assert engine.batches(8) == (8, 1)  # one batch in flight per instance, of up to max_batch_size
        runners.place(engine, Placement.BESIDE_LOOP, 8)
        assert engine.placement is Placement.BESIDE_LOOP
        assert engine.batches(8) == (4, 2)  # two in flight, each of up to half
        assert engine.batches(1) == (1, 2)
        assert engine.info.placement is Placement.BESIDE_LOOP
        rng = np.random.default_rng(0)
        batches = [[rng.standard_normal((n, 16)).astype(np.float32) for n in sizes] for sizes in ((1, 3), (8,), (2,))]
        futures = [engine.run(chunks) for chunks in batches]  # three in flight at once
        assert not all(f.done() for f in futures)  # launched, not run before run returned
        for chunks, future in zip(batches, futures, strict=True):
            got = [o.data for o in await future if isinstance(o, Output)]
            want = [o.data for o in engine.run_batch(chunks) if isinstance(o, Output)]
            assert len(got) == len(want) == len(chunks)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
        assert engine.forwards >= 3
        with pytest.raises(RuntimeError):  # a batch the graph cannot take fails its future, not the loop
            await engine.run([np.zeros((2, 15), dtype=np.float32)])
        assert (await engine.run([np.zeros((1, 16), dtype=np.float32)]))[0].data.shape == (1, 4)
    finally:
        engine.close()


async def test_the_event_loop_runs_while_a_traced_forward_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8))).eval()
    x = torch.randn(256, 512)
    traced = TracedForward.trace(model, model, [x])
    future = traced.launch(x)
    iterations = 0
    deadline = time.monotonic() + DEADLINE_S
    while not future.done():  # the loop's own Python runs: the graph holds no GIL
        assert time.monotonic() < deadline, "the traced forward never finished"
        iterations += 1
        await asyncio.sleep(0)
    assert iterations > 10
    with torch.inference_mode():
        assert torch.equal(future.value(), model(x))


def test_batches_run_beside_the_loop_where_the_forward_is_a_large_share_of_the_loops_work(tmp_path: Path) -> None:
    one, two = tiny_engines(tmp_path)
    autocast = Engine(store.load(tmp_path, "tiny"), Precision.AUTOCAST, CPU, max_batch_size=8)
    try:
        assert not beside_loop(one, None)  # not timed yet
        assert beside_loop(one, True)
        one.settle_threads(8, 2, fixed_timing(8 * LOOP_SECONDS_PER_ROW / 10))  # made up: a tenth of the loop's work
        assert one.loop_bound
        assert one.threads == 1
        assert one.batch_rows == 8
        assert one.batch_seconds is not None
        one.batch_seconds = BESIDE_LOOP_MIN_SHARE * 8 * LOOP_SECONDS_PER_ROW
        assert not beside_loop(one, None)  # a full batch of 8 rows: its halves would hardly batch
        rows = one.batch_rows = BESIDE_LOOP_MIN_ROWS
        one.batch_seconds = BESIDE_LOOP_MIN_SHARE * rows * LOOP_SECONDS_PER_ROW * 0.99
        assert not beside_loop(one, None)  # below the share
        one.batch_seconds = BESIDE_LOOP_MIN_SHARE * rows * LOOP_SECONDS_PER_ROW
        assert beside_loop(one, None)
        assert not beside_loop(one, False)
        one.cores = 1  # no core for the graph beside the loop's
        assert not beside_loop(one, None)
        one.cores = 2
        one.threads = 2  # a forward on more threads than the loop can spare runs where it would have
        assert not beside_loop(one, None)
        one.threads, one.loop_bound = 1, False  # longer than the loop's work: on its instance thread, all cores
        assert not beside_loop(one, None)
        assert not beside_loop(two, True)  # several instances run their batches side by side on their threads
        assert not beside_loop(autocast, True)  # its casts follow a thread's autocast state; the pool has none
        with pytest.raises(ValueError, match="autocast"):
            runners.place(autocast, Placement.BESIDE_LOOP, 8)
    finally:
        one.close()
        two.close()
        autocast.close()
