"""The engine's core: one model cast for serving on one device under a precision policy, and its instances.

Batches arrive as lists of numpy arrays (one per request chunk) and leave as one outcome per chunk: float32 output
rows tagged with the precision that computed them, or the error that fails that chunk alone. Where a batch runs (an
instance's thread, the event loop's, a traced graph beside it) is the engine's runner's
(:mod:`halfserve.engine.runners`); the core stages, runs and checks it wherever that is.

Two faults are the engine's to recognise, because they need torch to see (:mod:`halfserve.engine.faults`): out of
memory, answered as a batch too large, and a half-precision output's overflow, handled per the model's overflow
policy.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
import types
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from halfserve import aoti, compilation, compilecache, packing, records
from halfserve import precision as prec
from halfserve.engine import faults, intraop
from halfserve.engine.inputs import Normalizer, has_conv2d, takes_positionally
from halfserve.engine.protocol import BatchRunner, EngineInfo
from halfserve.engine.rows import checked
from halfserve.engine.threads import ThreadRunner
from halfserve.errors import BatchTooLargeError
from halfserve.execution import Compile, Execution
from halfserve.instance import Instance, bucket_for, torch_dtype
from halfserve.manifest import OverflowPolicy, Precision
from halfserve.placement import Placement, pads_to_buckets
from halfserve.serving import Outcome
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)


def batch_buckets(max_batch_size: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes warmed up at load, ascending: ``sizes`` (default: powers of two) below ``max_batch_size``,
    and ``max_batch_size`` itself."""
    if sizes is None:
        sizes = [1 << i for i in range(max_batch_size.bit_length())]
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


class Engine:
    """Owns a model cast for serving on one device; runs batches where its :attr:`runner` says (on its instances'
    threads until the repository places it elsewhere).

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
        fp32_modules: tuple[str, ...] = (),
        compile_cache: compilecache.CompileCache | None = None,
    ) -> None:
        self.name, self.version = loaded.manifest.name, loaded.version
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
        self.out_shape = tuple(loaded.manifest.outputs[0].shape)
        self.input_names = [t.name for t in loaded.manifest.inputs]
        self.output_names = [t.name for t in loaded.manifest.outputs]
        self.out_float = loaded.manifest.outputs[0].datatype.numpy.kind == "f"
        """Whether the (first) output is floating, returned as float32; integer and bool outputs keep their type."""
        self.manifest = loaded.manifest
        self._version_dir = loaded.path.parent
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
        self.aoti = ex.compile is Compile.AOTI
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
        half = prec.weight_dtype(self.precision)
        self.fp32_modules = fp32_modules if half != torch.float32 else ()
        """A mixed-precision plan's modules, kept in fp32 (:mod:`halfserve.mixed`); none where the weights are fp32."""
        if self.fp32_modules:
            prec.keep_fp32(model, self.fp32_modules, half, loaded.module)
        self.input_precision = Precision.FP32 if self.fp32_modules else self.precision
        """What floating inputs are cast to before the forward. A plan's model takes them in fp32: each module with
        parameters casts its own (:func:`halfserve.precision.keep_fp32`), and a kept module that reads the input
        would otherwise compute in fp32 on values already rounded to the half dtype."""
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.model: nn.Module = model
        self.guard = faults.OverflowGuard(loaded, self.overflow, self.precision, self.positional)
        """The overflow policy over this engine's output rows, with what it counted (:mod:`halfserve.engine.faults`)."""
        self.instances = [Instance(self.name, i, device) for i in range(ex.instances)]
        self.threads: int | None = None
        """Intra-op threads chosen by :meth:`settle_threads` (None: the process's setting)."""
        self.loop_bound: bool | None = None
        """Whether a full batch's forward, timed by :meth:`settle_threads`, is shorter than the event loop's work on
        its requests (:func:`halfserve.placement.loop_bound`); None until timed."""
        self.runner: BatchRunner = ThreadRunner(self.instances, self.run_batch)
        """How batches run: on the instances' threads until :func:`halfserve.engine.runners.place` gives it another
        placement's runner (the repository, as :func:`halfserve.placement.choose` decided)."""
        self.placement_changed: str | None = None
        """Why batches no longer run where the repository placed them (None while they do): forwards on the event
        loop that ran long past their budget (:class:`halfserve.engine.loop.LoopRunner`)."""
        self.batch_seconds: float | None = None
        """A full batch's forward (:attr:`batch_rows`) on the settled intra-op threads, timed by :meth:`settle_threads`
        (None until)."""
        self.batch_rows = 0
        self.cores = 0
        """The cores :meth:`settle_threads` settled the intra-op threads for (0 until)."""
        self._lock = threading.Lock()
        self._compiled_code: types.CodeType | None = None
        """The code object whose compiled shapes are this engine's (:func:`halfserve.compilation.own_code`); None when
        not compiled."""
        self._forward: Callable[[torch.Tensor], torch.Tensor] = self.eager
        if self.inductor:
            self._forward, self._compiled_code = compilation.compiled(self.eager, compile_cache)
        self.compile_seconds = 0.0
        self._cache, self.cache_use = compile_cache, compilecache.CacheUse()
        self._room_made = False
        self._packaged: aoti.Packaged | None = None
        if self.inductor and self.buckets:
            self._make_room_for_compiles(self.buckets)  # before any batch: with --no-warmup they compile under load

    @functools.cached_property
    def built_from(self) -> Mapping[str, object] | None:
        """What its AOTInductor packages are built from (:func:`halfserve.compilecache.built_from`), digested once."""
        return compilecache.built_from(self.name, self._version_dir, self.manifest)

    @property
    def overflows(self) -> int:
        return self.guard.overflows

    @property
    def fp32_reruns(self) -> int:
        return self.guard.fp32_reruns

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
            fp32_fallback_bytes=module_bytes(self.guard.fp32) if self.guard.fp32 is not None else 0,
            instances=len(self.instances),
            buckets=tuple(self.buckets),
            cuda_graphs=self.cuda_graphs,
            channels_last=self.channels_last,
            graph_capture_seconds=sum(g.capture_seconds for i in self.instances for g in i.graphs.values()),
            inductor=self.inductor,
            aoti=self.aoti,
            inductor_compile_seconds=self.compile_seconds,
            compile_cache=self.cache_use.outcome,
            compile_cache_load_seconds=self.cache_use.load_seconds,
            compiled_graphs=self.cache_use.compiled_graphs,
            cached_graphs=self.cache_use.cached_graphs,
            placement=self.placement,
            placement_changed=self.placement_changed,
        )

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        """A device batch as the model takes it: normalised (when the manifest says so) and cast to the dtype it
        takes (:attr:`input_precision`) on the device (the copy moved the rows as they arrived; a host-side cast
        would cost a CPU pass and an unpinned temporary), NHWC where the engine runs channels_last."""
        if self._normalize is not None:
            t = self._normalize(t)
        t = prec.cast_input(t, self.input_precision)
        if self.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def eager(self, t: torch.Tensor) -> torch.Tensor:
        return records.first_output(self.model(self._prepare(t)), self.output_names)

    def _count_padding(self, padding: records.Padding) -> None:
        with self._lock:  # instances run on their own threads
            self.real_elements += padding.real
            self.padded_elements += padding.padded

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """Cast and run a batch already on the device, under the precision's context (compiled with ``inductor``, or
        as ``aoti`` packages)."""
        if self.aoti and self._packaged is None:
            self._load_packages(self.buckets or [len(t)])  # not warmed up: the first batch loads (or builds) them
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
                    self.manifest, self.model, batch, size, self.device, self.input_precision, self.positional
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
            return inst.fetch(checked(y, size)[:rows], widen=self.out_float)

    def compute(self, x: np.ndarray) -> np.ndarray:
        """The model's outputs for ``x`` as one batch on the first instance's own thread, without the overflow
        policy (the fidelity check's forward); blocks, so call it off the event loop."""
        inst = self.instances[0]
        return inst.executor.submit(self.forward, x, inst).result()

    def run_batch(self, chunks: list[np.ndarray], inst: Instance | None = None) -> list[Outcome]:
        """Run the chunks of one batch as a single forward, synchronously; returns one outcome per chunk, after the
        overflow policy (:meth:`run` is the batcher's way in, on an instance's thread).

        Raises :class:`~halfserve.errors.BatchTooLargeError` when the device runs out of memory.
        """
        try:
            out = self.forward(chunks, inst)
        except Exception as e:
            if not faults.is_out_of_memory(e):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # give the failed batch's blocks back before the smaller reruns
            rows = sum(len(c) for c in chunks)
            raise BatchTooLargeError(f"out of memory on {self.device} running {rows} rows: {e}") from None
        return self.guard.outcomes(chunks, out)

    @property
    def placement(self) -> Placement:
        """Where batches run: the runner's placement (:mod:`halfserve.engine.runners` builds it)."""
        return self.runner.placement

    def run(self, chunks: list[np.ndarray]) -> asyncio.Future[list[Outcome]]:
        """Start a batch where :attr:`placement` says, without blocking the event loop: the future of its outcomes
        (the runner contract)."""
        return self.runner.run(chunks)

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """The batches this engine takes for a model's ``max_batch_size``: the most rows in one, and how many may be in
        flight at once (its runner's)."""
        return self.runner.batches(max_batch_size)

    def take_threads(self) -> None:
        """Give the calling thread the intra-op threads this engine settled on (OpenMP's count is each thread's own
        setting, and threads torch starts take their starter's)."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            intraop.set_intra_op_threads(self.threads)

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
            and not (self.named or self.pad or self.inductor or self.aoti)
            and self.precision is not Precision.AUTOCAST
        )

    @property
    def available(self) -> bool:
        """Whether an instance can run a batch now: always, for in-process instances (they live as long as the
        engine)."""
        return True

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
        if self.aoti and self._packaged is None:
            self._load_packages(sizes)
        with compilecache.warming(self._cache, self.cache_use, self if self.inductor else None, sizes):
            for inst in self.instances:
                inst.executor.submit(self._warm_instance, inst, sizes).result()
        self.real_elements = self.padded_elements = 0  # the padding of requests, not of warm-up batches
        return time.perf_counter() - start

    def _load_packages(self, sizes: list[int]) -> None:
        """Load the AOTInductor packages of this engine at batch sizes ``sizes`` from the compile cache, or build them
        (:mod:`halfserve.aoti`); from here on its forward runs them."""
        with self._lock:
            if self._packaged is not None:
                return
            name = compilecache.engine_key(self, sizes) if self._cache and self._cache.usable else None
            cached = (self._cache, name) if self._cache and name is not None else None
            example = torch.zeros((1, *self.sample_shape), dtype=torch_dtype(self.input_dtype), device=self.device)
            with prec.inference(self.precision, self.device):  # the exported program holds the precision's casts
                packaged, self.compile_seconds = aoti.packaged(
                    self.model, self.eager, example, sizes, len(self.instances), cached, self.cache_use
                )
            self._forward, self._packaged = packaged, packaged
        if self.compile_seconds:
            log.info("%s: compiled with AOTInductor in %.2fs", self.name, self.compile_seconds)

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
                x = self.warm_batch(size, length)
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

    def warm_batch(self, size: int, length: int = 1) -> np.ndarray:
        """``size`` rows of zeros as requests bring them, host rows of the input's dtype (graphs are per dtype), each
        variable input ``length`` long."""
        x = np.zeros((size, *self.sample_shape), dtype=self.input_dtype)
        for name in x.dtype.names or ():
            if name.endswith(packing.LENGTH):
                x[name] = length
        return x

    def settle_threads(self, max_batch_size: int, cores: int, timing: intraop.ForwardTiming | None = None) -> int:
        """Set each instance's torch intra-op threads to :func:`~halfserve.placement.intra_op_threads` of a timed
        forward of a full batch on all ``cores`` (:func:`halfserve.engine.intraop.settle`, on a CPU; run after
        warm-up), and return the count chosen.

        ``timing`` gives that forward's seconds at a thread count instead of timing it (the ``forward_seconds``
        setting, and tests): what is decided from the timing then depends on it alone, not on the host's speed.

        A model with a variable input is timed at its ``max_length``: the longest batch it can be sent, which is what
        decides whether a batch may hold up the event loop (:attr:`loop_bound`). An engine compiled with TorchInductor
        then sets every instance to the count chosen and compiles its buckets again at it (:meth:`_compile_again`),
        unless it warmed up, was timed and settled at ``cores`` throughout.
        """
        sequence = packing.sequence_input(self.manifest)
        x = self.warm_batch(max_batch_size, sequence.bounded()[0] if sequence is not None else 1)
        settled = [
            inst.executor.submit(
                intraop.settle,
                functools.partial(self.forward, x, inst),
                f"{self.name}[{inst.index}]",
                max_batch_size,
                cores,
                timing,
            ).result()
            for inst in self.instances
        ]
        self.threads = min(s.threads for s in settled)
        # Every instance times the same batch: the last one's timing stands for the engine.
        self.loop_bound, self.batch_seconds = settled[-1].loop_bound, settled[-1].batch_seconds
        self.batch_rows, self.cores = max_batch_size, cores
        if self._compiled_code is not None and {*(s.warmed_at for s in settled), self.threads} != {cores}:
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
            inst.executor.submit(intraop.set_intra_op_threads, threads).result()
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


def module_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters and buffers, in their current dtype."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
