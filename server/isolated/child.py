"""An instance process's main: load the model, warm up one engine instance, then run the batches it is sent.

Started by :class:`~server.isolated.engine.ProcessEngine` with multiprocessing's ``spawn`` (a fresh interpreter, as
CUDA needs), its socket end and a :class:`~server.isolated.wire.ChildConfig`; its shared memory arrives over the
socket (``SCM_RIGHTS``). It reads the checkpoint itself, through the same safe loader as the server process, and
exits when the socket closes: the server process gone is never left with orphans holding the device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import time
from typing import Any

import numpy as np

from server import logs, models, store
from server import precision as prec
from server.engine import Engine, resolve_device, set_intra_op_threads, tune_cudnn
from server.instance import Instance, pin_host
from server.isolated.wire import ChildConfig, Memory, descr, dtype_of
from server.multiproc.wire import FrameReader, frame
from server.precision import Precision
from server.serving import Output

log = logging.getLogger(__name__)

OUTPUT_ALIGN = 64
"""Each output array starts at a multiple of this many bytes in the output region."""


def run(config: ChildConfig, sock: socket.socket) -> None:
    """The process's main (multiprocessing's target)."""
    settings = config.settings
    logs.configure(settings.log_format, settings.log_level)
    # The server process decides when instances stop: Ctrl-C reaches the whole process group, and a container's
    # SIGTERM the server process, which drains its batchers and then tells each instance to exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    if not fds:
        return
    memory = Memory(fds[0], config.input_bytes, config.output_bytes)
    try:
        engine, warmup_seconds = _start(config, memory)
    except Exception as e:  # reported to the server process, which fails the load with it
        log.exception("instance %d of %s failed to start", config.index, config.model)
        _send(sock, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        return
    info = dataclasses.asdict(engine.info)
    info["precision"] = engine.precision.value
    _send(sock, {"op": "ready", "info": info, "warmup_seconds": warmup_seconds, "pid": os.getpid()})
    _serve(engine, engine.instances[0], memory, sock)


def _start(config: ChildConfig, memory: Memory) -> tuple[Engine, float]:
    """The process-wide settings the server process applies, then the engine, its memory pinned, warmed up."""
    settings = config.settings
    set_intra_op_threads(config.cores)
    models.add_code_path(settings.code_path)
    prec.set_tf32(settings.tf32)
    device = resolve_device(settings.device)
    tune_cudnn(device, config.fixed_shapes)
    loaded = store.load(settings.store, config.model, config.version)
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
            engine.settle_threads(config.max_batch_size, config.cores)
    return engine, time.perf_counter() - start


def _serve(engine: Engine, inst: Instance, memory: Memory, sock: socket.socket) -> None:
    """Run each batch sent until told to exit or the socket closes; one at a time, on the instance's own thread
    (cuDNN keeps its tuned algorithms per thread, and the warm-up ran there)."""
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return
        for head, payload in reader.feed(data):
            if head.get("op") == "exit":
                return
            _send(sock, *_batch(engine, inst, memory, head, payload))


def _batch(
    engine: Engine, inst: Instance, memory: Memory, head: dict[str, Any], payload: bytearray
) -> tuple[dict[str, Any], list[bytes | memoryview]]:
    """Run one batch; the answer's header and payload."""
    dtype, shape, rows = dtype_of(head["dtype"]), tuple(head["shape"]), head["rows"]
    total = sum(rows)
    if head.get("inline"):
        batch = np.frombuffer(payload, dtype, total * math.prod(shape)).reshape(total, *shape)
    else:
        view = memory.inputs(dtype, total, shape)
        if view is None:
            raise ValueError(f"a batch of {total} rows does not fit the input region")
        batch = view
    bounds = np.cumsum([0, *rows]).tolist()
    chunks = [batch[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    answer: dict[str, Any] = {"id": head["id"]}
    try:
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
