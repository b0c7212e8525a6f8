"""The engine's fast path: batch buckets with padding, several instances, pinned staging and CUDA graphs.

Buckets, padding and instances run on a CPU too; pinned memory, streams and graphs need CUDA (marked ``gpu``).
"""

from __future__ import annotations

import asyncio
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from halfserve import models, store
from halfserve.batching import Batcher
from halfserve.compilation import tune_cudnn
from halfserve.engine.core import Engine
from halfserve.engine.intraop import fixed_timing, set_intra_op_threads
from halfserve.execution import Batching, Compile, Execution
from halfserve.instance import bucket_for, pin_host, pinned
from halfserve.manifest import DataType, Manifest, Normalize, Precision, TensorSpec
from halfserve.placement import LOOP_SECONDS_PER_ROW, pads_to_buckets
from halfserve.serving import Output
from tests.conftest import needs_cxx, save_tiny_mlp

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def compiled_graphs(engine: Engine) -> int:
    """Graphs torch.compile holds for ``engine``'s forward: its own code object's entries, so what anything else in the
    process compiles meanwhile (another test's server warming up in the background) does not count, as it would in
    dynamo's process-wide ``unique_graphs``."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(engine._compiled_code))


def recompiles(engine: Engine) -> list[str]:
    """Why torch.compile compiled ``engine``'s forward again each time it did, in order (dynamo's guard failures for
    its code object)."""
    return [str(r) for r in torch._dynamo.utils.guard_failures.get(engine._compiled_code, [])]


def caused_by(reasons: list[str], *causes: str) -> list[str]:
    """The recompiles among ``reasons`` that name one of ``causes`` (a batch's ``size mismatch``, a thread's
    ``num_threads``...)."""
    return [r for r in reasons if any(c in r for c in causes)]


def tiny(tmp_path: Path, **execution: object) -> store.LoadedModel:
    save_tiny_mlp(tmp_path, execution=Execution.model_validate(execution))
    return store.load(tmp_path, "tiny")


def small_cnn(tmp_path: Path, **execution: object) -> store.LoadedModel:
    """A two-stage bottleneck ResNet on 3x16x16 images, saved through the store."""
    kwargs = {"width": 8, "blocks": [1, 1], "block": "bottleneck", "channels_last": False}
    torch.manual_seed(0)
    module = models.build("resnet_bench", **kwargs)
    manifest = Manifest(
        name="cnn",
        architecture="resnet_bench",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="image", shape=[3, 16, 16])],
        outputs=[TensorSpec(name="logits", shape=[10])],
        batching=Batching(max_batch_size=8),
        execution=Execution.model_validate(execution),
    )
    store.save(tmp_path, manifest, module)
    return store.load(tmp_path, "cnn")


def reference(loaded: store.LoadedModel, x: np.ndarray) -> np.ndarray:
    # The class's forward: tests spy on the engine's model through an instance attribute, and an fp32 engine on the
    # CPU serves the host module itself.
    module = loaded.module
    with torch.inference_mode():
        out: np.ndarray = type(module).forward(module, torch.from_numpy(x)).numpy()
    return out


def forward_batch_sizes(engine: Engine) -> list[int]:
    """The batch size of each forward the engine's model runs from now on (a spy on its ``forward``)."""
    seen: list[int] = []
    original = engine.model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return original(x)

    engine.model.forward = spy  # type: ignore[method-assign]
    return seen


def rows(n: int, features: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, features)).astype(np.float32)


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_rows() -> None:
    buckets = [1, 2, 4, 8, 12]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert bucket_for(13, buckets) == 13  # past the largest: run as is
    assert bucket_for(3, []) == 3


def test_execution_defaults_and_validation() -> None:
    ex = Execution()
    assert (ex.instances, ex.pad_to_bucket, ex.compile, ex.channels_last) == (1, None, Compile.NONE, None)
    with pytest.raises(ValidationError, match="needs pad_to_bucket"):
        Execution(compile=Compile.CUDA_GRAPHS, pad_to_bucket=False)
    with pytest.raises(ValidationError, match="inductor.*needs pad_to_bucket"):
        Execution(compile=Compile.INDUCTOR, pad_to_bucket=False)
    with pytest.raises(ValidationError, match="instances"):
        Execution(instances=0)


def test_padding_is_off_on_a_cpu_unless_asked(tmp_path: Path) -> None:
    engine = Engine(tiny(tmp_path), Precision.FP32, CPU, max_batch_size=8)
    assert (engine.pad, engine.buckets, engine.cuda_graphs, engine.channels_last) == (False, [], False, False)
    engine.close()


def test_padded_batches_run_the_bucket_size_and_return_only_their_rows(tmp_path: Path) -> None:
    loaded = tiny(tmp_path, pad_to_bucket=True)
    engine = Engine(loaded, Precision.FP32, CPU, max_batch_size=8)
    assert engine.buckets == [1, 2, 4, 8]
    seen = forward_batch_sizes(engine)
    chunks = [rows(2, seed=1), rows(1, seed=2), rows(2, seed=3)]
    outcomes = engine.run_batch(chunks)
    assert seen == [8]  # 5 rows padded up to the bucket of 8
    outs = [o.data for o in outcomes if isinstance(o, Output)]
    assert [o.shape for o in outs] == [(2, 4), (1, 4), (2, 4)]
    np.testing.assert_allclose(np.concatenate(outs), reference(loaded, np.concatenate(chunks)), rtol=1e-5, atol=1e-6)
    # The staging buffer is reused: a smaller batch of the same bucket leaves no stale rows in its output.
    out = engine.forward(rows(3, seed=4))
    assert seen == [8, 4]
    np.testing.assert_allclose(out, reference(loaded, rows(3, seed=4)), rtol=1e-5, atol=1e-6)
    engine.close()


def test_warmup_sets_the_buckets_when_padding(tmp_path: Path) -> None:
    engine = Engine(tiny(tmp_path, pad_to_bucket=True), Precision.BF16, CPU)
    assert engine.buckets == []
    engine.warmup(6)
    assert engine.buckets == [1, 2, 4, 6]
    assert engine.info.buckets == (1, 2, 4, 6)
    engine.close()


def test_cuda_graphs_are_ignored_on_a_cpu(tmp_path: Path) -> None:
    engine = Engine(tiny(tmp_path, compile="cuda_graphs"), Precision.FP32, CPU, max_batch_size=4)
    engine.warmup(4)
    assert not engine.cuda_graphs
    assert engine.info.graph_capture_seconds == 0.0
    engine.close()


def test_channels_last_on_request_for_conv_models(tmp_path: Path) -> None:
    loaded = small_cnn(tmp_path, channels_last=True)
    engine = Engine(loaded, Precision.FP32, CPU)
    assert engine.channels_last
    conv = next(m for m in engine.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    x = np.random.default_rng(0).uniform(0, 1, (3, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(engine.forward(x), reference(loaded, x), rtol=1e-4, atol=1e-4)
    engine.close()
    # Not for a model without 2-D convolutions, whatever the manifest says.
    assert not Engine(tiny(tmp_path / "mlp", channels_last=True), Precision.FP32, CPU).channels_last


async def test_instances_share_the_weights_and_each_takes_batches_on_its_own_thread(tmp_path: Path) -> None:
    loaded = tiny(tmp_path, instances=2)
    engine = Engine(loaded, Precision.FP32, CPU)
    assert len(engine.instances) == 2
    assert engine.info.instances == 2
    threads: set[str] = set()
    both_running = threading.Barrier(2, timeout=10)
    original = engine.model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        both_running.wait()  # returns only once two forwards run at the same time
        return original(x)

    engine.model.forward = spy  # type: ignore[method-assign]
    batcher = Batcher(engine.run, max_batch_size=2, max_delay=0.0, max_queue_rows=64, concurrency=2)
    batcher.start()
    xs = [rows(2, seed=i) for i in range(2)]
    outs = await asyncio.gather(*(batcher.infer(x) for x in xs))
    await batcher.stop()
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_allclose(out, reference(loaded, x), rtol=1e-5, atol=1e-6)
    assert threads == {"engine-tiny-0_0", "engine-tiny-1_0"}
    assert [i.forwards for i in engine.instances] == [1, 1]
    engine.close()


def test_each_instance_warms_up_on_its_own_thread(tmp_path: Path) -> None:
    # cuDNN tunes per thread: a warm-up on another thread would leave the instance to re-tune under load.
    engine = Engine(tiny(tmp_path, instances=2, pad_to_bucket=True), Precision.FP32, CPU)
    seen: list[tuple[str, int]] = []
    original = engine.model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append((threading.current_thread().name.rsplit("_", 1)[0], x.shape[0]))
        return original(x)

    engine.model.forward = spy  # type: ignore[method-assign]
    engine.warmup(4)
    assert seen == [(f"engine-tiny-{i}", b) for i in (0, 1) for b in (1, 2, 4)]
    engine.close()


async def test_the_repository_gives_the_batcher_one_slot_per_instance(tmp_path: Path) -> None:
    from halfserve.repository import ModelRepository
    from halfserve.settings import Settings

    save_tiny_mlp(tmp_path, execution=Execution(instances=3, pad_to_bucket=True))
    repo = ModelRepository(Settings(store=tmp_path, device="cpu"))
    repo.discover()
    await repo.load_all()
    served = repo.get("tiny")
    assert served.batcher is not None
    assert served.engine is not None
    assert served.batcher._slots._value == 3
    listing = served.describe()
    assert listing["execution"] == {
        "instances": 3,
        "buckets": [1, 2, 4, 8],
        "cuda_graphs": False,
        "channels_last": False,
        "graph_capture_seconds": 0.0,
        "inductor": False,
        "aoti": False,
        "inductor_compile_seconds": 0.0,
        # Several instances run batches side by side, each on its own thread (a CPU's default: threads, not processes).
        "placement": "instance_threads",
        "placement_changed": None,  # placed at load and kept
        "compile_cache": "off",  # nothing compiled, nothing cached
        "compile_cache_load_seconds": 0.0,
        "compiled_graphs": 0,
        "cached_graphs": 0,
    }
    name, out = served.manifest.inputs[0].name, served.manifest.outputs[0].name
    outs = await asyncio.gather(*(served.submit({name: rows(1, seed=i)}) for i in range(12)))
    assert all(p.outputs[out].shape == (1, 4) for p in outs)
    stats = served.stats()
    assert stats is not None
    assert len(stats["instance_forwards"]) == 3
    await repo.close()


# CUDA ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
def test_cuda_staging_is_pinned_reused_and_each_instance_has_its_own_stream(tmp_path: Path) -> None:
    loaded = tiny(tmp_path, instances=2)
    engine = Engine(loaded, Precision.FP16, CUDA, max_batch_size=8)
    assert engine.pad
    assert engine.buckets == [1, 2, 4, 8]
    a, b = engine.instances
    assert a.stream is not None
    assert b.stream is not None
    assert a.stream != b.stream
    staged = a.stage([rows(3)], 4)
    assert staged.is_pinned()
    assert staged.shape == (4, 16)
    assert torch.equal(staged[3], torch.zeros(16))
    assert a.stage([rows(2, seed=5)], 4).data_ptr() == staged.data_ptr()  # one buffer per bucket, reused
    x = rows(5, seed=1)
    got = engine.forward([x[:2], x[2:]], b)
    want = reference(loaded, x)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), rtol=0)
    assert got.shape == (5, 4)
    assert got.dtype == np.float32
    engine.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["fp16", "fp32"])
def test_cuda_graphs_are_captured_per_bucket_and_replayed(tmp_path: Path, mode: str) -> None:
    loaded = small_cnn(tmp_path, compile="cuda_graphs", instances=2)
    engine = Engine(loaded, Precision(mode), CUDA, max_batch_size=8)
    engine.warmup(8)
    assert engine.cuda_graphs
    assert engine.channels_last
    assert all(sorted(i.graphs) == [1, 2, 4, 8] for i in engine.instances)
    assert engine.info.graph_capture_seconds > 0
    calls = 0
    original = engine.model.forward

    def spy(x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(x)

    engine.model.forward = spy  # type: ignore[method-assign]
    tol = 0.02 if mode == "fp16" else 1e-3
    for n in (1, 3, 8):  # 3 rows replay the graph of 4
        x = np.random.default_rng(n).uniform(0, 1, (n, 3, 16, 16)).astype(np.float32)
        got = engine.forward(x)
        want = reference(loaded, x)
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), rtol=0)
    assert calls == 0  # every batch was a graph replay, not an eager forward
    engine.close()


@pytest.mark.gpu
@cuda
def test_cuda_inductor_compiles_each_bucket_and_agrees_with_fp32(tmp_path: Path) -> None:
    loaded = small_cnn(tmp_path, compile="inductor", instances=2)
    engine = Engine(loaded, Precision.FP16, CUDA, max_batch_size=8)
    engine.warmup(8)
    assert engine.info.inductor
    assert compiled_graphs(engine) == 4
    for n in (1, 3, 8):  # 3 rows run the compiled shape of 4
        x = np.random.default_rng(n).uniform(0, 1, (n, 3, 16, 16)).astype(np.float32)
        want = reference(loaded, x)
        np.testing.assert_allclose(engine.forward(x), want, atol=0.02 * np.abs(want).max(), rtol=0)
    assert compiled_graphs(engine) == 4
    engine.close()


@pytest.mark.gpu
@cuda
async def test_cuda_instances_run_batches_at_once_through_the_batcher(tmp_path: Path) -> None:
    loaded = small_cnn(tmp_path, instances=2, compile="cuda_graphs")
    engine = Engine(loaded, Precision.FP16, CUDA, max_batch_size=8)
    engine.warmup(8)
    batcher = Batcher(engine.run, max_batch_size=8, max_delay=0.001, max_queue_rows=4096, concurrency=2)
    batcher.start()
    xs = [np.random.default_rng(i).uniform(0, 1, (1, 3, 16, 16)).astype(np.float32) for i in range(256)]
    forwards = [i.forwards for i in engine.instances]
    outs = await asyncio.gather(*(batcher.infer(x) for x in xs))
    await batcher.stop()
    want = reference(loaded, np.concatenate(xs))
    np.testing.assert_allclose(np.concatenate(outs), want, atol=0.02 * np.abs(want).max(), rtol=0)
    assert all(i.forwards > f for i, f in zip(engine.instances, forwards, strict=True))  # both instances served
    engine.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compile_", ["none", "cuda_graphs"])
def test_cuda_chunks_in_pinned_shared_memory_go_to_the_device_without_host_staging(
    tmp_path: Path, compile_: str
) -> None:
    loaded = small_cnn(tmp_path, compile=compile_)
    engine = Engine(loaded, Precision.FP16, CUDA, max_batch_size=8)
    engine.warmup(8)
    inst = engine.instances[0]
    memory = mmap.mmap(-1, 1 << 20)  # what a front-end's slots are: a shared mapping
    unpin = pin_host(memory)
    assert unpin is not None
    x = np.random.default_rng(3).uniform(0, 1, (5, 3, 16, 16)).astype(np.float32)
    first = np.frombuffer(memory, np.float32, 2 * 768, 0).reshape(2, 3, 16, 16)
    rest = np.frombuffer(memory, np.float32, 3 * 768, 65536).reshape(3, 3, 16, 16)
    first[:], rest[:] = x[:2], x[2:]
    assert pinned([first, rest])
    assert not pinned([first, x[2:]])  # one pageable chunk: the batch is staged
    inst._staging.clear()
    got = engine.forward([first, rest], inst)
    assert not inst._staging  # no host staging buffer was needed
    want = reference(loaded, x)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), rtol=0)
    # The padding rows of the bucket of 8 are zeros, not the rows of an earlier full batch.
    ones = np.frombuffer(memory, np.float32, 8 * 768, 1 << 19).reshape(8, 3, 16, 16)
    ones[:] = 1.0
    engine.forward([ones], inst)
    got = engine.forward([first, rest], inst)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), rtol=0)
    batch = inst.graphs[8].input if compile_ == "cuda_graphs" else inst._device_staging[(8, torch.float32)]
    assert torch.equal(batch[:5].cpu(), torch.from_numpy(x))
    assert not batch[5:].any()
    engine.close()
    del first, rest, ones
    unpin()
    memory.close()


def test_explicit_buckets_pad_to_the_next_listed_size(tmp_path: Path) -> None:
    loaded = tiny(tmp_path, pad_to_bucket=True, batch_buckets=[1, 4, 6, 12])
    engine = Engine(loaded, Precision.FP32, CPU, max_batch_size=8)
    assert engine.buckets == [1, 4, 6, 8]  # max_batch_size is always one; sizes past it are dropped
    seen = forward_batch_sizes(engine)
    for n in (5, 2, 7):
        x = rows(n, seed=n)
        np.testing.assert_allclose(engine.forward(x), reference(loaded, x), atol=1e-5, rtol=0)
    assert seen == [6, 4, 8]
    with pytest.raises(ValidationError, match="batch_buckets"):
        Execution(batch_buckets=[0, 4])


@needs_cxx
async def test_inductor_compiles_each_bucket_once_at_warmup_and_its_instances_serve_them(tmp_path: Path) -> None:
    loaded = tiny(tmp_path, compile="inductor", instances=2)
    engine = Engine(loaded, Precision.FP32, CPU)
    assert engine.pad  # a compiled forward runs fixed shapes, so it pads on a CPU too
    engine.warmup(4)
    assert engine.buckets == [1, 2, 4]
    assert compiled_graphs(engine) == 3  # one per bucket: the second instance found them compiled
    assert engine.info.inductor
    assert engine.info.inductor_compile_seconds > 0
    warm = len(recompiles(engine))
    xs = [rows(n, seed=n) for n in (3, 1, 4, 2, 3, 4)]
    outs = await asyncio.gather(*(engine.run([x]) for x in xs))
    for x, (out,) in zip(xs, outs, strict=True):
        assert isinstance(out, Output)
        np.testing.assert_allclose(out.data, reference(loaded, x), rtol=1e-5, atol=1e-6)
    # Padded batches ran the compiled shapes: none compiled again for its size. (Once in several runs of the suite a
    # fourth graph was compiled here, for a reason the count alone did not say: any other recompile is named.)
    again = recompiles(engine)[warm:]
    assert caused_by(again, "size mismatch", "stride mismatch") == [], again
    assert compiled_graphs(engine) == 3 + len(again), again
    assert all(i.forwards > 3 for i in engine.instances)  # both instances served
    engine.close()


@needs_cxx
async def test_inductor_compiles_again_at_the_settled_thread_count_before_serving(tmp_path: Path) -> None:
    # torch.compile guards each compiled shape on the intra-op thread count: compiled at the warm-up's count, each
    # bucket would compile again at its first request once the engine settled on fewer threads.
    loaded = tiny(tmp_path, compile="inductor")
    engine = Engine(loaded, Precision.FP32, CPU)
    try:
        inst, cores = engine.instances[0], 2
        inst.executor.submit(set_intra_op_threads, cores).result()  # what a fresh process's threads start with
        engine.warmup(4)
        compiled = engine.compile_seconds
        short = fixed_timing(4 * LOOP_SECONDS_PER_ROW / 10)  # made up: a tenth of the loop's work on 4 rows
        assert engine.settle_threads(4, cores, short) == cores - 1
        assert engine.compile_seconds > compiled
        assert inst.executor.submit(torch.get_num_threads).result() == cores - 1
        assert compiled_graphs(engine) == 3  # the three buckets, compiled again at the settled count only
        settled = len(recompiles(engine))
        for n in (1, 2, 3, 4):
            x = rows(n, seed=n)
            out = (await engine.run([x]))[0]
            assert isinstance(out, Output)
            np.testing.assert_allclose(out.data, reference(loaded, x), rtol=1e-5, atol=1e-6)
        again = recompiles(engine)[settled:]
        assert caused_by(again, "num_threads", "size mismatch", "stride mismatch") == [], again
        assert compiled_graphs(engine) == 3 + len(again), again
    finally:
        engine.close()


@needs_cxx
def test_inductor_keeps_its_compiled_shapes_when_the_thread_count_stays(tmp_path: Path) -> None:
    engine = Engine(tiny(tmp_path, compile="inductor"), Precision.FP32, CPU)
    try:
        engine.instances[0].executor.submit(set_intra_op_threads, 1).result()
        engine.warmup(4)
        compiled, graphs = engine.compile_seconds, compiled_graphs(engine)
        long = fixed_timing(1.0)  # made up: far longer than the loop's work, though one core settles on one anyway
        assert engine.settle_threads(4, 1, long) == 1  # one core: warmed up, timed and settled on one thread
        assert (engine.compile_seconds, compiled_graphs(engine)) == (compiled, graphs) == (compiled, 3)
    finally:
        engine.close()


@needs_cxx
def test_inductor_compiles_the_input_preparation_of_uint8_images_with_channels_last(tmp_path: Path) -> None:
    # The configuration served on GPUs: bytes in, normalised, cast and made NHWC inside the compiled forward.
    kwargs = {"width": 8, "blocks": [1, 1], "block": "bottleneck", "channels_last": False}
    torch.manual_seed(0)
    module = models.build("resnet_bench", **kwargs)
    spec = {
        "name": "cnn",
        "architecture": "resnet_bench",
        "arch_kwargs": kwargs,
        "inputs": [TensorSpec(name="image", shape=[3, 16, 16], datatype=DataType.UINT8)],
        "outputs": [TensorSpec(name="logits", shape=[10])],
        "normalize": Normalize(scale=1 / 255, mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.25]),
    }
    x = np.random.default_rng(0).integers(0, 256, (3, 3, 16, 16)).astype(np.uint8)
    outs = []
    for compile in (Compile.NONE, Compile.INDUCTOR):
        execution = Execution(compile=compile, channels_last=True, pad_to_bucket=True)
        store.save(tmp_path / compile.value, Manifest.model_validate({**spec, "execution": execution}), module)
        engine = Engine(store.load(tmp_path / compile.value, "cnn"), Precision.FP32, CPU)
        engine.warmup(4)
        assert (engine.channels_last, engine.inductor) == (True, compile is Compile.INDUCTOR)
        outs.append(engine.forward(x))  # 3 rows, padded to the bucket of 4
        engine.close()
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@needs_cxx
def test_inductor_keeps_compiling_past_torch_compiles_recompile_limit(tmp_path: Path) -> None:
    # torch.compile keeps compiled shapes per code object, up to its limit of eight, after which it quietly runs eager
    # forwards. Three precisions of four buckets each are twelve shapes: each engine's forward has a code object of its
    # own, so none of them runs past the limit. The MLP's widths are its own, so no other test has compiled them.
    kwargs = {"in_features": 16, "hidden": [24], "out_features": 4}
    torch.manual_seed(0)
    manifest = Manifest(
        name="mlp24",
        architecture="mlp",
        arch_kwargs=kwargs,
        inputs=[TensorSpec(name="features", shape=[16])],
        outputs=[TensorSpec(name="logits", shape=[4])],
        execution=Execution(compile=Compile.INDUCTOR),
    )
    store.save(tmp_path, manifest, models.build("mlp", **kwargs))
    loaded = store.load(tmp_path, "mlp24")
    # The last engine is not warmed up (--no-warmup): its buckets compile on their first batches.
    for mode, tolerance, warm in (
        (Precision.FP32, 1e-5, True),
        (Precision.BF16, 0.05, True),
        (Precision.FP16, 0.01, False),
    ):
        engine = Engine(loaded, mode, CPU, max_batch_size=8)
        if warm:
            engine.warmup(8)
        assert engine.buckets == [1, 2, 4, 8]
        for n in (1, 2, 3, 5):  # 3 rows run the bucket of 4, 5 the bucket of 8
            x = rows(n, seed=n)
            want = reference(loaded, x)
            got = engine.instances[0].executor.submit(engine.forward, x).result()  # on the instance's thread, as served
            np.testing.assert_allclose(got, want, atol=tolerance * np.abs(want).max(), rtol=0)
        assert compiled_graphs(engine) == 4, mode  # each bucket compiled, none left to eager forwards
        engine.close()


@pytest.mark.parametrize(
    ("execution", "device", "pads"),
    [
        (Execution(), CPU, False),
        (Execution(), CUDA, True),
        (Execution(compile=Compile.INDUCTOR), CPU, True),
        (Execution(pad_to_bucket=False), CUDA, False),
        (Execution(pad_to_bucket=True), CPU, True),
    ],
)
def test_pads_to_buckets_follows_the_manifest_else_the_device_and_compiler(
    execution: Execution, device: torch.device, pads: bool
) -> None:
    assert pads_to_buckets(execution, device) is pads


def test_cudnn_autotuning_is_on_only_for_cuda_with_fixed_shapes() -> None:
    before = torch.backends.cudnn.benchmark
    try:
        for device, fixed, want in ((CUDA, True, True), (CUDA, False, False), (CPU, True, False)):
            torch.backends.cudnn.benchmark = not want
            tune_cudnn(device, fixed)
            assert torch.backends.cudnn.benchmark is want, (device, fixed)
    finally:
        torch.backends.cudnn.benchmark = before
