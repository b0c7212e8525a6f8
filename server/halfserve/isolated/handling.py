"""A model's handler (its manifest's ``handler`` section, :mod:`halfserve.handlers`) run in its instance process: a
handler batch's raw payloads come in (far fewer bytes than the float rows a photo becomes), go through ``preprocess``,
the instance's forward and ``postprocess`` here, and one JSON answer per payload goes back.

Built once, when the process starts, under the trust rule the server process applies (the operator's
``--code-path``, which the process registers before anything else). Its calls run on threads of their own, each
bounded by the section's ``timeout_s``, as :mod:`halfserve.handlers` bounds them in the server process; what goes wrong
is answered with the same kinds as there (:mod:`halfserve.api.dataplane.handled`): ``preprocess`` raising an
:class:`~halfserve.errors.InvalidInputError`, wrong inputs or answers or ``postprocess`` raising an
:class:`~halfserve.errors.InternalError`, a call past its limit a :class:`~halfserve.errors.HandlerTimeLimitError`,
the forward failing a :class:`~halfserve.errors.BatchFailedError`. A handler that kills the process is the batch's
:class:`~halfserve.errors.InstanceLostError`, raised by the server process's side, whose supervisor restarts it.

Both ends of the ``handle`` op are here: the frame the server process sends (:func:`handle_frame`) and its payloads
read back as requests in the instance process (:func:`requests`), and the answers in the frame that comes back
(:func:`answers`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from halfserve import handlercheck, handlers
from halfserve.engine.core import Engine
from halfserve.errors import (
    BatchFailedError,
    HandlerTimeLimitError,
    InternalError,
    InvalidInputError,
    OverLimitError,
    QueueFullError,
)
from halfserve.handlerinput import HandlerStyle
from halfserve.instance import Instance
from halfserve.isolated.protocol import ChildConfig
from halfserve.serving import HandlerPayload, Outcome, Output

HandledOutcomes = tuple[list[bytes], list[Outcome]]
"""A handler batch's answers, one JSON body per payload, and its outputs' outcomes, one per forward."""


class InstanceHandler:
    """The model's handler as its instance process runs it, with the engine instance its batches go through."""

    def __init__(self, config: ChildConfig, engine: Engine, inst: Instance) -> None:
        section = config.manifest.handler
        assert section is not None, "built for a model with a handler section"
        settings = config.settings
        self.section, self.manifest = section, config.manifest
        self.engine, self.inst = engine, inst
        self.max_rows = config.max_batch_size
        try:
            self.handler = handlers.handler(
                settings.store,
                config.manifest.name,
                config.version,
                section,
                settings.code_path,
                self.max_rows,
                settings.max_image_pixels,
            )
        except handlers.HandlerLoadError as e:  # the server process built it: only a changed file gets here
            raise RuntimeError(str(e)) from None
        # As many as the server process's handler threads: calls stuck past their limit hold theirs, and once all are
        # held the next calls time out waiting rather than piling up threads.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            handlers.HANDLER_THREADS, thread_name_prefix="halfserve-handler"
        )

    def _call(self, stage: handlers.Stage, call: Callable[[], Any]) -> Any:
        began = threading.Event()

        def started() -> Any:
            began.set()
            return call()

        limit = self.section.timeout_s
        # A TorchServe handler keeps a batch's state on itself from preprocess to postprocess: a call past its time
        # limit still runs on it, so the next batch's calls wait for it rather than run beside it.
        exclusive = self.section.style is HandlerStyle.TORCHSERVE
        if exclusive and not handlers.wait_free(self.handler, limit):
            raise QueueFullError(f"{handlers.occupied(stage, self.manifest.name, limit)}; retry shortly")
        future = self._threads.submit(started)
        if exclusive:
            handlers.hold(self.handler, future)
        if not began.wait(limit) and future.cancel():  # the limit is the call's own, not its wait for a thread
            raise QueueFullError(
                f"model {self.manifest.name!r}: handler {stage.value}: no handler thread came free within {limit:g} s "
                "(calls past their time limit hold them); retry shortly"
            )
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # one still waiting for a thread never runs
            raise HandlerTimeLimitError(
                f"model {self.manifest.name!r}: handler {stage.value} ran past its time limit of "
                f"{self.section.timeout_s:g} s (handler.timeout_s)"
            ) from None
        except BaseException as e:  # a SystemExit from the team's code is the batch's failure too
            reason = handlers.one_line(e, f"handler {stage.value} failed: ")
            if handlers.too_large(e):
                raise OverLimitError(reason) from None
            raise (InvalidInputError if stage is handlers.Stage.PREPROCESS else InternalError)(reason) from None

    def _forward(self, x: np.ndarray) -> list[Output]:
        """``x``'s rows through the instance, at most a full batch per forward, after the overflow policy."""
        if not x.flags.writeable:  # torch takes only writable memory
            x = x.copy()
        outs: list[Output] = []
        for start in range(0, len(x), self.max_rows):
            part = x[start : start + self.max_rows]
            try:
                [outcome] = self.inst.executor.submit(self.engine.run_batch, [part], self.inst).result()
            except Exception as e:
                raise BatchFailedError(f"{type(e).__name__}: {e}") from None
            if isinstance(outcome, Exception):
                raise BatchFailedError(f"{type(outcome).__name__}: {outcome}")
            outs.append(outcome if isinstance(outcome, Output) else Output(outcome, self.engine.precision))
        return outs

    def run(self, requests: list[dict[str, Any]]) -> tuple[list[bytes], list[Output]]:
        """The requests' answers, one JSON body each, and the outputs of their rows (one per forward, in order);
        raises what fails the batch (see the module)."""
        value = self._call(handlers.Stage.PREPROCESS, functools.partial(self.handler.preprocess, requests))
        inputs = handlercheck.checked_inputs(value, self.manifest, len(requests))
        outs = self._forward(inputs[self.manifest.inputs[0].name])
        data = outs[0].data if len(outs) == 1 else np.concatenate([o.data for o in outs])
        call = functools.partial(self.handler.postprocess, data, requests)
        answers = handlercheck.answers(self._call(handlers.Stage.POSTPROCESS, call), len(requests))
        return answers, outs


def requests(head: dict[str, Any], payload: bytearray) -> list[dict[str, Any]]:
    """The ``handle`` frame's payloads as TorchServe-shaped requests: ``[field, content_type, size, text]`` each in
    the header, their bytes one after another in the frame's payload (a text's in UTF-8, given back as the text)."""
    out, offset = [], 0
    for field, content_type, size, text in head["payloads"]:
        data = bytes(payload[offset : offset + size])
        out.append(handlers.request(field, data.decode() if text else data, content_type))
        offset += size
    return out


def handle_frame(payloads: list[HandlerPayload]) -> tuple[dict[str, Any], list[bytes]]:
    """The ``handle`` frame's header and payload parts for a handler batch of ``payloads``: their fields and content
    types in the header, their bytes in the frame (read back by :func:`requests`)."""
    sent = [data.encode() if isinstance(data, str) else data for _, data, _ in payloads]
    described = [
        [field, content_type, len(raw), isinstance(data, str)]
        for (field, data, content_type), raw in zip(payloads, sent, strict=True)
    ]
    return {"op": "handle", "payloads": described}, sent


def answers(head: dict[str, Any], payload: bytearray) -> list[bytes]:
    """A handler batch's answers, one JSON body per payload, from the frame that answered it: one after another in its
    payload from the offset its header's ``answers`` names (past the outputs placed there)."""
    offset, sizes = head["answers"]
    out = []
    for size in sizes:
        out.append(bytes(payload[offset : offset + size]))
        offset += size
    return out
