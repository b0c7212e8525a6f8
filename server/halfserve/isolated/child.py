"""An instance process's main: load the model, warm up one engine instance, then run the batches it is sent.

Started by :class:`~halfserve.isolated.engine.ProcessEngine` with multiprocessing's ``spawn`` (a fresh interpreter, as
CUDA needs), its socket end and a :class:`~halfserve.isolated.wire.ChildConfig`; its shared memory arrives over the
socket (``SCM_RIGHTS``), the weights too. It builds the model from what it was handed
(:mod:`halfserve.isolated.handover`), never from the store's files, and exits when the socket closes: the server process
gone is never left with orphans holding the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import mmap
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from halfserve import logs, models, store
from halfserve import precision as prec
from halfserve.compilation import tune_cudnn
from halfserve.engine.core import Engine, fixed_timing, resolve_device, set_intra_op_threads
from halfserve.instance import Instance, pin_host
from halfserve.isolated import handover
from halfserve.isolated.wire import IN_FRAME, INPUT_REGION, REGION, ChildConfig, Memory, descr, dtype_of
from halfserve.multiproc.wire import FrameReader, frame
from halfserve.precision import Precision
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
    memory = Memory(fds[0], config.input_bytes, config.output_bytes)
    try:
        with mmap.mmap(fds[1], 0, access=mmap.ACCESS_READ) as weights:
            data = bytes(weights)
        os.close(fds[1])
        engine, warmup_seconds = _start(config, memory, data)
    except Exception as e:  # reported to the server process, which fails the load with it
        log.exception("instance %d of %s failed to start", config.index, config.manifest.name)
        _send(sock, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return
    info = dataclasses.asdict(engine.info)
    info["precision"] = engine.precision.value
    _send(sock, {"op": "ready", "info": info, "warmup_seconds": warmup_seconds, "pid": os.getpid()})
    _serve(engine, engine.instances[0], memory, sock, Regions(side, engine.device.type == "cuda"))


def _start(config: ChildConfig, memory: Memory, weights: bytes) -> tuple[Engine, float]:
    """The process-wide settings the server process applies, then the engine (of the weights the server process
    loaded, handed over as safetensors bytes), its memory pinned, warmed up."""
    settings = config.settings
    set_intra_op_threads(config.cores)
    models.add_code_path(settings.code_path)
    if config.code is not None:
        handover.install(config.code)  # from the source read at load, not the file as it is now
    if config.registers is not None and config.manifest.architecture not in models.names():
        importlib.import_module(config.registers)  # code the server process imported, not the model folder's
    prec.set_tf32(settings.tf32)
    device = resolve_device(settings.device)
    tune_cudnn(device, config.fixed_shapes)
    loaded = store.from_weights_bytes(settings.store, config.manifest, config.version, weights, config.hf_config)
    execution = loaded.manifest.execution.model_copy(update={"instances": 1})
    engine = Engine(
        loaded, Precision(config.precision), device, execution=execution, max_batch_size=config.max_batch_size
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


class Regions:
    """The engine process's shared regions this process was handed (front-ends' slots), mapped and, on CUDA,
    page-locked once each."""

    def __init__(self, side: socket.socket, cuda: bool) -> None:
        self.side, self.cuda = side, cuda
        self.maps: dict[int, tuple[mmap.mmap, Callable[[], None] | None]] = {}

    def get(self, region: int) -> mmap.mmap:
        """A region's map; its descriptor was sent on the side channel before the frame that names it."""
        while region not in self.maps:
            data, fds, _, _ = socket.recv_fds(self.side, REGION.size, 1)
            if not fds:
                raise ConnectionError("the side channel closed")
            rid, size = REGION.unpack(data)
            try:
                memory = mmap.mmap(fds[0], size)
            finally:
                os.close(fds[0])
            self.maps[rid] = (memory, pin_host(memory) if self.cuda else None)
        return self.maps[region][0]

    def forget(self, region: int) -> None:
        found = self.maps.pop(region, None)
        if found is not None:
            memory, unpin = found
            if unpin is not None:
                unpin()
            with contextlib.suppress(BufferError):  # a view still held: the map goes with it
                memory.close()


def _serve(engine: Engine, inst: Instance, memory: Memory, sock: socket.socket, regions: Regions) -> None:
    """Run each batch sent until told to exit or the socket closes; one at a time, on the instance's own thread
    (cuDNN keeps its tuned algorithms per thread, and the warm-up ran there)."""
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return
        for head, payload in reader.feed(data):
            op = head.get("op")
            if op == "exit":
                return
            if op == "forget":
                regions.forget(head["region"])
                continue
            _send(sock, *_batch(engine, inst, memory, regions, head, payload))


def _chunks(memory: Memory, regions: Regions, head: dict[str, Any], payload: bytearray) -> list[np.ndarray]:
    """The batch's chunks where the frame says they lie: the input region, the frame, or a shared region."""
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
    engine: Engine, inst: Instance, memory: Memory, regions: Regions, head: dict[str, Any], payload: bytearray
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
    entries: list[list[Any]] = []
    parts: list[bytes | memoryview] = []
    offset = inline = 0
    for o in outcomes:
        if isinstance(o, Exception):
            entries.append(["error", type(o).__name__, str(o)])
            continue
        data, tag = (o.data, o.precision) if isinstance(o, Output) else (o, None)
        place = memory.output(data.dtype, data.shape, offset)
        if place is not None:
            np.copyto(place, data)
            entries.append(["out", descr(data.dtype), data.shape, offset, tag, False])
            offset += -(-data.nbytes // OUTPUT_ALIGN) * OUTPUT_ALIGN
        else:
            entries.append(["out", descr(data.dtype), data.shape, inline, tag, True])
            parts.append(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data)
            inline += data.nbytes
    answer.update({"outcomes": entries, "counts": _counts(engine)})
    return answer, parts


def _counts(engine: Engine) -> dict[str, int]:
    return {
        "forwards": engine.forwards,
        "overflows": engine.overflows,
        "fp32_reruns": engine.fp32_reruns,
        "real_elements": engine.real_elements,
        "padded_elements": engine.padded_elements,
    }


def _send(sock: socket.socket, header: dict[str, Any], payload: list[bytes | memoryview] | None = None) -> None:
    sock.sendall(b"".join(frame(header, *(payload or []))))
