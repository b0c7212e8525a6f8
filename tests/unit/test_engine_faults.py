"""The engine under faults: out of memory becomes a smaller batch, half-precision overflow follows the policy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from halfserve import store
from halfserve.batching import Batcher
from halfserve.engine.core import Engine
from halfserve.engine.faults import is_out_of_memory
from halfserve.engine.protocol import PrecisionOverflowError
from halfserve.errors import BatchTooLargeError
from halfserve.manifest import OverflowPolicy, Precision
from halfserve.serving import Output
from tests.conftest import save_tiny_mlp
from tests.fault_models import Poisonable, save_overflowing_linear

CPU = torch.device("cpu")
BIG = np.full((1, 4), 100.0, np.float32)  # output 0 is 80000: inf in fp16
SMALL = np.full((2, 4), 1.0, np.float32)  # output 0 is 800: fine in fp16


def overflowing(tmp_path: Path, policy: OverflowPolicy) -> store.LoadedModel:
    save_overflowing_linear(tmp_path, "hot", policy)
    return store.load(tmp_path, "hot")


def fp32_reference(loaded: store.LoadedModel, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return loaded.module(torch.from_numpy(x)).numpy()


def test_the_test_model_really_overflows_fp16_and_not_fp32(tmp_path: Path) -> None:
    loaded = overflowing(tmp_path, OverflowPolicy.ALLOW)
    engine = Engine(loaded, Precision.FP16, CPU)
    assert np.isinf(engine.forward(BIG)[0, 0])
    assert np.isfinite(fp32_reference(loaded, BIG)).all()
    assert fp32_reference(loaded, BIG)[0, 0] == pytest.approx(80000.0)
    engine.close()


def test_rerun_fp32_reruns_only_the_overflowing_chunk_in_fp32(tmp_path: Path) -> None:
    loaded = overflowing(tmp_path, OverflowPolicy.RERUN_FP32)
    engine = Engine(loaded, Precision.FP16, CPU)
    big, small = engine.run_batch([BIG, SMALL])
    assert isinstance(big, Output)
    assert isinstance(small, Output)
    assert big.precision == "fp32"
    np.testing.assert_array_equal(big.data, fp32_reference(loaded, BIG))
    assert small.precision == "fp16"
    np.testing.assert_allclose(small.data, fp32_reference(loaded, SMALL), rtol=1e-3)
    assert (engine.overflows, engine.fp32_reruns) == (1, 1)
    engine.close()


def test_error_policy_fails_only_the_overflowing_chunk(tmp_path: Path) -> None:
    engine = Engine(overflowing(tmp_path, OverflowPolicy.ERROR), Precision.FP16, CPU)
    small, big = engine.run_batch([SMALL, BIG])
    assert isinstance(big, PrecisionOverflowError)
    assert "fp16 overflow" in str(big)
    assert isinstance(small, Output)
    assert small.precision == "fp16"
    assert (engine.overflows, engine.fp32_reruns) == (1, 0)
    engine.close()


def test_allow_policy_passes_infinity_through(tmp_path: Path) -> None:
    engine = Engine(overflowing(tmp_path, OverflowPolicy.ALLOW), Precision.FP16, CPU)
    (out,) = engine.run_batch([BIG])
    assert isinstance(out, Output)
    assert out.precision == "fp16"
    assert np.isinf(out.data[0, 0])
    assert engine.overflows == 1
    engine.close()


def test_non_finite_input_is_not_an_overflow(tmp_path: Path) -> None:
    engine = Engine(overflowing(tmp_path, OverflowPolicy.ERROR), Precision.FP16, CPU)
    x = np.array([[np.nan, 1, 1, 1]], np.float32)
    (out,) = engine.run_batch([x])
    assert isinstance(out, Output)
    assert np.isnan(out.data).all()
    assert engine.overflows == 0
    engine.close()


def test_bf16_has_fp32s_range_and_fp32_keeps_no_fallback_copy(tmp_path: Path) -> None:
    loaded = overflowing(tmp_path, OverflowPolicy.RERUN_FP32)
    bf16 = Engine(loaded, Precision.BF16, CPU)
    (out,) = bf16.run_batch([BIG])
    assert isinstance(out, Output)
    assert out.precision == "bf16"
    assert np.isfinite(out.data).all()
    fp32 = Engine(loaded, Precision.FP32, CPU)
    assert not fp32.guard.guarded
    assert fp32.guard.fp32 is None
    bf16.close()
    fp32.close()


def test_out_of_memory_is_reported_as_a_batch_too_large(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP32, CPU)
    engine.model = Poisonable(engine.model, oom_above=2)
    with pytest.raises(BatchTooLargeError, match="out of memory on cpu running 3 rows"):
        engine.run_batch([np.zeros((3, 16), np.float32)])
    assert len(engine.run_batch([np.zeros((2, 16), np.float32)])) == 1
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    engine.close()


async def test_engine_and_batcher_together_shrink_the_batch_and_answer_everyone(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    loaded = store.load(tmp_path, "tiny")
    engine = Engine(loaded, Precision.FP32, CPU)
    fake = Poisonable(engine.model, oom_above=4)
    engine.model = fake
    batcher = Batcher(engine.run, max_batch_size=16, max_delay=0.05, max_queue_rows=64)
    batcher.start()
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    outs = await asyncio.gather(*(batcher.infer(x[i : i + 1]) for i in range(16)))
    np.testing.assert_allclose(np.concatenate(outs), fp32_reference(loaded, x), rtol=1e-5, atol=1e-6)
    assert batcher.max_batch_size == 4
    assert fake.sizes[:3] == [16, 8, 4]
    await batcher.stop()
    engine.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Greedy(torch.nn.Module):
    """Allocates far more device memory than exists for a batch of more than ``rows`` rows: a real CUDA OOM."""

    def __init__(self, inner: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            torch.empty(2**50, dtype=torch.uint8, device=x.device)
        y: torch.Tensor = self.inner(x)
        return y


@pytest.mark.gpu
@cuda
def test_a_real_cuda_out_of_memory_becomes_a_batch_too_large(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    engine = Engine(store.load(tmp_path, "tiny"), Precision.FP16, torch.device("cuda"))
    engine.model = Greedy(engine.model, rows=2)
    with pytest.raises(BatchTooLargeError, match="out of memory on cuda"):
        engine.run_batch([np.zeros((3, 16), np.float32)])
    (out,) = engine.run_batch([np.zeros((2, 16), np.float32)])
    assert isinstance(out, Output)
    engine.close()


@pytest.mark.gpu
@cuda
def test_cuda_fp16_overflow_is_rerun_in_fp32_on_the_host(tmp_path: Path) -> None:
    loaded = overflowing(tmp_path, OverflowPolicy.RERUN_FP32)
    engine = Engine(loaded, Precision.FP16, torch.device("cuda"))
    big, small = engine.run_batch([BIG, SMALL])
    assert isinstance(big, Output)
    assert isinstance(small, Output)
    assert (big.precision, small.precision) == ("fp32", "fp16")
    np.testing.assert_array_equal(big.data, fp32_reference(loaded, BIG))
    engine.close()
