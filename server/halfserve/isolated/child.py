"""An instance process's main: load the model, warm up one engine instance, then run the batches it is sent.

Started by :class:`~halfserve.isolated.engine.ProcessEngine` with multiprocessing's ``spawn`` (a fresh interpreter, as
CUDA needs), its socket end and a :class:`~halfserve.isolated.protocol.ChildConfig`; its shared memory arrives over the
socket (``SCM_RIGHTS``), the weights too (frames, memory and the regions it maps are :mod:`halfserve.ipc`'s). It
builds the model from what it was handed (:mod:`halfserve.isolated.handover`), never from the store's files, and exits
when the socket closes: the server process gone is never left with orphans holding the device.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import mmap
import os
import signal
import socket
import time
from typing import Any

import numpy as np

from halfserve import compilecache, logs, models, store
from halfserve import precision as prec
from halfserve.compilation import tune_cudnn
from halfserve.engine.core import Engine
from halfserve.engine.intraop import fixed_timing, set_intra_op_threads
from halfserve.errors import (
    BatchFailedError,
    DeadlineExceededError,
    InternalError,
    InvalidInputError,
    ModelUnavailableError,
    OverLimitError,
    QueueFullError,
)
from halfserve.instance import Instance, pin_host
from halfserve.ipc.channel import Channel
from halfserve.ipc.exports import ImportedRegions
from halfserve.ipc.frames import FrameError
from halfserve.ipc.memory import InstanceMemory
from halfserve.ipc.tensors import descr, dtype_of
from halfserve.isolated import handling, handover
from halfserve.isolated.handling import InstanceHandler
from halfserve.isolated.protocol import IN_FRAME, INPUT_REGION, ChildConfig
from halfserve.manifest import Precision
from halfserve.precision import resolve_device
from halfserve.serving import Output

log = logging.getLogger(__name__)

OUTPUT_ALIGN = 64
"""Each output array starts at a multiple of this many bytes in the output region."""


def run(config: ChildConfig, sock: socket.socket, side: socket.socket) -> None:
    """The process's main (multiprocessing's target)."""
    settings = config.settings
    logs.configure(settings.log_format, settings.log_level.value)
    # The server process decides when instances stop: Ctrl-C reaches the whole process group, and a container's
    # SIGTERM the server process, which drains its batchers and then tells each instance to exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _, fds, _, _ = socket.recv_fds(sock, 16, 2)
    if len(fds) != 2:
        return
    channel = Channel(sock)
    memory = InstanceMemory(fds[0], config.input_bytes, config.output_bytes)
    try:
        with mmap.mmap(fds[1], 0, access=mmap.ACCESS_READ) as weights:
            data = bytes(weights)
        os.close(fds[1])
        engine, warmup_seconds = _start(config, memory, data)
    except Exception as e:  # reported to the server process, which fails the load with it
        log.exception("instance %d of %s failed to start", config.index, config.manifest.name)
        channel.send({"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return
    info = dataclasses.asdict(engine.info)
    info["precision"] = engine.precision.value
    channel.send({"op": "ready", "info": info, "warmup_seconds": warmup_seconds, "pid": os.getpid()})
    regions = ImportedRegions(side, pin_host if engine.device.type == "cuda" else None)
    try:
        _serve(config, engine, engine.instances[0], memory, channel, regions)
    except FrameError as e:  # the server process sent no frame, or died inside one: there is no one to answer
        log.error("instance %d of %s: %s; exiting", config.index, config.manifest.name, e)


def _start(config: ChildConfig, memory: InstanceMemory, weights: bytes) -> tuple[Engine, float]:
    """The process-wide settings the server process applies, then the engine (of the weights the server process
    loaded, handed over as safetensors bytes), its memory pinned, warmed up."""
    settings = config.settings
    set_intra_op_threads(config.cores)
    models.add_code_path(settings.code_path)
    models.forbid_store(settings.store)
    if config.code is not None:
        handover.install(config.code)  # from the source read at load, not the file as it is now
    if config.registers is not None and config.manifest.architecture not in models.names():
        importlib.import_module(config.registers)  # code the server process imported, not the model folder's
    prec.set_tf32(settings.tf32)
    device = resolve_device(settings.device)
    tune_cudnn(device, config.fixed_shapes)
    loaded = store.from_weights_bytes(settings.store, config.manifest, config.version, weights, config.hf_config)
    execution = loaded.manifest.execution.model_copy(update={"instances": 1})
    precision, kept = Precision(config.precision), config.fp32_modules
    cache = compilecache.from_setting(settings.compile_cache, settings.store)
    engine = Engine(
        loaded,
        precision,
        device,
        execution=execution,
        max_batch_size=config.max_batch_size,
        fp32_modules=kept,
        compile_cache=cache,
    )
    # Page-locked, the input region's rows go straight to the device (Instance.upload), with no staging copy.
    pin_host(memory.map)
    start = time.perf_counter()
    if settings.warmup:
        engine.warmup(config.max_batch_size)
        if settings.threads is None and device.type == "cpu":
            given = settings.forward_seconds
            engine.settle_threads(config.max_batch_size, config.cores, None if given is None else fixed_timing(given))
    return engine, time.perf_counter() - start


def _serve(
    config: ChildConfig,
    engine: Engine,
    inst: Instance,
    memory: InstanceMemory,
    channel: Channel,
    regions: ImportedRegions,
) -> None:
    """Run each batch sent until told to exit or the socket closes; one at a time, on the instance's own thread
    (cuDNN keeps its tuned algorithms per thread, and the warm-up ran there)."""
    handler: InstanceHandler | Exception | None = None
    for head, payload in channel.frames():
        op = head.get("op")
        if op == "exit":
            return
        if op == "forget":
            regions.forget(head["region"])
            continue
        memory.took(head["id"])  # from here on, a death is this op's (the server process reruns one not taken)
        if op == "handle":
            handler = handler or _handler(config, engine, inst)
            answer, parts = _handled(handler, engine, memory, head, payload)
        else:
            answer, parts = _batch(engine, inst, memory, regions, head, payload)
        channel.send(answer, *parts)


def _handler(config: ChildConfig, engine: Engine, inst: Instance) -> InstanceHandler | Exception:
    """The model's handler, built on the first handler batch (a model whose handler never runs here builds none),
    or why it cannot be: every handler batch is answered with that."""
    try:
        return InstanceHandler(config, engine, inst)
    except Exception as e:
        return ModelUnavailableError(f"model {config.manifest.name!r}: {e}")


def _handled(
    handler: InstanceHandler | Exception,
    engine: Engine,
    memory: InstanceMemory,
    head: dict[str, Any],
    payload: bytearray,
) -> tuple[dict[str, Any], list[bytes | memoryview]]:
    """Run one handler batch (``{"op": "handle"}``); the answer's header and payload: the outputs as a batch's,
    then each payload's JSON answer."""
    answer: dict[str, Any] = {"id": head["id"]}
    try:
        if isinstance(handler, Exception):
            raise ModelUnavailableError(str(handler))
        answers, outs = handler.run(handling.requests(head, payload))
    except (
        InvalidInputError,
        OverLimitError,
        InternalError,
        DeadlineExceededError,
        BatchFailedError,
        ModelUnavailableError,
        QueueFullError,
    ) as e:
        answer.update({"raise": True, "kind": type(e).__name__, "message": str(e), "counts": _counts(engine)})
        return answer, []
    except Exception as e:  # a bug here is the batch's 500, never the process's end
        message = f"{type(e).__name__}: {e}"
        answer.update({"raise": True, "kind": "InternalError", "message": message, "counts": _counts(engine)})
        return answer, []
    entries, used, parts = place_outputs(list(outs), memory)
    inline = sum(len(p) for p in parts)
    answer.update(
        {
            "outcomes": entries,
            "region_bytes": used,
            "answers": [inline, [len(a) for a in answers]],
            "counts": _counts(engine),
        }
    )
    return answer, [*parts, *answers]


def _chunks(
    memory: InstanceMemory, regions: ImportedRegions, head: dict[str, Any], payload: bytearray
) -> list[np.ndarray]:
    """The batch's chunks where the frame says they lie: the input region, the frame, or an exported region."""
    dtype, shape = dtype_of(head["dtype"]), tuple(head["shape"])
    per_row = math.prod(shape)
    chunks, inline = [], 0
    for where, offset, rows in head["chunks"]:
        if where == INPUT_REGION:
            chunks.append(memory.inputs(dtype, rows, shape, offset))
        elif where == IN_FRAME:
            chunks.append(np.frombuffer(payload, dtype, rows * per_row, inline).reshape(rows, *shape))
            inline += rows * per_row * dtype.itemsize
        else:
            chunks.append(np.frombuffer(regions.get(where), dtype, rows * per_row, offset).reshape(rows, *shape))
    return chunks


def _batch(
    engine: Engine,
    inst: Instance,
    memory: InstanceMemory,
    regions: ImportedRegions,
    head: dict[str, Any],
    payload: bytearray,
) -> tuple[dict[str, Any], list[bytes | memoryview]]:
    """Run one batch; the answer's header and payload."""
    answer: dict[str, Any] = {"id": head["id"]}
    try:
        chunks = _chunks(memory, regions, head, payload)
        if head.get("raw"):
            outcomes: list[Any] = [Output(inst.executor.submit(engine.forward, chunks, inst).result())]
            engine.real_elements = engine.padded_elements = 0  # calibration batches are not requests
        else:
            outcomes = list(inst.executor.submit(engine.run_batch, chunks, inst).result())
    except Exception as e:  # the batch as a whole: the server process raises it to its batcher
        answer.update({"raise": True, "kind": type(e).__name__, "message": str(e), "counts": _counts(engine)})
        return answer, []
    entries, used, parts = place_outputs(outcomes, memory)
    answer.update({"outcomes": entries, "region_bytes": used, "counts": _counts(engine)})
    return answer, parts


def place_outputs(outcomes: list[Any], memory: InstanceMemory) -> tuple[list[list[Any]], int, list[bytes | memoryview]]:
    """Each outcome's entry in the answer, its rows put in the output region (or the frame's payload past it), and
    the bytes of the region used.

    Outputs of one dtype and row shape lie back to back, and each such run is copied with one call: a batch's
    outputs are one request's rows after another's, and a copy per request cost 1.3-2.3 us of Python each
    (benchmarks/tools/output_copies.py). A run starts at a multiple of :data:`OUTPUT_ALIGN` bytes."""
    entries: list[list[Any]] = []
    parts: list[bytes | memoryview] = []
    runs: list[tuple[int, list[np.ndarray]]] = []  # (start offset, outputs back to back from there)
    offset = inline = 0
    last: tuple[np.dtype[Any], tuple[int, ...]] | None = None
    for o in outcomes:
        if isinstance(o, Exception):
            entries.append(["error", type(o).__name__, str(o)])
            continue
        data, tag = (o.data, o.precision) if isinstance(o, Output) else (o, None)
        kind = (data.dtype, data.shape[1:])
        joins = kind == last and data.ndim > 0  # rows after the previous output's, of the same dtype and row shape
        start = offset if joins else -(-offset // OUTPUT_ALIGN) * OUTPUT_ALIGN
        if start + data.nbytes <= memory.output_bytes:
            if not joins:
                runs.append((start, []))
            runs[-1][1].append(data)
            entries.append(["out", descr(data.dtype), data.shape, start, tag, False])
            offset, last = start + data.nbytes, kind
        else:
            entries.append(["out", descr(data.dtype), data.shape, inline, tag, True])
            parts.append(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data)
            inline += data.nbytes
    for start, arrays in runs:
        first = arrays[0]
        place = memory.output(first.dtype, (sum(map(len, arrays)), *first.shape[1:]) if first.ndim else (), start)
        assert place is not None  # each output was checked to fit
        if first.ndim:
            np.concatenate(arrays, out=place)
        else:
            np.copyto(place, first)
    return entries, offset, parts


def _counts(engine: Engine) -> dict[str, int]:
    return {
        "forwards": engine.forwards,
        "overflows": engine.overflows,
        "fp32_reruns": engine.fp32_reruns,
        "real_elements": engine.real_elements,
        "padded_elements": engine.padded_elements,
    }
