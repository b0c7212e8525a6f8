"""A model being served: its manifest and version, once ready its engine and batcher, and what it has done; a
request's way into its batcher (:meth:`ServedModel.submit`) and its listing (:meth:`ServedModel.describe`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from halfserve.batching import Batcher
from halfserve.batchstats import BatchStats
from halfserve.engine.protocol import EngineInfo, ModelEngine
from halfserve.errors import InvalidInputError
from halfserve.execution import Batching
from halfserve.fidelity import Fidelity
from halfserve.indices import check_indices
from halfserve.isolated.engine import ProcessEngine
from halfserve.isolated.handling import HandledOutcomes
from halfserve.livefidelity import LiveFidelity
from halfserve.manifest import Manifest, Precision
from halfserve.mixed import Outcome
from halfserve.packing import LENGTH, PackError, pack, packs_records, padded_length, sequence_input
from halfserve.padding import PaddingCheck
from halfserve.serving import Handled, HandlerPayload, HeldAnswer, ModelState, Output, Prediction, Tensors, not_serving
from halfserve.store import LoadedModel

_repository_log = logging.getLogger("halfserve.repository")
"""Switches are logged as the repository's, where they are made."""


class PrecisionSource(str, Enum):
    """What decided the precision a model is served in, as ``/models`` names it."""

    MANIFEST = "manifest"
    """The manifest's ``precision`` (``auto`` resolved for the device)."""
    SERVER = "server"
    """The server's ``--precision``."""
    OPERATOR = "operator"
    """Set at run time through the management API."""
    FIDELITY_FALLBACK = "fidelity_fallback"
    """fp32, the half precision having fallen below its fidelity bar."""
    MIXED_PLAN = "mixed_plan"
    """The half precision with a few modules kept in fp32 (``mixed_precision`` names them), the whole model having
    fallen below its fidelity bar in half precision (:mod:`halfserve.mixed`)."""
    LIVE_FIDELITY = "live_fidelity"
    """fp32, the half precision having fallen below its fidelity bar on sampled rows of real requests
    (:mod:`halfserve.livefidelity`)."""
    LIVE_MIXED_PLAN = "live_mixed_plan"
    """The half precision with a few modules kept in fp32, searched on the sampled rows of real requests on which the
    whole model fell below its fidelity bar (``mixed_precision`` names them; :mod:`halfserve.livefidelity`)."""


@dataclass
class ServedModel:
    """A model being served: its manifest, and once ready, its engine and batcher."""

    name: str
    manifest: Manifest
    version: int
    batching: Batching
    state: ModelState = ModelState.LOADING
    error: str | None = None
    engine: ModelEngine | None = None
    precision: Precision | None = None
    """The resolved precision the engine serves in, once loaded."""
    batcher: Batcher | None = None
    warmup_seconds: float = 0.0
    fidelity: Fidelity | None = None
    """Half precision against fp32 on the version's calibration samples, measured at load (None: not measured)."""
    fidelity_bar: dict[str, object] | None = None
    """The bar the model was held to at load (None: not held to one: fp32, or the check is off)."""
    fp32_fallback: str | None = None
    """Why the model is served in fp32 although its precision is a half one (it fell below its fidelity bar)."""
    fidelity_shortfall: str | None = None
    """How the half precision measured at load fell below its bar (None: it met it, or was not measured); kept when
    the operator switches the precision, so the listing still says what was measured."""
    shortfall_precision: Precision | None = None
    """The half precision that ``fidelity_shortfall`` is about."""
    precision_source: PrecisionSource | None = None
    """What decided the precision served (None: not loaded yet)."""
    precision_record: dict[str, Any] | None = None
    """:meth:`halfserve.precision_record.AtLoad.shown`: the version's precision record as the load checked it, kept
    whatever the load then served and across precision switches (None: the load held no half precision to a bar: fp32,
    the check off, or a half forward that failed at warm-up)."""
    calibration: str | None = None
    """Where the version's stored calibration samples came from (None: it stores none)."""
    padding: PaddingCheck | None = None
    """The padding-invariance check at load (None: no variable dimension, or not checked)."""
    loaded_at: float = field(default_factory=time.time)
    final_stats: BatchStats | None = None
    """The statistics of the last batcher, kept once it is released (for the drain report)."""
    successor: ServedModel | None = None
    """The load that replaced this one (a reload, or another version): a request that looked this one up just before
    the swap and reaches :meth:`submit` after its release is answered there, so a reload fails no request."""
    loaded: LoadedModel | None = None
    """The checkpoint's fp32 weights on the host, kept so the precision can be switched without re-reading it."""
    host_weight_bytes: int = 0
    """Bytes of those fp32 host weights."""
    retired_overflows: int = 0
    """Overflows and fp32 reruns counted by engines replaced by a precision switch (their counts carry over)."""
    retired_fp32_reruns: int = 0
    index_limits: dict[str, int] = field(default_factory=dict)
    """The integer inputs that index an embedding, each with its table's row count (:mod:`halfserve.indices`): ids
    outside ``0 .. count - 1`` are refused before they are queued."""
    mixed: Outcome | None = None
    """The load's search for a mixed-precision plan (None: none was needed or searched)."""
    live: LiveFidelity | None = None
    """Live fidelity of the rows it answers in a half precision (None: not sampled)."""
    failed_versions: dict[int, str] = field(default_factory=dict)
    """Versions that failed to load in place of this one, each with the reason: newer ones passed over at start-up,
    or one a load or reload tried while this one kept serving."""

    def switched(self, precision: Precision, target: Precision, fallback: str | None) -> None:
        """Make the model's fallback reason, precision source and log agree with a switch to ``precision``."""
        self.fp32_fallback = fallback
        fell_back = fallback is not None
        self.precision_source = PrecisionSource.FIDELITY_FALLBACK if fell_back else PrecisionSource.OPERATOR
        measured = self.shortfall_precision
        if fallback is not None and measured is not None:
            _repository_log.warning(
                "model %s: %s is %s here, which fell below its fidelity bar at load; served in fp32: %s",
                self.name,
                precision.value,
                measured.value,
                fallback,
            )
        elif self.fidelity_shortfall is not None and target is measured:
            _repository_log.warning(
                "model %s is served in %s as the operator set it, although at load %s",
                self.name,
                target.value,
                self.fidelity_shortfall,
            )

    def plan_for(self, precision: Precision) -> tuple[str, ...]:
        """The modules an engine in ``precision`` keeps in fp32: the load's mixed-precision plan where it was found
        for that precision, else none."""
        plan = self.mixed.plan if self.mixed is not None else None
        return plan.modules if plan is not None and plan.precision is precision else ()

    @property
    def overflows(self) -> int:
        """Half-precision overflows since the model was loaded, across precision switches."""
        return self.retired_overflows + (self.engine.overflows if self.engine is not None else 0)

    @property
    def fp32_reruns(self) -> int:
        """Chunks rerun in fp32 after an overflow since the model was loaded, across precision switches."""
        return self.retired_fp32_reruns + (self.engine.fp32_reruns if self.engine is not None else 0)

    @property
    def serving(self) -> bool:
        """Ready, with a batcher to take requests now."""
        return self.state is ModelState.READY and self.batcher is not None

    @property
    def available(self) -> bool:
        """Whether an instance can run a batch now (see :attr:`halfserve.serving.ModelHandle.available`)."""
        return self.engine is None or self.engine.available

    def submit(self, inputs: Tensors, timeout: float | None = None) -> asyncio.Future[Prediction]:
        """Queue ``inputs`` for batching; see :meth:`halfserve.serving.ModelHandle.submit`.

        A read-only input (a binary request body decoded in place) is copied first: the engine hands a batch's rows to
        torch without a copy where it can, and torch takes only writable memory."""
        batcher = self.batcher
        if batcher is None:
            successor = self.successor
            # Decoded against this one's signature (a text tokenized off the loop while the swap happened): the one
            # now served takes it where the signature is the same; otherwise the client is told to send it again.
            if successor is not None and successor.manifest.inputs == self.manifest.inputs:
                return successor.submit(inputs, timeout)
            raise not_serving(self)
        if self.index_limits:
            check_indices(self.index_limits, self.manifest, inputs)
        x = self._input(inputs)
        configured = self.batching.request_timeout_ms
        if configured is not None:
            timeout = configured / 1000.0 if timeout is None else min(timeout, configured / 1000.0)
        if not x.flags.writeable:
            x = x.copy()
        deadline = None if timeout is None else batcher.clock.now() + timeout
        if x.dtype.names is None:
            return batcher.enqueue(x, deadline, self._prediction)
        group, length = self._group(x)
        finish = self._prediction if length is None else functools.partial(self._prediction, length=length)
        return batcher.enqueue(x, deadline, finish, group)

    def handle(self, payloads: Sequence[HandlerPayload]) -> HeldAnswer[Handled] | None:
        """See :meth:`halfserve.serving.ModelHandle.handle`: in an instance process where its instances are processes
        and it takes one input as one array; ``None`` otherwise (rows packed into records, or token ids whose range is
        checked here, are built on this process's handler threads)."""
        engine = self.engine
        if not isinstance(engine, ProcessEngine) or self.batcher is None:
            return None
        if packs_records(self.manifest) or self.index_limits:
            return None
        return _Handling(engine.handle(list(payloads)), self.batcher.stats, self._prediction)

    def _input(self, inputs: Tensors) -> np.ndarray:
        """The request's rows as the batcher takes them: the one input's array, or the model's inputs packed into
        records (:func:`halfserve.packing.pack`), one per row."""
        if not packs_records(self.manifest):
            name = self.manifest.inputs[0].name
            x = inputs.get(name)
            if x is None or len(inputs) != 1:
                got = ", ".join(map(repr, inputs)) or "none"
                raise InvalidInputError(f"inputs: expected {name!r} alone, got {got}")
            return x
        try:
            return pack(self.manifest, inputs)
        except PackError as e:
            raise InvalidInputError(str(e)) from None

    def _group(self, packed: np.ndarray) -> tuple[Hashable, int | None]:
        """The batching group of a packed request (its length bucket; one group when lengths are not grouped), and the
        length its variable outputs are cut to (``None``: none are)."""
        spec = sequence_input(self.manifest)
        if spec is None:
            return None, None
        length = int(packed[spec.name + LENGTH].max())
        grouped = self.manifest.batching.group_lengths
        return (padded_length(self.manifest, spec, length) if grouped else None), length

    def _prediction(self, out: np.ndarray, precisions: tuple[Precision, ...], length: int | None = None) -> Prediction:
        """The batcher's output rows as the model's named outputs, with the precision that computed them; variable
        outputs cut to the request's ``length``."""
        precision = precisions or ((self.precision,) if self.precision is not None else ())
        if out.dtype.names is None:
            return Prediction({self.manifest.outputs[0].name: out}, precision)
        outputs = {}
        for spec in self.manifest.outputs:
            field = out[spec.name]
            outputs[spec.name] = np.ascontiguousarray(field[:, :length] if spec.variable else field)
        return Prediction(outputs, precision)

    @property
    def batch_stats(self) -> BatchStats | None:
        """What its batcher has done since it was loaded (None while it has none)."""
        return self.batcher.stats if self.batcher is not None else None

    def stats(self) -> dict[str, object] | None:
        """What the batcher and the engine have done since the model was loaded; ``None`` unless it is served."""
        batcher, engine = self.batcher, self.engine
        if batcher is None:
            return None
        stats = batcher.stats.snapshot()
        stats["queued_rows"] = batcher.queued_rows
        stats["max_batch_size"] = batcher.max_batch_size
        stats["configured_max_batch_size"] = batcher.configured_max_batch_size
        if engine is not None:
            stats["overflow_policy"] = engine.overflow.value
            stats["overflows"] = self.overflows
            stats["fp32_reruns"] = self.fp32_reruns
            stats["instance_forwards"] = [i.forwards for i in engine.instances]
            if isinstance(engine, ProcessEngine):
                stats["instance_pids"] = [i.pid for i in engine.instances]
                stats["instance_restarts"] = engine.restarts
                stats["instance_start_failures"] = engine.start_failures
                stats["input_bytes_copied"] = engine.copied_bytes
                stats["input_bytes_in_place"] = engine.in_place_bytes
            if engine.real_elements:
                stats["real_elements"] = engine.real_elements
                stats["padded_elements"] = engine.padded_elements
                stats["padding_waste"] = round(engine.padded_elements / engine.real_elements, 4)
        return stats

    def describe(self) -> dict[str, object]:
        """The model's listing: signature, batching limits, device and precision once loaded."""
        m = self.manifest
        info = self.engine.info if self.engine else None
        return {
            "name": self.name,
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
            "device": info.device if info else None,
            "precision": info.precision.value if info else None,
            "weight_dtype": info.weight_dtype if info else None,
            "weight_bytes": info.weight_bytes if info else None,
            "fp32_fallback_bytes": info.fp32_fallback_bytes if info else None,
            "host_fp32_bytes": self.host_weight_bytes if self.loaded is not None else None,
            "inputs": [s.model_dump(mode="json") for s in m.inputs],
            "outputs": [s.model_dump(mode="json") for s in m.outputs],
            "labels": m.labels,
            "batching": self.batching.model_dump(),
            "overflow": m.overflow.value,
            "allow_nonfinite_inputs": m.allow_nonfinite_inputs,
            "description": m.description,
            "evaluation": m.evaluation,
            "fidelity": self.fidelity.as_dict() if self.fidelity is not None else None,
            "min_agreement": m.min_agreement,
            "fidelity_bar": self.fidelity_bar,
            "fp32_fallback": self.fp32_fallback,
            "fidelity_shortfall": self.fidelity_shortfall,
            "precision_source": self.precision_source.value if self.precision_source is not None else None,
            "mixed_precision": self.mixed.as_dict() if self.mixed is not None else None,
            "live_fidelity": self.live.describe() if self.live is not None else None,
            "precision_record": self.precision_record,
            "calibration": self.calibration,
            "padding": self.padding.as_dict() if self.padding is not None else None,
            "warmup_seconds": round(self.warmup_seconds, 4),
            "execution": _execution(info) if info else m.execution.model_dump(mode="json"),
            "loaded_at": self.loaded_at,
            "failed_versions": [{"version": v, "error": e} for v, e in sorted(self.failed_versions.items())],
            "stats": self.stats(),
        }


def _execution(info: EngineInfo) -> dict[str, object]:
    """How a loaded engine runs: what the manifest asked for, as resolved for its device."""
    return {
        "instances": info.instances,
        "buckets": list(info.buckets),
        "cuda_graphs": info.cuda_graphs,
        "channels_last": info.channels_last,
        "graph_capture_seconds": round(info.graph_capture_seconds, 4),
        "inductor": info.inductor,
        "aoti": info.aoti,
        "inductor_compile_seconds": round(info.inductor_compile_seconds, 4),
        "compile_cache": info.compile_cache.value,
        "compile_cache_load_seconds": round(info.compile_cache_load_seconds, 4),
        "compiled_graphs": info.compiled_graphs,
        "cached_graphs": info.cached_graphs,
        "placement": info.placement.value,
        "placement_changed": info.placement_changed,
    }


class _Handling(HeldAnswer[Handled]):
    """A handler batch's answer from an instance process (``sent``, the engine's), counted in the model's statistics
    as the batcher counts a handler batch's one submit on handler threads; started when ``sent`` is. Cancelled, it
    cancels ``sent``, which withdraws a batch no process took yet."""

    __slots__ = ("_sent", "_stats", "_start", "_prediction")

    def __init__(
        self,
        sent: HeldAnswer[HandledOutcomes],
        stats: BatchStats,
        prediction: Callable[[np.ndarray, tuple[Precision, ...]], Prediction],
    ) -> None:
        super().__init__(loop=sent.get_loop())
        self._sent, self._stats, self._prediction = sent, stats, prediction
        self._start = time.perf_counter()
        stats.requests += 1
        sent.add_done_callback(self._answered)
        self.add_done_callback(self._left)

    def started(self) -> bool:
        return self._sent.started()

    def _left(self, _: asyncio.Future[Handled]) -> None:
        if self.cancelled():
            self._sent.cancel()

    def _answered(self, sent: asyncio.Future[HandledOutcomes]) -> None:
        stats = self._stats
        error = None if sent.cancelled() else sent.exception()
        if sent.cancelled() or error is not None:
            stats.failed_batches += 1
            stats.failed += 1
            if self.done():
                return
            if error is None:
                self.cancel()
            else:
                self.set_exception(error)
            return
        answers, outcomes = sent.result()
        elapsed, rows = time.perf_counter() - self._start, len(answers)
        stats.batches += 1
        stats.rows += rows
        stats.batch_sizes[rows] += 1
        stats.compute_seconds += elapsed
        stats.batch_compute_seconds[rows] = stats.batch_compute_seconds.get(rows, 0.0) + elapsed
        stats.succeeded += 1
        stats.success_seconds += elapsed
        stats.last_inference = time.time()
        outs = [o for o in outcomes if isinstance(o, Output)]
        assert len(outs) == len(outcomes), "a handler batch's forwards failed as a whole or not at all"
        data = outs[0].data if len(outs) == 1 else np.concatenate([o.data for o in outs])
        tags = tuple(dict.fromkeys(o.precision for o in outs if o.precision is not None))
        if not self.done():
            self.set_result(Handled(answers, self._prediction(data, tags)))
