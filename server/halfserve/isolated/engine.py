"""The server process's side of instance processes: :class:`ProcessEngine`, the engine the batcher runs batches on
when each instance is a process of its own, and the dispatch of batches (and handler batches) to idle ones. Each
process's wire end is :mod:`halfserve.isolated.wire`'s :class:`~halfserve.isolated.wire.InstanceProcess`; starting,
watching and restarting the processes is their supervisor's (:mod:`halfserve.isolated.supervision`).

Everything here runs on the event loop's thread and makes no torch call per batch: a batch costs one copy of its
rows into an idle instance's shared memory (numpy lets go of the GIL for it), one small frame out and one back, and one
copy of the output rows out of the shared memory (each chunk's outputs are views of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import multiprocessing.process
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from halfserve import models, store
from halfserve import precision as prec
from halfserve.compilecache import CacheOutcome
from halfserve.engine.protocol import EngineError, EngineInfo
from halfserve.errors import InstanceLostError, ModelNotReadyError
from halfserve.ipc import exports
from halfserve.ipc.memory import InstanceMemory
from halfserve.isolated import child, handover
from halfserve.isolated.handling import HandledOutcomes
from halfserve.isolated.protocol import ChildConfig, region_sizes
from halfserve.isolated.supervision import Supervisor
from halfserve.isolated.wire import InstanceProcess
from halfserve.manifest import OverflowPolicy, Precision
from halfserve.placement import Placement, available_cores
from halfserve.serving import HandlerPayload, HeldAnswer, Outcome, Output
from halfserve.settings import Settings
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)


def _weights_memfd(loaded: LoadedModel) -> int:
    """A memfd holding ``loaded``'s weights as safetensors bytes (:func:`halfserve.store.weights_bytes`)."""
    fd = os.memfd_create(f"halfserve-{loaded.manifest.name}-weights")
    data = store.weights_bytes(loaded.module)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return fd


_Send = Callable[[InstanceProcess, asyncio.Future[Any]], int]
"""An op for an instance process, sent once one is idle: a batch to run, or a handler batch; returns the op's id."""


def _run(instance: InstanceProcess, future: asyncio.Future[list[Outcome]], chunks: list[np.ndarray], raw: bool) -> int:
    return instance.send(chunks, future, raw)


def _handle(instance: InstanceProcess, future: asyncio.Future[HandledOutcomes], payloads: list[HandlerPayload]) -> int:
    return instance.handle(payloads, future)


A = TypeVar("A")


class _Answer(HeldAnswer[A]):
    """A batch's answer from an instance process (its outcomes, or a handler batch's answers): started once the
    process it was sent to took it (noted its op's id in shared memory); held, not started, while it waits for a
    process idle or restarting."""

    __slots__ = ("_instance", "_op")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self._instance: InstanceProcess | None = None
        self._op = 0

    def sent(self, instance: InstanceProcess | None, op: int = 0) -> None:
        """Sent to ``instance`` as op ``op``; ``None``: held for the next process idle."""
        self._instance, self._op = instance, op

    def started(self) -> bool:
        return self._instance is not None and self._instance.took(self._op)


class ProcessEngine:
    """A model's engine whose instances are processes of their own (:mod:`halfserve.isolated`).

    A :class:`~halfserve.engine.protocol.ModelEngine`, as the in-process :class:`~halfserve.engine.core.Engine` is:
    :meth:`run` (the runner contract), :meth:`compute`, :meth:`batches`, :attr:`info`, the counters and :meth:`close`.
    Start one with :meth:`start`. A process that dies fails the batch it was running (the batcher isolates the fault as
    for any failed batch) and is restarted by its :attr:`supervisor`; the others go on serving. A batch sent to it
    after it died, before its end was seen, had not started: it runs on the next process idle. Nor has a batch held
    for a process (every one restarting) or sent to one that has not taken it yet: its answer says so
    (:class:`~halfserve.serving.HeldAnswer`), and a request's deadline that passes meanwhile answers it as queued.
    """

    def __init__(
        self,
        settings: Settings,
        loaded: LoadedModel,
        precision: Precision,
        device: torch.device,
        max_batch_size: int,
        fixed_shapes: bool,
        fp32_modules: tuple[str, ...] = (),
    ) -> None:
        manifest = loaded.manifest
        self.name = manifest.name
        self.device = device
        self.precision = prec.resolve(precision, device)
        self.fp32_modules = fp32_modules if prec.weight_dtype(self.precision) != torch.float32 else ()
        """A mixed-precision plan's modules, kept in fp32 by every instance process (:mod:`halfserve.mixed`)."""
        self.overflow = OverflowPolicy(manifest.overflow)
        self.placement = Placement.INSTANCE_PROCESSES
        self.real_elements = 0
        self.padded_elements = 0
        self.copied_bytes = 0
        """Input bytes copied into instance processes' memory (or frames) so far: rows not in shared memory."""
        self.in_place_bytes = 0
        """Input bytes instance processes read where they lay, in a front-end's shared memory, so far."""
        self._settings = settings.model_copy(update={"admin_token": None, "admin_token_file": None})
        self.batch_timeout = settings.instance_batch_timeout
        self._manifest, self._version = manifest, loaded.version
        self.handler = manifest.handler
        """The model's handler section, which its handler batches run (:mod:`halfserve.isolated.handling`)."""
        self._registers = models.registered_in(manifest.architecture)
        # What the processes build from besides the weights, as loaded: a restart builds what the others serve.
        self._code = handover.operator_code(manifest.architecture, self._registers, settings.code_path)
        self._hf_config = handover.hugging_face_config(loaded.module)
        self._max_batch_size, self._fixed_shapes = max_batch_size, fixed_shapes
        self._weights: int | None = None
        """A memfd of the host weights as safetensors bytes (:meth:`start` writes it), read by every process started,
        restarts included: they serve what this process loaded, whatever the store holds by then."""
        self._regions = region_sizes(manifest, max_batch_size)
        count = manifest.execution.instances
        # Every core, as each instance thread settles over: on 2 cores two ResNet-20 processes of one thread each
        # answered 437 requests/s against 792 for threads; with two threads each, 630 against 645.
        cores = settings.threads or available_cores()
        self._cores = cores
        self.supervisor: Supervisor[InstanceProcess] = Supervisor(
            self.name, self._spawn, self.idle_again, self._none_left, settings.instance_start_timeout
        )
        self._idle: list[InstanceProcess] = []
        self._waiting: deque[tuple[_Send, asyncio.Future[Any]]] = deque()
        self._in_hand: dict[InstanceProcess, tuple[_Send, asyncio.Future[Any]]] = {}
        """The op each instance process was sent and has not answered (one at a time), to send again should the
        process turn out to have died before it took it."""
        self._info: EngineInfo | None = None
        self._loop = asyncio.get_running_loop()
        self._context = multiprocessing.get_context("spawn")
        self._count = count
        self._stop_listening = exports.on_withdraw(self._forget)

    @classmethod
    async def start(
        cls,
        settings: Settings,
        loaded: LoadedModel,
        precision: Precision,
        device: torch.device,
        max_batch_size: int,
        fixed_shapes: bool,
        fp32_modules: tuple[str, ...] = (),
    ) -> ProcessEngine:
        """Spawn the model's instance processes, handing them ``loaded``'s host weights, and wait until every one is
        warm; raises :class:`~halfserve.engine.protocol.EngineError` (with the process's own error) when one fails to
        start."""
        engine = cls(settings, loaded, precision, device, max_batch_size, fixed_shapes, fp32_modules)
        try:
            engine._weights = await asyncio.to_thread(_weights_memfd, loaded)
            readies = await engine.supervisor.start(engine._count)
        except BaseException:
            await asyncio.to_thread(engine.close)
            raise
        engine._set_info(readies)
        engine._idle = list(reversed(engine.instances))
        return engine

    def _spawn(self, index: int) -> InstanceProcess:
        """Start instance process ``index``: its shared memory, its socket, the process; ready once it says so."""
        memory, fd = InstanceMemory.create(f"halfserve-{self.name}-{index}", *self._regions)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        side, their_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            return self._start_process(index, memory, fd, (ours, theirs), (side, their_side))
        except BaseException:
            for s in (ours, theirs, side, their_side):
                s.close()
            with contextlib.suppress(OSError):  # closed already once the process was started
                os.close(fd)
            memory.close()
            raise

    def _start_process(
        self,
        index: int,
        memory: InstanceMemory,
        fd: int,
        main: tuple[socket.socket, socket.socket],
        side_channel: tuple[socket.socket, socket.socket],
    ) -> InstanceProcess:
        (ours, theirs), (side, their_side) = main, side_channel
        config = ChildConfig(
            settings=self._settings,
            manifest=self._manifest,
            version=self._version,
            registers=self._registers,
            precision=self.precision.value,
            max_batch_size=self._max_batch_size,
            index=index,
            cores=self._cores,
            fixed_shapes=self._fixed_shapes,
            input_bytes=self._regions[0],
            output_bytes=self._regions[1],
            code=self._code,
            fp32_modules=self.fp32_modules,
            hf_config=self._hf_config,
        )
        instance = InstanceProcess(self, index, memory)
        process = self._context.Process(
            target=child.run, args=(config, theirs, their_side), name=f"halfserve-{self.name}-{index}", daemon=False
        )
        try:
            process.start()
            assert self._weights is not None
            socket.send_fds(ours, [b"m"], [fd, self._weights])
        finally:
            theirs.close()
            their_side.close()
            os.close(fd)
        instance.started(process, side)
        self._loop.create_task(self._loop.connect_accepted_socket(lambda: instance, ours))
        return instance

    def _set_info(self, readies: list[dict[str, Any]]) -> None:
        info = readies[0]["info"]
        fields = {f.name for f in dataclasses.fields(EngineInfo)}
        values = {k: v for k, v in info.items() if k in fields}
        values.update(
            precision=Precision(info["precision"]),
            compile_cache=CacheOutcome(info["compile_cache"]),
            buckets=tuple(info["buckets"]),
            instances=len(readies),
            graph_capture_seconds=sum(r["info"]["graph_capture_seconds"] for r in readies),
            placement=Placement.INSTANCE_PROCESSES,
        )
        self._info = EngineInfo(**values)
        self.precision = self._info.precision
        self.warmup_seconds = max(r["warmup_seconds"] for r in readies)

    @property
    def instances(self) -> list[InstanceProcess]:
        return self.supervisor.instances

    @property
    def restarts(self) -> int:
        """Instance processes restarted after dying while serving."""
        return self.supervisor.restarts

    @property
    def start_failures(self) -> int:
        """Restarted instance processes that died before they were ready."""
        return self.supervisor.start_failures

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None
        return self._info

    @property
    def forwards(self) -> int:
        return sum(i.forwards for i in self.instances)

    @property
    def overflows(self) -> int:
        return sum(i.counts.get("overflows", 0) for i in self.instances)

    @property
    def fp32_reruns(self) -> int:
        return sum(i.counts.get("fp32_reruns", 0) for i in self.instances)

    @property
    def available(self) -> bool:
        """Whether an instance process is up to take a batch (false while every one is restarting)."""
        return self.supervisor.any_alive()

    def batches(self, max_batch_size: int) -> tuple[int, int]:
        """The most rows in one batch, and how many batches may be in flight: one per instance process."""
        return max_batch_size, len(self.instances)

    def run(self, chunks: list[np.ndarray]) -> HeldAnswer[list[Outcome]]:
        """Send a batch to an idle instance process: the future of its outcomes (the runner contract), a
        :class:`~halfserve.serving.HeldAnswer` started once a process took the batch."""
        future: _Answer[list[Outcome]] = _Answer(self._loop)
        self._dispatch(functools.partial(_run, chunks=chunks, raw=False), future)
        return future

    def handle(self, payloads: list[HandlerPayload]) -> HeldAnswer[HandledOutcomes]:
        """Send a handler batch to an idle instance process: the future of each payload's JSON answer and the outputs
        of its rows (:mod:`halfserve.isolated.handling`), started once a process took the batch."""
        future: _Answer[HandledOutcomes] = _Answer(self._loop)
        self._dispatch(functools.partial(_handle, payloads=payloads), future)
        return future

    def compute(self, x: np.ndarray) -> np.ndarray:
        """The model's outputs for ``x`` as one batch, without the overflow policy (the fidelity check's forward);
        blocks, so call it off the event loop."""

        async def compute() -> np.ndarray:
            future: asyncio.Future[list[Outcome]] = self._loop.create_future()
            self._dispatch(functools.partial(_run, chunks=[x], raw=True), future)
            out = (await future)[0]
            assert isinstance(out, Output)
            return out.data

        return asyncio.run_coroutine_threadsafe(compute(), self._loop).result()

    def _dispatch(self, send: _Send, future: asyncio.Future[Any], again: bool = False) -> None:
        """``send`` the op to an idle instance process, or keep it for the next one to be idle (``again``: first, as
        an op sent before and never run)."""
        while self._idle:
            instance = self._idle.pop()
            if instance.alive and not instance.busy:
                self._give(instance, send, future)
                self._update_elements()
                return
        if self.supervisor.starting or self.supervisor.any_alive():
            # Fewer processes up than batches in flight: one is restarting, and takes this batch once it is warm (a
            # batch that crashed one is rerun a request at a time, so its other requests are answered).
            if again:
                self._waiting.appendleft((send, future))
            else:
                self._waiting.append((send, future))
            if isinstance(future, _Answer):
                future.sent(None)  # not started: a deadline that passes meanwhile answers its request as queued
            return
        left = self.supervisor.backoff_left()
        if left is None:
            future.set_exception(self._none_up("none is restarting"))
            return
        # Every process waits out its back-off after failed starts: a batch would wait up to 30 s, past most clients'
        # patience, so it is refused now, to be sent again once the next start may have succeeded.
        why = f"{self.supervisor.last_failure}; the next start in {left:.1f} s"
        future.set_exception(self._none_up(why, math.ceil(left)))

    def _none_up(self, why: str, retry_after: int = 1) -> ModelNotReadyError:
        """The error for a batch no instance process can take: the model is not ready for now (503, retry in
        ``retry_after`` seconds)."""
        return ModelNotReadyError(
            f"model {self.name!r} has no instance process able to serve ({why})", retry_after=max(1, retry_after)
        )

    def _give(self, instance: InstanceProcess, send: _Send, future: asyncio.Future[Any]) -> None:
        op = send(instance, future)
        self._in_hand[instance] = (send, future)
        if isinstance(future, _Answer):
            future.sent(instance, op)

    def idle_again(self, instance: InstanceProcess) -> None:
        """An instance answered its batch: give it the next waiting one, or mark it idle."""
        self._in_hand.pop(instance, None)
        self._update_elements()
        while self._waiting:
            send, future = self._waiting.popleft()
            if not future.done():
                self._give(instance, send, future)
                return
        if instance not in self._idle:
            self._idle.append(instance)

    def _forget(self, region: int) -> None:
        """A region was withdrawn: every process that was handed it unmaps it (on the loop's thread, which owns their
        sockets)."""
        self.supervisor.on_loop(self._forget_here, region)

    def _forget_here(self, region: int) -> None:
        for instance in self.instances:
            instance.forget(region)

    def _fail_waiting(self, error: Exception) -> None:
        while self._waiting:
            _, future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def _update_elements(self) -> None:
        self.real_elements = sum(i.counts.get("real_elements", 0) for i in self.instances)
        self.padded_elements = sum(i.counts.get("padded_elements", 0) for i in self.instances)

    def _none_left(self, why: str, retry_after: int) -> None:
        self._fail_waiting(self._none_up(why, retry_after))

    def lost(self, instance: InstanceProcess, was_ready: bool, unrun: list[asyncio.Future[Any]]) -> None:
        """An instance process's socket closed: it takes no more batches; its supervisor restarts it. Its op in hand,
        if it never took it (``unrun``: it died before, as one the OOM killer ends), goes to the next process idle,
        the restarted one at the latest, as any op waiting does."""
        if instance in self._idle:
            self._idle.remove(instance)
        held = self._in_hand.pop(instance, None)
        self.supervisor.lost(instance, was_ready)  # restarting it from now: the op sent again waits for it
        for future in unrun:
            if held is not None and held[1] is future:
                self._dispatch(held[0], future, again=True)
            else:  # not an op this engine holds (it sends one at a time): answered as one the process died running
                future.set_exception(InstanceLostError(f"instance process {instance.index} of {self.name!r} exited"))

    def close(self) -> None:
        """Fail the batches waiting for an instance, and end the instance processes
        (:meth:`~halfserve.isolated.supervision.Supervisor.close`: call it off the event loop)."""
        self.supervisor.closing = True  # no restarts from now on
        self._stop_listening()
        self.supervisor.on_loop(
            self._fail_waiting, EngineError(f"model {self.name!r}: its instance processes were stopped")
        )
        self.supervisor.close()
        if self._weights is not None:
            os.close(self._weights)
            self._weights = None
