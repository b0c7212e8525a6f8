"""A request answered through its model's own handler (the manifest's ``handler`` section, :mod:`halfserve.handlers`):
the request's payloads through ``preprocess`` to the model's inputs, the outputs through ``postprocess`` to one answer
per payload. Called per batch: concurrent requests to one model gather into one handler batch
(:mod:`halfserve.handlerbatch`, by the model's ``batching`` limits), whose payloads go to one ``preprocess`` in arrival
order, one submit to the model and one ``postprocess``; each request gets its own answers back. A batch of several
requests that fails in a way one request could cause is rerun one request per call, so only that request fails.
Where the model's instances are processes, a batch's three steps run in one of them instead, given the raw payloads
(:meth:`~halfserve.serving.ModelHandle.handle`, :mod:`halfserve.isolated.handling`), and answer alike; a handler that
kills its process is its batch's 500.

Everything the handler does wrong is that request's answer, one line, never the server's: ``preprocess`` raising is
the request's fault as far as the server can tell (400; 413 for an image over ``--max-image-pixels``); inputs of the
wrong names, shape or rows, an exception in ``postprocess``, or answers of the wrong number or not JSON-able are the
handler's (500); past the time limit a 504, and a full bound a 503 to retry.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from halfserve import handlercheck, handlers
from halfserve.api.dataplane.deadline import shortest
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.photos import image_count
from halfserve.api.dataplane.refusals import cut_off_by_shutdown
from halfserve.errors import (
    BatchFailedError,
    DeadlineExceededError,
    HandlerTimeLimitError,
    InstanceLostError,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    OverLimitError,
    QueueFullError,
)
from halfserve.handlerbatch import HandlerBatcher
from halfserve.handlerinput import HandlerSection, HandlerStyle
from halfserve.serving import AppState, Handled, HeldAnswer, ModelHandle, Prediction, Tensors
from halfserve.settings import Settings


@dataclass(frozen=True)
class Payload:
    """One part of a request as the handler is given it."""

    field: str
    """``body`` for a raw body, else the form field's name (``data`` or ``body``), as TorchServe keys them."""
    data: bytes | str
    """The bytes sent; a text where TorchServe hands its handlers one (a KServe V1 instance's ``data`` to a
    ``torchserve``-style handler)."""
    content_type: str

    def as_request(self) -> dict[str, Any]:
        """TorchServe's shape of one request: ``{"body": bytes}`` or ``{"data": bytes}``, with the content type."""
        return handlers.request(self.field, self.data, self.content_type)


def section(served: ModelHandle) -> HandlerSection | None:
    return served.manifest.handler


def payload_count(
    settings: Settings, served: ModelHandle, payloads: list[Payload], fields: list[str], whole: str = "form"
) -> None:
    """Refuse a request of no payload or an empty one (400) and one of more than a request may carry (413), before
    the handler runs: TorchServe's handlers read a payload as ``row.get("data") or row.get("body")``, which an empty
    one fails with a ``TypeError`` the client cannot act on. ``fields`` name the payloads, ``whole`` the field that
    holds several."""
    field = fields[0] if len(fields) == 1 else whole
    if not payloads:
        raise InvalidInputError(f"{field}: empty; send the body the model's handler reads")
    image_count(settings, served, len(payloads), field)
    for payload, name in zip(payloads, fields, strict=True):
        if not payload.data:
            raise InvalidInputError(f"{name}: empty; send the bytes the model's handler reads")


async def _call(
    served: ModelHandle, spec: HandlerSection, handler: Any, stage: handlers.Stage, payloads: list[Payload], *args: Any
) -> Any:
    """``handler``'s ``stage`` method called with ``args``, answered as the module says."""
    call = functools.partial(getattr(handler, stage.value), *args)
    weight = _bytes(payloads)  # held by a call past its limit until it returns
    # A TorchServe handler keeps a batch's state on itself from preprocess to postprocess: a call past its time limit
    # still runs on it, so the next batch's calls wait for it rather than run beside it.
    exclusive = handler if spec.style is HandlerStyle.TORCHSERVE else None
    try:
        return await handlers.run(stage, call, spec.timeout_s, served.name, weight, exclusive)
    except handlers.HandlerInputTooLargeError as e:
        raise OverLimitError(str(e)) from None
    except handlers.HandlerRaisedError as e:
        if stage is handlers.Stage.PREPROCESS:
            raise InvalidInputError(str(e)) from None
        raise InternalError(str(e)) from None
    except handlers.HandlerTimeoutError as e:
        raise HandlerTimeLimitError(f"model {served.name!r}: {e}") from None
    except handlers.HandlerBusyError as e:
        raise QueueFullError(f"{e}; retry shortly") from None


async def _handler(served: ModelHandle, settings: Settings, spec: HandlerSection) -> Any:
    """The model version's handler: the one its load built, else (a front-end process's first request) built now, held
    to the time limit of a load's build (:func:`halfserve.handlers.handler_in_time`)."""
    key = (settings.store, served.name, served.version, spec)
    try:
        return await handlers.handler_in_time(
            *key, settings.code_path, served.batching.max_batch_size, settings.max_image_pixels
        )
    except handlers.HandlerLoadError as e:  # this build failed or ran past the limit: as a load that failed on it, 503
        raise ModelNotReadyError(f"model {served.name!r}: {e}", retry=False) from None


async def preprocess(served: ModelHandle, settings: Settings, payloads: list[Payload]) -> Tensors:
    """The model's inputs, by its handler's ``preprocess`` of the TorchServe-shaped requests, checked."""
    spec = section(served)
    assert spec is not None, "called for a model with a handler section"
    handler = await _handler(served, settings, spec)
    requests = [p.as_request() for p in payloads]
    value = await _call(served, spec, handler, handlers.Stage.PREPROCESS, payloads, requests)
    return handlercheck.checked_inputs(value, served.manifest, len(payloads))


async def postprocess(
    served: ModelHandle, settings: Settings, outputs: dict[str, np.ndarray], payloads: list[Payload]
) -> list[bytes]:
    """One JSON answer per payload, by the handler's ``postprocess`` of the outputs (the first output's array for a
    model of one output, else all by name) and the same requests ``preprocess`` had."""
    spec = section(served)
    assert spec is not None, "called for a model with a handler section"
    handler = await _handler(served, settings, spec)  # the one preprocess had
    names = [t.name for t in served.manifest.outputs]
    given: object = outputs[names[0]] if len(names) == 1 else outputs
    requests = [p.as_request() for p in payloads]
    value = await _call(served, spec, handler, handlers.Stage.POSTPROCESS, payloads, given, requests)
    return handlercheck.answers(value, len(payloads))


@dataclass(eq=False)
class Job:
    """One HTTP request in a handler batch: its payloads, and the model and server it is answered by."""

    app: AppState
    served: ModelHandle
    settings: Settings
    payloads: list[Payload]
    sent: HeldAnswer[Handled] | None = None
    """Its batch as sent to an instance process last, which may hold it before a process takes it."""


class Answered(NamedTuple):
    """A request's answers, one JSON body per payload, and the outputs of its rows (what its telemetry records)."""

    answers: list[bytes]
    prediction: Prediction


async def _run_batch(jobs: list[Job], timeout: float | None) -> list[Answered]:
    """One batch of requests (of one model version) through one ``preprocess``, one submit and one ``postprocess``."""
    first = jobs[0]
    payloads = [p for job in jobs for p in job.payloads]
    handled = first.served.handle([(p.field, p.data, p.content_type) for p in payloads])
    if handled is not None:  # in the instance process that runs the forward
        for job in jobs:
            job.sent = handled
        answers, result = await _in_instance(first, handled, timeout)
    else:
        # Awaited here, not by infer: the handler's call is held to its own timeout_s, not to the decoding threads'
        # deadline (a batch's run is cut off by a drain as its wait for the model would be).
        try:
            inputs = await preprocess(first.served, first.settings, payloads)
        except asyncio.CancelledError:
            if not first.app.draining:
                raise
            raise cut_off_by_shutdown() from None
        result = await infer(first.app, first.served, inputs, timeout)
        answers = await postprocess(first.served, first.settings, result.outputs, payloads)
    out = []
    start = 0
    for job in jobs:
        stop = start + len(job.payloads)
        rows = {name: array[start:stop] for name, array in result.outputs.items()}
        out.append(Answered(answers[start:stop], Prediction(rows, result.precisions)))
        start = stop
    return out


async def _in_instance(job: Job, handled: Awaitable[Handled], timeout: float | None) -> Handled:
    """A handler batch run in its instance process, within ``timeout``; a handler that killed the process is the
    batch's 500 (its supervisor restarts it)."""
    try:
        return await asyncio.wait_for(handled, timeout)
    except TimeoutError:
        name = job.served.name
        raise DeadlineExceededError(f"model {name!r}: its handler batch ran past the request's time limit") from None
    except asyncio.CancelledError:
        if not job.app.draining:
            raise
        raise cut_off_by_shutdown() from None
    except InstanceLostError as e:
        raise InternalError(f"model {job.served.name!r}: handler batch: {e}") from None


def _alone(e: BaseException) -> bool:
    """Whether one request of a batch may have caused ``e``: the handler raised or returned what it should not (a
    400 or a 500 naming it; a 413 for an image over the pixel limit), ran past its own time limit (a few heavy photos
    batched with a light one: the light one then gets its answer from its own call), or the forward failed on the
    batch's rows. Not the requests' deadline, a full bound or a model that cannot serve: rerunning each request alone
    would only repeat those for each."""
    return isinstance(e, InvalidInputError | OverLimitError | InternalError | BatchFailedError | HandlerTimeLimitError)


def _held(job: Job) -> bool:
    """Whether ``job``'s batch waits for an instance process to take it (every one restarting): its deadline answers
    it as a queued request's does."""
    return job.sent is not None and not job.sent.done() and not job.sent.started()


def _size(job: Job) -> int:
    return len(job.payloads)


def _bytes(payloads: list[Payload]) -> int:
    return sum(len(p.data) for p in payloads)


def _weight(job: Job) -> int:
    return _bytes(job.payloads)


BATCHES_IN_FLIGHT = handlers.HANDLER_THREADS + 2
"""Handler batches of one model running at once: one per handler thread in ``preprocess`` or ``postprocess``, and two
more in the model meanwhile, so that neither the threads nor the model wait for the other. With one per thread (2 on
the 2-core host), a small photo model at c=16 answered fewer rows/s in each of three interleaved rounds than with
two more (benchmarks/handler_batch_bench.py's model)."""
_batchers: dict[tuple[object, ...], HandlerBatcher[Job, Answered]] = {}


def _batcher(served: ModelHandle, settings: Settings, spec: HandlerSection) -> HandlerBatcher[Job, Answered]:
    """The model version's handler batcher on this event loop (made on its first request), with its model's
    batching limits as they are now."""
    key = (settings.store, served.name, served.version, spec)
    loop = asyncio.get_running_loop()
    found = _batchers.get(key)
    if found is None or found.loop is not loop:
        found = _batchers[key] = HandlerBatcher(
            _run_batch,
            size=_size,
            weight=_weight,
            # Payloads a call past its limit still reads hold memory as queued ones do, until the call returns.
            also_held=functools.partial(handlers.stuck_bytes, served.name),
            held=_held,
            alone=_alone,
            max_batch_size=1,
            max_delay=0.0,
            max_queue_payloads=1,
            # A TorchServe handler keeps a batch's state on itself from preprocess to postprocess, as its one worker
            # ran one batch at a time: two batches in flight would give one batch's answers the other's state.
            concurrency=1 if spec.style is HandlerStyle.TORCHSERVE else BATCHES_IN_FLIGHT,
        )
    limits = served.batching
    found.max_batch_size = limits.max_batch_size
    found.max_delay = limits.max_delay_ms / 1000
    found.max_queue_payloads = limits.max_queue_rows
    found.max_queue_bytes = settings.handler_queue_bytes
    return found


async def answer(
    app: AppState, served: ModelHandle, settings: Settings, payloads: list[Payload], timeout: float | None
) -> Answered:
    """``payloads`` (one HTTP request's) answered through the model's handler, in a batch with the requests sent to
    it at the same time. ``timeout`` (the client's) and the model's ``request_timeout_ms``, the shorter, bound the
    wait in the handler queue and then for the model."""
    spec = section(served)
    assert spec is not None, "called for a model with a handler section"
    batcher = _batcher(served, settings, spec)
    limit = shortest(served, timeout)
    deadline = None if limit is None else batcher.clock.now() + limit
    try:
        return await batcher.submit(Job(app, served, settings, payloads), deadline)
    except asyncio.CancelledError:
        if not app.draining:
            raise
        raise cut_off_by_shutdown() from None
