"""The engine alone: one model, cast once, run in its own thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
from torch import nn

from halfserve import store
from halfserve.engine import runners
from halfserve.engine.core import Engine, batch_buckets
from halfserve.engine.inputs import Normalizer
from halfserve.engine.loop import LoopRunner
from halfserve.engine.protocol import EngineError
from halfserve.manifest import DataType, Normalize, Precision, TensorSpec
from halfserve.placement import LOOP_STALL_FLOOR_SECONDS, LoopStalls, Placement
from halfserve.precision import resolve_device
from halfserve.serving import Output
from tests.conftest import save_tiny_mlp

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def loaded(tmp_path: Path) -> store.LoadedModel:
    save_tiny_mlp(tmp_path)
    return store.load(tmp_path, "tiny")


T = TypeVar("T")


def spy_forward(engine: Engine, what: Callable[[], T]) -> list[T]:
    """What ``what`` says at each forward of ``engine``'s model from now on (the thread it runs on, say), in order."""
    seen: list[T] = []
    original = engine.model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(what())
        return original(x)

    engine.model.forward = spy  # type: ignore[method-assign]
    return seen


def thread_name() -> str:
    return threading.current_thread().name


def test_batch_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize(
    "spec",
    [
        Normalize(scale=1 / 255, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        Normalize(scale=0.5),
        Normalize(mean=[1, 2, 3]),
        Normalize(scale=2, std=[1, 2, 4]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_normalizer_computes_the_manifest_formula_in_fp32(spec: Normalize, dtype: torch.dtype) -> None:
    x = torch.randint(0, 256, (4, 3, 5, 5)).to(dtype)
    want = x.double() * spec.scale
    if spec.mean is not None:
        want = want - torch.tensor(spec.mean, dtype=torch.float64).reshape(1, -1, 1, 1)
    if spec.std is not None:
        want = want / torch.tensor(spec.std, dtype=torch.float64).reshape(1, -1, 1, 1)
    got = Normalizer(spec, 3, CPU)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("mode", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_engine_casts_a_copy_and_leaves_the_host_weights_fp32(
    loaded: store.LoadedModel, mode: str, dtype: torch.dtype
) -> None:
    engine = Engine(loaded, Precision(mode), CPU)
    assert {p.dtype for p in engine.model.parameters()} == {dtype}
    assert {p.dtype for p in loaded.module.parameters()} == {torch.float32}
    assert engine.info.weight_bytes == sum(p.numel() for p in loaded.module.parameters()) * dtype.itemsize
    engine.close()


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_plan_s_modules_kept_in_fp32_compute_exactly_as_fp32_does(loaded: store.LoadedModel, mode: str) -> None:
    # A kept module that reads the model's input reads it as it came: rounded to the half dtype on the way in, it
    # moved a fragile classifier's scores with nothing else of the model left in half precision.
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    fp32 = Engine(loaded, Precision.FP32, CPU)
    first, every = (
        Engine(loaded, Precision(mode), CPU, fp32_modules=("net.0",)),
        Engine(loaded, Precision(mode), CPU, fp32_modules=("net.0", "net.2")),
    )
    try:
        seen: dict[Engine, torch.Tensor] = {}
        for engine in (fp32, first):
            hook = engine.model.get_submodule("net.0").register_forward_hook(
                lambda _m, _a, out, engine=engine: seen.__setitem__(engine, out.clone())
            )
            engine.compute(x)
            hook.remove()
        assert seen[first].dtype == torch.float32
        assert torch.equal(seen[first], seen[fp32])
        assert {p.dtype for p in every.model.parameters()} == {torch.float32}
        np.testing.assert_array_equal(every.compute(x), fp32.compute(x))
    finally:
        for engine in (fp32, first, every):
            engine.close()


@pytest.mark.parametrize(("mode", "shared"), [("fp32", True), ("autocast", True), ("bf16", False), ("fp16", False)])
def test_fp32_weights_on_the_cpu_are_held_once(loaded: store.LoadedModel, mode: str, shared: bool) -> None:
    engine = Engine(loaded, Precision(mode), CPU)
    host = {p.data_ptr() for p in loaded.module.parameters()}
    served = {p.data_ptr() for p in engine.model.parameters()}
    assert (served == host) is shared
    assert served.isdisjoint(host) is not shared
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    with torch.inference_mode():
        want = loaded.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(engine.forward(x), want, rtol=0.05, atol=0.05)
    engine.close()


def test_run_batch_returns_one_float32_output_per_chunk(loaded: store.LoadedModel) -> None:
    engine = Engine(loaded, Precision.FP32, CPU)
    chunks = [np.random.default_rng(i).standard_normal((n, 16)).astype(np.float32) for i, n in enumerate((1, 3, 2))]
    outcomes = engine.run_batch(chunks)
    assert all(isinstance(o, Output) and o.precision == "fp32" for o in outcomes)
    outs = [o.data for o in outcomes if isinstance(o, Output)]
    assert [o.shape for o in outs] == [(1, 4), (3, 4), (2, 4)]
    assert all(o.dtype == np.float32 for o in outs)
    with torch.inference_mode():
        want = loaded.module(torch.from_numpy(np.concatenate(chunks))).numpy()
    np.testing.assert_allclose(np.concatenate(outs), want, rtol=1e-6, atol=1e-6)
    assert engine.forwards == 1  # the chunks ran as one batch
    engine.close()


async def test_forward_runs_off_the_event_loop_thread(loaded: store.LoadedModel) -> None:
    engine = Engine(loaded, Precision.FP32, CPU)
    seen = spy_forward(engine, thread_name)
    await engine.run([np.zeros((2, 16), dtype=np.float32)])
    assert len(seen) == 1
    assert seen[0].startswith("engine-tiny")
    assert seen[0] != threading.current_thread().name  # not the event loop's thread
    engine.close()


async def test_forwards_on_the_event_loop_past_their_budget_move_the_engines_batches_to_its_instance_thread(
    loaded: store.LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    engine = Engine(loaded, Precision.FP32, CPU)
    engine.batch_seconds = 0.2e-3  # the warm-up's forward of a full batch, made up: its bound is the floor
    runners.place(engine, Placement.EVENT_LOOP, 8)
    runner = engine.runner
    assert isinstance(runner, LoopRunner)
    assert runner.stalls.bound == LOOP_STALL_FLOOR_SECONDS
    seen = spy_forward(engine, thread_name)
    x = np.zeros((2, 16), dtype=np.float32)
    try:
        await engine.run([x])  # a fast forward stays on the loop
        assert engine.placement is Placement.EVENT_LOOP
        runner.stalls = LoopStalls(runner.stalls.bound)  # what a pause of this host might have made of it forgotten
        now = time.perf_counter()
        with caplog.at_level("INFO", logger="halfserve.engine.loop"):
            runner.ran_long(
                now + 100.0, 6.1, 2
            )  # what run does after a forward that took 6.1 s: one may be a host pause
            assert engine.placement is Placement.EVENT_LOOP
            assert engine.info.placement_changed is None
            assert [r.levelname for r in caplog.records] == ["INFO"]
            runner.ran_long(now + 103.0, 0.4, 2)  # a second, 0.4 s past the budget of 0.1 s
        assert engine.placement is Placement.INSTANCE_THREADS
        assert engine.info.placement == Placement.INSTANCE_THREADS
        why = engine.info.placement_changed
        assert why is not None
        assert "2 forwards on the event loop's thread ran past their bound of 10 ms" in why
        assert "10x its warm-up forward of 0.20 ms" in why
        assert "within 9.100 s, 6.500 s together; less the longest (6.100 s), past their budget of 100 ms" in why
        assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
        assert "model tiny: a forward of 2 row(s)" in caplog.records[0].getMessage()
        assert "model tiny: 2 forwards" in caplog.records[1].getMessage()
        out = await engine.run([x])
        assert len(out) == 1
        assert seen[0] == threading.current_thread().name
        assert seen[1].startswith("engine-tiny")  # the instance's thread, not the loop's
    finally:
        engine.close()


@pytest.mark.parametrize("threads", [None, 1])
async def test_an_engine_on_the_event_loop_runs_each_batch_there_at_once(
    loaded: store.LoadedModel, threads: int | None
) -> None:
    engine = Engine(loaded, Precision.FP32, CPU)
    runners.place(engine, Placement.EVENT_LOOP, 8)
    engine.threads = threads
    seen = spy_forward(engine, lambda: (thread_name(), torch.get_num_threads()))
    caller_threads = torch.get_num_threads()
    chunks = [np.random.default_rng(i).standard_normal((n, 16)).astype(np.float32) for i, n in enumerate((1, 3))]
    try:
        future = engine.run(chunks)
        assert future.done()  # ran before run returned: nothing was handed to another thread
        outs = [o.data for o in future.result() if isinstance(o, Output)]
        assert seen == [(threading.current_thread().name, threads or caller_threads)]
        with torch.inference_mode():
            want = loaded.module(torch.from_numpy(np.concatenate(chunks))).numpy()
        np.testing.assert_allclose(np.concatenate(outs), want, rtol=1e-6, atol=1e-6)
        engine.model.forward = lambda x: x[:1]  # type: ignore[assignment,method-assign]
        failed = engine.run(chunks)
        assert failed.done()
        with pytest.raises(EngineError):
            failed.result()
    finally:
        torch.set_num_threads(caller_threads)
        engine.close()


def test_a_model_that_drops_rows_is_caught(loaded: store.LoadedModel) -> None:
    engine = Engine(loaded, Precision.FP32, CPU)

    class DropsRows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:-1]

    engine.model = DropsRows()
    with pytest.raises(EngineError, match="batch size mismatch: model returned 2 rows for 3 inputs"):
        engine.forward(np.zeros((3, 16), dtype=np.float32))
    engine.close()


def test_warmup_runs_every_bucket(loaded: store.LoadedModel) -> None:
    engine = Engine(loaded, Precision.BF16, CPU)
    engine.warmup(8)
    assert engine.forwards == len(batch_buckets(8))
    engine.close()


def test_cuda_device_is_refused_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["fp16", "bf16", "autocast"])
def test_cuda_engine_agrees_with_fp32(loaded: store.LoadedModel, mode: str) -> None:
    engine = Engine(loaded, Precision(mode), torch.device("cuda"))
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    got = engine.forward(x)
    with torch.inference_mode():
        want = loaded.module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), rtol=0)
    assert next(engine.model.parameters()).is_cuda
    engine.close()


@pytest.mark.parametrize("datatype", [DataType.FP64, DataType.FP32, DataType.FP16])
def test_warm_up_batches_take_the_dtype_requests_arrive_as(tmp_path: Path, datatype: DataType) -> None:
    """One map from a manifest's datatype to the batcher's arrays: warm-up (and the graphs it captures) must run the
    dtype a request decodes to, or the first real batches meet a shape the warm-up never ran."""
    from halfserve.api.dataplane.codec import decode_samples

    save_tiny_mlp(tmp_path, inputs=[TensorSpec(name="features", shape=[16], datatype=datatype)])
    loaded = store.load(tmp_path, "tiny")
    request = decode_samples([[0.5] * 16], loaded.manifest.inputs[0])
    engine = Engine(loaded, Precision.FP32, CPU)
    seen: list[torch.dtype] = []
    upload = engine.instances[0].upload

    def spy(chunks: list[np.ndarray], size: int) -> torch.Tensor:
        seen.append(torch.from_numpy(chunks[0]).dtype)
        return upload(chunks, size)

    engine.instances[0].upload = spy  # type: ignore[method-assign]
    engine.warmup(2)
    engine.forward(request)
    assert request.dtype == datatype.numpy
    assert seen == [torch.from_numpy(request).dtype] * 3
    engine.close()
