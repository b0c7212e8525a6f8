"""The engine: one model instance on one device, run in a dedicated thread under a precision policy.

Batches arrive as lists of numpy arrays (one per request chunk) and leave as one outcome per chunk: float32 output
rows tagged with the precision that computed them, or the error that fails that chunk alone. The thread keeps device
work off the event loop (torch releases the GIL during kernels), so the next batch forms while this one computes.

Two faults are the engine's to recognise, because they need torch to see:

* Out of memory: the forward raises :class:`~halfserve.serving.BatchTooLargeError` instead, and the batcher (which
  owns chunks and batch sizes) halves its batch size and reruns the rows in smaller batches.
* Overflow: a half-precision forward whose output is not finite where the input was (fp16 tops out at 65504) is
  handled per the model's :class:`~halfserve.manifest.OverflowPolicy`: rerun in fp32 on the host copy of the weights
  (tagged ``fp32``), fail that chunk, or pass the non-finite values through.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from halfserve import compilation, packing, records
from halfserve import precision as prec
from halfserve.instance import Instance, bucket_for, torch_dtype
from halfserve.manifest import Compile, Execution, Normalize, OverflowPolicy
from halfserve.placement import (
    Placement,
    intra_op_threads,
    loop_bound,
    pads_to_buckets,
    set_intra_op_threads,
)
from halfserve.precision import Precision
from halfserve.serving import BatchTooLargeError, Outcome, Output
from halfserve.store import LoadedModel
from halfserve.traced import TracedForward

log = logging.getLogger(__name__)

ForwardTiming = Callable[[int], float]
"""The seconds a full batch's forward takes on a given count of intra-op threads (:meth:`Engine.settle_threads`)."""


class EngineError(RuntimeError):
    """The model's forward failed or returned something other than one output row per input row."""


class PrecisionOverflowError(EngineError):
    """A half-precision output was not finite for a finite input, and the model's overflow policy is ``error``."""


def is_out_of_memory(e: BaseException) -> bool:
    """True for torch's out-of-memory error (CUDA and other accelerators), and the CPU allocator's failure, which
    torch raises as a plain RuntimeError."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e)


def _rows_finite(a: np.ndarray) -> np.ndarray:
    """Per row: True when every value of the row is finite (integers always are), every field's of a record."""
    if a.dtype.names is not None:
        rows = np.ones(a.shape[0], dtype=bool)
        for name in a.dtype.names:
            rows &= _rows_finite(a[name])
        return rows
    if a.dtype.kind not in "fc":
        return np.ones(a.shape[0], dtype=bool)
    finite: np.ndarray = np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    return finite


def _row_slices(out: np.ndarray, chunks: list[np.ndarray]) -> list[np.ndarray]:
    """``out``'s rows cut back into one view per chunk, in order: slices, which cost a fraction of ``np.split``'s
    per-piece work when a batch holds dozens of one-row requests."""
    if len(chunks) == 1:
        return [out]
    views, start = [], 0
    for c in chunks:
        stop = start + len(c)
        views.append(out[start:stop])
        start = stop
    return views


def _all_finite(a: np.ndarray) -> bool:
    """Whether every value is finite, every field's of a record: one vectorised check per field."""
    if a.dtype.names is not None:
        return all(_all_finite(a[name]) for name in a.dtype.names)
    return a.dtype.kind not in "fc" or bool(np.isfinite(a).all())


def takes_positionally(module: nn.Module, names: list[str]) -> bool:
    """How ``module``'s forward takes a model's inputs: by keyword (False) when it has parameters of those names (or
    ``**kwargs``), in the manifest's order (True) when it takes ``*args`` instead. Anything else cannot take them."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read (a builtin): trust the manifest's order
        return True
    named = [n for n in names if n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY]
    if len(named) == len(names):
        return False
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and not named:
        return True
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return False
    missing = [n for n in names if n not in named]
    raise EngineError(
        f"inputs: forward({', '.join(params)}) has no parameter named {missing[0]!r}; with several inputs, forward "
        "takes them by keyword, named as in the manifest (or all positionally through *args)"
    )


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves, for listings and responses."""

    device: str
    precision: Precision
    weight_dtype: str
    weight_bytes: int
    fp32_fallback_bytes: int = 0
    """Host memory held by the fp32 copy kept for overflow reruns (0 when none is kept)."""
    instances: int = 1
    buckets: tuple[int, ...] = ()
    """The batch sizes batches are padded up to (empty: no padding)."""
    cuda_graphs: bool = False
    channels_last: bool = False
    graph_capture_seconds: float = 0.0
    """Time spent capturing CUDA graphs at warm-up, all buckets and instances together."""
    inductor: bool = False
    inductor_compile_seconds: float = 0.0
    """Time spent compiling with TorchInductor at warm-up (each bucket's first forward), all buckets together."""
    placement: Placement = Placement.INSTANCE_THREADS
    """Where batches run (:mod:`halfserve.placement`)."""


def batch_buckets(max_batch_size: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes warmed up at load, ascending: ``sizes`` (default: powers of two) below ``max_batch_size``,
    and ``max_batch_size`` itself."""
    if sizes is None:
        sizes = [1 << i for i in range(max_batch_size.bit_length())]
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def has_conv2d(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in module.modules())


class Normalizer:
    """A manifest's :class:`~halfserve.manifest.Normalize` on one device: ``(x * scale - mean) / std`` in fp32, per
    channel.

    Folded into one multiply-add, ``x * (scale / std) - mean / std``, run by one ``addcmul`` that also widens the
    input: one pass over the batch instead of four (``docs/benchmarks.md``), and one kernel launch on a GPU. fp32
    whatever the serving precision: the cast to it follows, as it would after a client's own normalisation.
    """

    def __init__(self, spec: Normalize, sample_ndim: int, device: torch.device) -> None:
        per_channel = (1, -1, *([1] * (sample_ndim - 1)))
        std = torch.tensor(spec.std if spec.std is not None else [1.0], dtype=torch.float64)
        mean = torch.tensor(spec.mean if spec.mean is not None else [0.0], dtype=torch.float64)
        # Folded in float64, rounded once to fp32.
        self.scale = (spec.scale / std).to(torch.float32).reshape(per_channel).to(device)
        self.shift = (-mean / std).to(torch.float32).reshape(per_channel).to(device)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, t, self.scale)


class Engine:
    """Owns a model cast for serving on one device; runs batches on its instances' threads.

    ``execution`` (default: the manifest's) sets the number of instances, padding to batch buckets, CUDA graphs and
    ``channels_last``; ``max_batch_size`` sets the buckets (else :meth:`warmup` does).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        precision: Precision,
        device: torch.device,
        overflow: OverflowPolicy | None = None,
        *,
        execution: Execution | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        self.name = loaded.manifest.name
        self.device = device
        self.precision = prec.resolve(precision, device)
        self.overflow = OverflowPolicy(overflow or loaded.manifest.overflow)
        ex = execution or loaded.manifest.execution
        cuda = device.type == "cuda"
        spec = loaded.manifest.inputs[0]
        self.sample_shape = tuple(spec.shape)
        # Requests' rows arrive as this (FP16 stays float16 and UINT8 bytes up to the device copy: half and a quarter
        # of the bytes to move; they are widened on the device), so warm-up batches and captured graphs use it too.
        self.input_dtype = spec.datatype.numpy
        norm = loaded.manifest.normalize
        self._normalize = Normalizer(norm, len(self.sample_shape), device) if norm else None
        # The fp32 overflow rerun runs on the host: on a CPU engine that is the same normaliser.
        self._normalize_host = (
            Normalizer(norm, len(self.sample_shape), torch.device("cpu"))
            if norm and device.type != "cpu"
            else self._normalize
        )
        self.out_shape = tuple(loaded.manifest.outputs[0].shape)
        self.input_names = [t.name for t in loaded.manifest.inputs]
        self.output_names = [t.name for t in loaded.manifest.outputs]
        self.out_float = loaded.manifest.outputs[0].datatype.numpy.kind == "f"
        """Whether the (first) output is floating, returned as float32; integer and bool outputs keep their type."""
        self.manifest = loaded.manifest
        self.named = packing.packs_records(loaded.manifest)
        """Rows travel as records (:func:`halfserve.packing.input_records`): several inputs or outputs, or variable
        ones. Such a batch runs eagerly (no CUDA graph), each input copied to the device on its own."""
        self.positional = len(self.input_names) == 1 or takes_positionally(loaded.module, self.input_names)
        self.output_records = packing.output_records(loaded.manifest)
        self.real_elements = 0
        """Values of variable inputs run so far that requests sent (the first variable input's)."""
        self.padded_elements = 0
        """Values run so far that were padding: up to each batch's length, and whole rows up to its bucket."""
        if self.named:
            self.input_dtype = packing.input_records(loaded.manifest)
            self.sample_shape = ()  # a record holds each input's sample
        self.inductor = ex.compile is Compile.INDUCTOR
        self.pad = pads_to_buckets(ex, device)
        # Graphs replay fixed shapes and fixed casts: autocast's weight cache cannot be captured, so it runs eagerly.
        self.cuda_graphs = (
            ex.compile is Compile.CUDA_GRAPHS and cuda and self.precision is not Precision.AUTOCAST and not self.named
        )
        images = len(self.sample_shape) == 3 and not self.named
        wants_nhwc = cuda if ex.channels_last is None else ex.channels_last
        self.channels_last = wants_nhwc and images and has_conv2d(loaded.module)
        self._bucket_sizes = ex.batch_buckets
        self.buckets: list[int] = batch_buckets(max_batch_size, ex.batch_buckets) if self.pad and max_batch_size else []
        # The loaded module stays fp32 on the host (for precision switches and overflow reruns); serving gets its own
        # cast copy, shared by the instances, unless that copy would equal the host's weights (fp32 weights on the
        # CPU in their usual layout): then it serves those rather than hold every weight twice.
        shares_host = (
            device.type == "cpu" and not self.channels_last and prec.weight_dtype(self.precision) == torch.float32
        )
        model = prec.prepare_model(
            loaded.module if shares_host else copy.deepcopy(loaded.module), self.precision, device
        )
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.model: nn.Module = model

        self.guarded = self.precision is not Precision.FP32
        """Whether outputs are checked for overflow: only a reduced precision can overflow where fp32 would not."""
        # The host's fp32 weights are kept only where they can be needed: reruns of overflowing half outputs.
        self._fp32: nn.Module | None = (
            loaded.module if self.guarded and self.overflow is OverflowPolicy.RERUN_FP32 else None
        )
        self.instances = [Instance(self.name, i, device) for i in range(ex.instances)]
        self.threads: int | None = None
        """Intra-op threads chosen by :meth:`settle_threads` (None: the process's setting)."""
        self.loop_bound: bool | None = None
        """Whether a full batch's forward, timed by :meth:`settle_threads`, is shorter than the event loop's work on
        its requests (:func:`halfserve.placement.loop_bound`); None until timed."""
        self.placement = Placement.INSTANCE_THREADS
        """Where batches run: on the instances' threads until :meth:`place` says otherwise (the repository decides,
        as :func:`halfserve.placement.choose`)."""
        self.batch_seconds: float | None = None
        """A full batch's forward (:attr:`batch_rows`) on the settled intra-op threads, timed by :meth:`settle_threads`
        (None until)."""
        self.batch_rows = 0
        self.cores = 0
        """The cores :meth:`settle_threads` settled the intra-op threads for (0 until)."""
        self._traced: TracedForward | None = None
        self._launched: list[_Running] = []
        self._collecting = False
        self._idle = list(reversed(self.instances))
        self._next = 0
        self._lock = threading.Lock()
        self._compiled_code: types.CodeType | None = None
        """The code object whose compiled shapes are this engine's (:func:`halfserve.compilation.own_code`); None when
        not compiled."""
        self._forward: Callable[[torch.Tensor], torch.Tensor] = self._eager
        if self.inductor:
            own = compilation.own_code(self._eager)
            self._compiled_code = own.__func__.__code__  # type: ignore[attr-defined]
            self._forward = torch.compile(own, dynamic=False)
        self.compile_seconds = 0.0
        self._room_made = False
        if self.inductor and self.buckets:
            self._make_room_for_compiles(self.buckets)  # before any batch: with --no-warmup they compile under load
        self.overflows = 0
        """Chunks whose half-precision output was not finite for a finite input, whatever the policy did."""
        self.fp32_reruns = 0
        """Chunks rerun in fp32 because of such an overflow."""

    @property
    def forwards(self) -> int:
        """Forwards run so far, all instances together (warm-up included)."""
        return sum(i.forwards for i in self.instances)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            device=str(self.device),
            precision=self.precision,
            weight_dtype=str(prec.weight_dtype(self.precision)).removeprefix("torch."),
            weight_bytes=module_bytes(self.model),
            fp32_fallback_bytes=module_bytes(self._fp32) if self._fp32 is not None else 0,
            instances=len(self.instances),
            buckets=tuple(self.buckets),
            cuda_graphs=self.cuda_graphs,
            channels_last=self.channels_last,
            graph_capture_seconds=sum(g.capture_seconds for i in self.instances for g in i.graphs.values()),
            inductor=self.inductor,
            inductor_compile_seconds=self.compile_seconds,
            placement=self.placement,
        )

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        """A device batch as the model takes it: normalised (when the manifest says so) and cast to the serving dtype
        on the device (the copy moved the rows as they arrived; a host-side cast would cost a CPU pass and an unpinned
        temporary), NHWC where the engine runs channels_last."""
        if self._normalize is not None:
            t = self._normalize(t)
        t = prec.cast_input(t, self.precision)
        if self.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def _eager(self, t: torch.Tensor) -> torch.Tensor:
        return self._one(self.model(self._prepare(t)))

    def _one(self, y: object) -> torch.Tensor:
        """The output of a model with one (a tensor, most often, as it is)."""
        return y if isinstance(y, torch.Tensor) else records.named_outputs(y, self.output_names)[self.output_names[0]]

    def _count_padding(self, padding: records.Padding) -> None:
        with self._lock:  # instances run on their own threads
            self.real_elements += padding.real
            self.padded_elements += padding.padded

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """Cast and run a batch already on the device, under the precision's context (compiled with ``inductor``)."""
        with prec.inference(self.precision, self.device):
            return self._forward(t)

    def forward(self, x: np.ndarray | list[np.ndarray], inst: Instance | None = None) -> np.ndarray:
        """Run rows synchronously as one batch (padded to its bucket) on ``inst`` (the first by default): one array,
        or chunks of several requests; float32 outputs, one row per input row, no overflow check."""
        chunks = x if isinstance(x, list) else [x]
        inst = inst or self.instances[0]
        rows = sum(len(c) for c in chunks)
        size = bucket_for(rows, self.buckets)
        if self.named:
            batch = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            with inst.on_stream():
                outs, padding = records.run(
                    self.manifest, self.model, batch, size, self.device, self.precision, self.positional
                )
                self._count_padding(padding)
                inst.forwards += 1
                return records.to_host(outs, rows, self.output_records)
        with inst.on_stream():
            graph = inst.graphs.get(size)
            if graph is not None and graph.model is self.model and graph.input.dtype == torch_dtype(chunks[0].dtype):
                y = inst.replay(graph, chunks, size)
            else:
                y = self._on_device(inst.upload(chunks, size))
            inst.forwards += 1
            return inst.fetch(_checked(y, size)[:rows], widen=self.out_float)

    def compute(self, x: np.ndarray) -> np.ndarray:
        """The model's outputs for ``x`` as one batch on the first instance's own thread, without the overflow
        policy (the fidelity check's forward); blocks, so call it off the event loop."""
        inst = self.instances[0]
        return inst.executor.submit(self.forward, x, inst).result()

    def _rerun_fp32(self, x: np.ndarray) -> np.ndarray:
        """Run rows through the host's fp32 weights (the overflow fallback); returns float32 outputs."""
        if self._fp32 is None:
            raise EngineError("no fp32 weights are kept for reruns (the overflow policy is not rerun_fp32)")
        if self.named:
            with torch.inference_mode():
                outs, _ = records.run(
                    self.manifest, self._fp32, x, len(x), torch.device("cpu"), Precision.FP32, self.positional
                )
            return records.to_host(outs, len(x), self.output_records)
        t = torch.from_numpy(x)
        if self._normalize_host is not None:
            t = self._normalize_host(t)
        t = prec.cast_input(t, Precision.FP32)
        with torch.inference_mode():
            y = self._one(self._fp32(t))
        return _checked(y, len(x)).float().numpy()

    def run_batch(self, chunks: list[np.ndarray], inst: Instance | None = None) -> list[Outcome]:
        """Run the chunks of one batch as a single forward, synchronously; returns one outcome per chunk, after the
        overflow policy (:meth:`run` is the batcher's way in, on an instance's thread).

        Raises :class:`~halfserve.serving.BatchTooLargeError` when the device runs out of memory.
        """
        try:
            out = self.forward(chunks, inst)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the failed batch's blocks back before the smaller reruns
            rows = sum(len(c) for c in chunks)
            raise BatchTooLargeError(f"out of memory on {self.device} running {rows} rows: {e}") from None
        return self._outcomes(chunks, out)

    def _outcomes(self, chunks: list[np.ndarray], out: np.ndarray) -> list[Outcome]:
        """One outcome per chunk of a batch's output rows, after the overflow policy."""
        outs = _row_slices(out, chunks)
        tag = self.precision
        # One vectorised check over the whole batch: the per-chunk work below only runs when something is wrong.
        if self.guarded and not _all_finite(out):
            return [self._guard(c, o) for c, o in zip(chunks, outs, strict=True)]
        return [Output(o, tag) for o in outs]

    def _guard(self, x: np.ndarray, out: np.ndarray) -> Outcome:
        """Apply the overflow policy to one chunk's half-precision output."""
        tag = self.precision
        overflowed = _rows_finite(x) & ~_rows_finite(out)
        if not overflowed.any():  # non-finite in, non-finite out: the input's doing, not the precision's
            return Output(out, tag)
        with self._lock:  # instances run on their own threads
            self.overflows += 1
        if self.overflow is OverflowPolicy.ALLOW:
            return Output(out, tag)
        rows = np.flatnonzero(overflowed).tolist()
        if self.overflow is OverflowPolicy.ERROR:
            return PrecisionOverflowError(
                f"{tag} overflow: the output of row(s) {rows[:8]} is not finite for finite input "
                f"(the model's overflow policy is 'error'; 'rerun_fp32' would rerun them in fp32)"
            )
        with self._lock:
            self.fp32_reruns += 1
        return Output(self._rerun_fp32(x), Precision.FP32)

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Run a batch on an idle instance's thread without blocking the event loop: the future of its outcomes.

        The batch is on the instance's thread when this returns (a coroutine would hand it over only when its task
        first ran, behind whatever the event loop has queued). The batcher keeps at most one batch in flight per
        instance, so an idle one is normally at hand; past that (a caller running more at once) batches queue on the
        instances in turn.
        """
        if self._traced is not None:
            return self._launch(chunks, self._traced)
        if self.placement is Placement.EVENT_LOOP:
            return self._run_here(chunks)
        if self._idle:
            inst = self._idle.pop()
        else:
            inst = self.instances[self._next % len(self.instances)]
            self._next += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(inst.executor, self.run_batch, chunks, inst)
        except BaseException:
            self._idle_again(inst)
            raise
        # Registered before any caller awaits the future, so the instance is idle again before the caller resumes.
        future.add_done_callback(lambda _: self._idle_again(inst))
        return future

    def _run_here(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Run a batch on this thread (the event loop's), on the first instance: its outcomes as a done future."""
        self._take_threads()  # the loop's thread takes the instance's count
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self.run_batch(chunks, self.instances[0]))
        except Exception as e:
            future.set_exception(e)
        return future

    def _take_threads(self) -> None:
        """Give the calling thread the intra-op threads this engine settled on (OpenMP's count is each thread's own
        setting, and threads torch starts take their starter's)."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            set_intra_op_threads(self.threads)

    @property
    def instance_count(self) -> int:
        return len(self.instances)

    @property
    def traceable(self) -> bool:
        """Whether this engine can run as a traced graph beside the event loop (:attr:`Placement.BESIDE_LOOP`): on a
        CPU, one instance, one input, neither padded nor compiled, and not under autocast, whose casts depend on a
        thread's autocast state where the pool's threads have none."""
        return (
            self.device.type == "cpu"
            and len(self.instances) == 1
            and not (self.named or self.pad or self.inductor)
            and self.precision is not Precision.AUTOCAST
        )

    @property
    def available(self) -> bool:
        """Whether an instance can run a batch now: always, for instance threads (they live as long as the engine)."""
        return True

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """The batches this engine takes for a model's ``max_batch_size``: the most rows in one, and how many may be in
        flight at once.

        One in flight per instance, each taking the next batch when it is idle. One beside the loop has two, each of up
        to half the rows: one is read and answered while the other runs (a whole batch would leave the loop nothing to
        do while it ran).
        """
        if self.placement is Placement.BESIDE_LOOP:
            return max(1, max_batch_size // 2), 2
        return max_batch_size, len(self.instances)

    def place(self, placement: Placement, max_batch_size: int) -> None:
        """Run batches where ``placement`` says from now on. Beside the loop, the forward is traced first: raises
        :class:`~halfserve.traced.TraceRefused` (and changes nothing) when the model cannot run as a traced graph, and
        ``ValueError`` for an engine that cannot be traced (:attr:`traceable`) or placement it cannot take.

        The trace is checked on three batches: a full one of zeros (the warm-up's), one row, and a full one of
        values drawn at random.
        """
        if placement is Placement.INSTANCE_PROCESSES:
            raise ValueError("an engine's instances run in processes of their own only as halfserve.isolated's engine")
        if placement is Placement.EVENT_LOOP and (self.device.type != "cpu" or len(self.instances) != 1):
            raise ValueError("only a CPU engine with one instance runs its batches on the event loop")
        if placement is not Placement.BESIDE_LOOP:
            self._traced, self.placement = None, placement
            return
        if not self.traceable:
            raise ValueError(
                "only a CPU engine with one instance and one input, not padded, compiled or autocast, runs beside "
                "the event loop"
            )
        self._take_threads()  # the inter-op pool's threads take the caller's count when they start
        zeros = torch.from_numpy(self._warm_batch(max_batch_size))
        if zeros.dtype.is_floating_point:
            drawn = torch.from_numpy(np.random.default_rng(0).standard_normal(zeros.shape).astype(zeros.numpy().dtype))
        else:
            drawn = torch.randint(0, 2, zeros.shape, dtype=zeros.dtype, generator=torch.Generator().manual_seed(0))
        with prec.inference(self.precision, self.device):
            traced = TracedForward.trace(self.model, self._eager, [zeros, zeros[:1].clone(), drawn])
        # The pool's threads start now, taking this thread count (OpenMP's is a setting of each thread).
        traced.launch(zeros).wait()
        self._traced, self.placement = traced, Placement.BESIDE_LOOP

    def _launch(self, chunks: list[np.ndarray], traced: TracedForward) -> asyncio.Future[list[Outcome]]:
        """Launch a batch's traced forward and return the future of its outcomes, set when :meth:`_collect` finds the
        graph done."""
        loop = asyncio.get_running_loop()
        # A batch of its own (the instance's staging buffer would be shared by the two batches in flight).
        batch = torch.from_numpy(chunks[0] if len(chunks) == 1 else np.concatenate(chunks))
        future: asyncio.Future[list[Outcome]] = loop.create_future()
        try:
            self._launched.append(_Running(traced.launch(batch), batch, chunks, future))
        except Exception as e:
            future.set_exception(e)
            return future
        if not self._collecting:
            self._collecting = True
            loop.call_soon(self._collect)
        return future

    def _collect(self) -> None:
        """Answer the launched batches whose graphs are done; look again at the loop's next iteration while any runs.

        The loop looks rather than being told: a callback from the pool's thread would wait for the GIL, which the
        loop, busy with requests, seldom lets go of long enough. Between requests the look costs a call per iteration.
        """
        running = []
        for r in self._launched:
            if not r.graph.done():
                running.append(r)
                continue
            self.instances[0].forwards += 1
            if r.future.done():
                continue
            try:
                out = self.instances[0].fetch(_checked(r.graph.value(), len(r.batch)), widen=self.out_float)
                r.future.set_result(self._outcomes(r.chunks, out))
            except Exception as e:
                r.future.set_exception(e)
        self._launched = running
        if running:
            asyncio.get_running_loop().call_soon(self._collect)
        else:
            self._collecting = False

    def _idle_again(self, inst: Instance) -> None:
        if inst not in self._idle:
            self._idle.append(inst)

    def warmup(self, max_batch_size: int) -> float:
        """Run every batch-size bucket on every instance so first requests pay no allocation or kernel-selection cost;
        with CUDA graphs on, capture one per bucket (largest first, so the smaller ones fit in its memory pool).

        Each instance warms up on its own thread: cuDNN keeps its tuned algorithms per thread, so a warm-up on
        another thread would leave the instance to re-tune (about a second per shape for ResNet-50) under load.
        Returns the seconds it took.
        """
        start = time.perf_counter()
        sizes = batch_buckets(max_batch_size, self._bucket_sizes)
        if self.pad and not self.buckets:
            self.buckets = sizes
        if self.inductor and not self._room_made:
            self._make_room_for_compiles(sizes)
        for inst in self.instances:
            inst.executor.submit(self._warm_instance, inst, sizes).result()
        self.real_elements = self.padded_elements = 0  # the padding of requests, not of warm-up batches
        return time.perf_counter() - start

    def _make_room_for_compiles(self, sizes: list[int]) -> None:
        """Let each instance's thread keep every one of this engine's compiled shapes."""
        for inst in self.instances:
            inst.executor.submit(compilation.allow_compiled_shapes, len(sizes)).result()
        self._room_made = True

    def _warm_instance(self, inst: Instance, sizes: list[int]) -> None:
        for size in sorted(sizes, reverse=self.cuda_graphs):
            for length in self._warm_lengths():  # ends with 1: the batch the rest of the warm-up runs
                # Each length bucket a batch can be padded to: its kernels are chosen (oneDNN builds them per shape)
                # before requests of that length arrive.
                x = self._warm_batch(size, length)
                if length > 1:
                    self.forward(x, inst)
            if self.cuda_graphs:
                with inst.on_stream():
                    sample = inst.upload([x], size)
                graph = inst.capture(size, sample, self._on_device, self.model)
                secs = graph.capture_seconds
                log.info("%s[%d]: captured a CUDA graph of batch %d in %.3fs", self.name, inst.index, size, secs)
            start = time.perf_counter()
            self.forward(x, inst)
            if self.inductor and inst.index == 0:  # the first instance compiles; the others find it compiled
                secs = time.perf_counter() - start
                self.compile_seconds += secs
                log.info("%s: compiled batch %d with TorchInductor in %.2fs", self.name, size, secs)

    def _warm_batch(self, size: int, length: int = 1) -> np.ndarray:
        """``size`` rows of zeros as requests bring them, host rows of the input's dtype (graphs are per dtype), each
        variable input ``length`` long."""
        x = np.zeros((size, *self.sample_shape), dtype=self.input_dtype)
        for name in x.dtype.names or ():
            if name.endswith(packing.LENGTH):
                x[name] = length
        return x

    def settle_threads(self, max_batch_size: int, cores: int, timing: ForwardTiming | None = None) -> int:
        """Set each instance's torch intra-op threads to :func:`intra_op_threads` of a timed forward of a full batch
        on all ``cores`` (on a CPU; run after warm-up), and return the count chosen.

        ``timing`` gives that forward's seconds at a thread count instead of timing it (the ``forward_seconds``
        setting, and tests): what is decided from the timing then depends on it alone, not on the host's speed.

        Set on the instance's own thread, the only one that runs its forwards: OpenMP's thread count is a setting of
        the thread that starts a parallel region, so other threads (and other models' instances) keep theirs.

        A model with a variable input is timed at its ``max_length``: the longest batch it can be sent, which is what
        decides whether a batch may hold up the event loop (:attr:`loop_bound`). An engine compiled with TorchInductor
        then sets every instance to the count chosen and compiles its buckets again at it (:meth:`_compile_again`),
        unless it warmed up, was timed and settled at ``cores`` throughout.
        """
        sequence = packing.sequence_input(self.manifest)
        x = self._warm_batch(max_batch_size, sequence.bounded()[0] if sequence is not None else 1)

        def timed(inst: Instance, threads: int) -> float:
            if timing is not None:
                return timing(threads)
            seconds = math.inf
            for _ in range(3):
                start = time.perf_counter()
                self.forward(x, inst)
                seconds = min(seconds, time.perf_counter() - start)
            return seconds

        warmed_at: list[int] = []  # each instance's count when it warmed up (and compiled)

        def settle(inst: Instance) -> int:
            warmed_at.append(torch.get_num_threads())
            set_intra_op_threads(cores)
            if timing is None:
                self.forward(x, inst)  # the first at this count is not timed
            seconds = timed(inst, cores)
            self.loop_bound = loop_bound(seconds, max_batch_size)
            threads = intra_op_threads(seconds, max_batch_size, cores)
            log.info(
                "%s[%d]: a forward of %d rows took %.2f ms on %d threads: %d intra-op threads",
                self.name,
                inst.index,
                max_batch_size,
                seconds * 1000,
                cores,
                threads,
            )
            set_intra_op_threads(threads)
            self.batch_seconds = seconds if threads == cores else timed(inst, threads)
            self.batch_rows, self.cores = max_batch_size, cores
            return threads

        self.threads = min(inst.executor.submit(settle, inst).result() for inst in self.instances)
        if self._compiled_code is not None and {*warmed_at, self.threads} != {cores}:
            self._compile_again(self._compiled_code, self.threads, max_batch_size)
        self.real_elements = self.padded_elements = 0  # the padding of requests, not of these batches
        return self.threads

    def _compile_again(self, code: types.CodeType, threads: int, max_batch_size: int) -> None:
        """Compile every bucket again, on each instance's thread at ``threads`` intra-op threads.

        torch.compile guards each compiled shape on the intra-op thread count of the thread it runs on. Compiled at
        the warm-up's count, every bucket would compile again at its first request once the count changed (seconds
        each, under load), and the shapes of both counts together could pass the recompile limit, past which the
        forward runs eagerly. The engine's own compiled shapes (those of ``code``, its own code object: no other
        engine's) are dropped, then warmed up again.
        """
        compilation.forget_compiled(code)
        for inst in self.instances:
            inst.executor.submit(set_intra_op_threads, threads).result()
        self.warmup(max_batch_size)

    def _warm_lengths(self) -> list[int]:
        """The lengths a variable model's batches are padded to (its length buckets, when lengths are grouped), after
        which the batch of length 1 runs as the common warm-up; ``[1]`` for other models."""
        spec = packing.sequence_input(self.manifest)
        if spec is None or spec.max_length is None or not self.manifest.batching.group_lengths:
            return [1]
        buckets = sorted({packing.padded_length(self.manifest, spec, n) for n in range(1, spec.max_length + 1)})
        return [*buckets, 1]

    def close(self) -> None:
        for inst in self.instances:
            inst.close()


def fixed_timing(seconds: float) -> ForwardTiming:
    """A :data:`ForwardTiming` that gives ``seconds`` at any thread count."""
    return lambda threads: seconds


def module_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers, in their current dtype."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


@dataclass
class _Running:
    """A batch launched as a traced graph: kept, with its input, until :meth:`Engine._collect` answers it."""

    graph: torch.Future[torch.Tensor]
    batch: torch.Tensor
    chunks: list[np.ndarray]
    future: asyncio.Future[list[Outcome]]


def _checked(y: object, rows: int) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise EngineError(f"model returned {type(y).__name__}, expected a tensor")
    if y.shape[0] != rows:
        raise EngineError(f"batch size mismatch: model returned {y.shape[0]} rows for {rows} inputs")
    return y
