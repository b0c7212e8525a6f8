"""The contract between the routes and the models: what a route may ask of a model, and what it gets back.

Routes (:mod:`halfserve.api`) talk to a :class:`ModelService` and its :class:`ModelHandle` objects and to nothing below
them. Two implementations answer: the local repository (:mod:`halfserve.repository`: engines and batchers in this
process) and, with ``--http-workers``, the front-ends' client of the engine process (:mod:`halfserve.multiproc.client`).
Neither inherits from the other; both are checked against these protocols.

Tensors cross as **named numpy arrays**: a request is a mapping of input name to an array with rows (samples) on the
first dimension, a :class:`Prediction` a mapping of output name to its rows. Today's models take one input and give
one output: the one-entry case.

Also here, below both sides: the readiness rule, the runner contract the batcher calls (implemented by the engine),
and the typed state an app holds. The domain errors a request fails with are the contract's own module beside it
(:mod:`halfserve.errors`). Neutral: no HTTP, no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from halfserve.errors import InvalidInputError, ModelNotFoundError, ModelNotReadyError, ModelUnavailableError

if TYPE_CHECKING:
    from halfserve.batchstats import BatchStats
    from halfserve.execution import Batching
    from halfserve.manifest import Manifest, Precision
    from halfserve.settings import Settings

Tensors = Mapping[str, np.ndarray]
"""Named tensors, rows first: a request's inputs by input name, or a prediction's outputs by output name."""


class ModelState(str, Enum):
    """Where a model is in its life."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    UNLOADED = "unloaded"


# Results -------------------------------------------------------------------------------------------------------------


class Prediction(NamedTuple):
    """A request's outputs by name, and the precisions that computed them: the served precision, ``fp32`` where an
    overflowing half-precision output was rerun, both for a request spanning batches of which only some were rerun."""

    outputs: dict[str, np.ndarray]
    precisions: tuple[Precision, ...]

    @property
    def precision(self) -> str:
        """The precisions as responses name them: ``fp16``, or ``fp16+fp32`` where only some batches were rerun."""
        return "+".join(p.value for p in self.precisions)

    @property
    def rows(self) -> int:
        """Rows (samples) answered."""
        return len(next(iter(self.outputs.values()))) if self.outputs else 0


# The runner contract: what the batcher calls, and the engine implements -----------------------------------------------
# Output is a NamedTuple rather than a frozen dataclass: one is built per chunk, and a tuple builds several times
# faster.


class Output(NamedTuple):
    """One chunk's output rows and the precision that computed them (None: the runner does not say)."""

    data: np.ndarray
    precision: Precision | None = None


class Handled(NamedTuple):
    """A batch of payloads answered through the model's handler where its instance runs it (an instance process):
    one JSON answer per payload, and the outputs of all its rows in payload order (what telemetry records)."""

    answers: list[bytes]
    prediction: Prediction


HandlerPayload = tuple[str, bytes | str, str]
"""One payload as a handler is given it: its field (``body`` or ``data``), its bytes (a text where TorchServe hands
its handlers one: a KServe V1 instance's ``data`` to a ``torchserve``-style handler) and its content type."""


Outcome = np.ndarray | Output | Exception
"""What a runner gives back per chunk: its output rows, or the error that fails that chunk's request alone."""

Runner = Callable[[list[np.ndarray]], Awaitable[Sequence[Outcome]]]
"""Runs one batch, given as the chunks (row slices of requests) it is made of; one outcome per chunk. A batch whose
answer is a plain awaitable started when the runner was called; one whose answer is a :class:`HeldAnswer` may not
have."""


A = TypeVar("A")


class HeldAnswer(asyncio.Future[A]):
    """The answer for a batch its engine may hold before an instance takes it (a runner's, or a handler batch's:
    :meth:`ModelHandle.handle`): instance processes (:mod:`halfserve.isolated`) hold a batch while every process is
    restarting, and until the process it was sent to takes it.

    Until :meth:`started`, the batch's requests are as good as queued: a deadline that passes meanwhile answers its
    request as one in the queue does (:mod:`halfserve.batching`, :mod:`halfserve.handlerbatch`), and that request's
    outputs are discarded; the batch's other requests go on."""

    __slots__ = ()

    def started(self) -> bool:
        """Whether an instance has taken the batch: from then on it runs to its end."""
        return True


# The service ---------------------------------------------------------------------------------------------------------


class ModelHandle(Protocol):
    """A model as a route sees it: its signature and state, and a way to run requests through it."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def batching(self) -> Batching: ...

    @property
    def state(self) -> ModelState: ...

    @property
    def error(self) -> str | None: ...

    @property
    def precision(self) -> Precision | None:
        """The precision it is served in, once loaded."""

    @property
    def precision_record(self) -> dict[str, Any] | None:
        """The version's precision record as its load checked it (:mod:`halfserve.precision_record`); None: the load
        held no half precision to a bar (fp32, or the check is off)."""

    @property
    def serving(self) -> bool:
        """Whether a request sent now is taken (the state may lag: the side that runs it decides)."""

    @property
    def available(self) -> bool:
        """Whether an instance can run a batch now: false while every instance process of a ready model is
        restarting (requests sent meanwhile wait for one, or are answered 503 with ``Retry-After``)."""

    def submit(self, inputs: Tensors, timeout: float | None = None) -> asyncio.Future[Prediction]:
        """Queue ``inputs`` for batching; the future's result is their prediction.

        ``timeout`` (seconds, the client's) and the model's ``request_timeout_ms``, whichever is shorter, bound how
        long the rows may wait to start: past it the future fails with
        :class:`~halfserve.errors.DeadlineExceededError`. Raises at once what refuses the request before queueing
        (:class:`~halfserve.errors.ModelNotReadyError`, :class:`~halfserve.errors.QueueFullError`, ...);
        cancelling the future withdraws the rows not yet running.
        """

    def handle(self, payloads: Sequence[HandlerPayload]) -> HeldAnswer[Handled] | None:
        """``payloads`` through the model's handler (its manifest's ``handler`` section), ``preprocess``, forward and
        ``postprocess`` as one batch in an instance process, started once a process took it; ``None`` where the
        handler runs in this process instead (instances are threads, or this is a front-end), on its handler threads.
        Cancelled before a process took it, the batch is withdrawn. Fails as those calls would (the errors of
        :mod:`halfserve.errors`): :class:`InvalidInputError` (``preprocess`` raised), :class:`InternalError` (the
        handler's inputs or answers are wrong, or ``postprocess`` raised), :class:`DeadlineExceededError` (a call ran
        past ``timeout_s``), :class:`BatchFailedError` (the forward failed) or :class:`InstanceLostError` (the handler
        killed its process)."""


class ModelService(Protocol):
    """The served models, as the routes reach them."""

    @property
    def models(self) -> Mapping[str, ModelHandle]: ...

    @property
    def ready(self) -> bool:
        """True when every model that is not unloaded is loaded and warmed up."""

    def get(self, name: str | None) -> ModelHandle:
        """The model called ``name`` (None: the only one, when exactly one is served); :class:`ModelNotFoundError`
        otherwise."""


class LocalModel(ModelHandle, Protocol):
    """A model as the process that runs it shows it: what the listing, statistics and management routes read."""

    def describe(self) -> dict[str, object]:
        """Its entry in ``GET /models``: signature, precision, execution, fidelity, state."""

    def stats(self) -> dict[str, object] | None:
        """Its batcher's and engine's counters (None while not loaded)."""

    @property
    def batch_stats(self) -> BatchStats | None:
        """What its batcher has done since it was loaded (None while it has none)."""


class Device(Protocol):
    """Where the models run, as the routes name it (``torch.device`` answers it)."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


class ModelAdmin(Protocol):
    """The models of the process that runs them, as the management and listing routes change and read them: the
    local repository (:class:`halfserve.repository.ModelRepository`). A front-end has none; it relays those routes."""

    @property
    def models(self) -> Mapping[str, LocalModel]: ...

    @property
    def device(self) -> Device: ...

    def get(self, name: str | None) -> LocalModel:
        """As :meth:`ModelService.get`."""

    def stored_models(self) -> list[str]:
        """The names of the models in the store, served or not; raises ``StoreError`` when there is no store."""

    def stored_versions(self, name: str) -> list[int] | None:
        """The versions of ``name`` in the store, ascending; ``None`` when the store has no such model. Raises
        ``StoreError`` for an invalid name."""

    async def load(self, name: str, version: int | None = None, precision: Precision | None = None) -> LocalModel:
        """Load (or reload) ``name`` from the store, warmed up before it serves; raises ``StoreError`` (a
        ``ValueError``) for a model, version or checkpoint the store cannot give."""

    async def unload(self, name: str) -> None:
        """Stop serving ``name``, letting its requests in flight finish."""

    async def set_precision(self, name: str, precision: Precision) -> LocalModel:
        """Serve ``name`` in ``precision`` from now on (a new engine, warmed up, then swapped in)."""


class SharedRegion(Protocol):
    """A registered shared memory region, as the routes read and write it (:class:`halfserve.regions.Region`)."""

    @property
    def name(self) -> str: ...

    @property
    def byte_size(self) -> int: ...

    def status(self) -> dict[str, Any]: ...

    def check(self, offset: int, size: int, field: str) -> None: ...

    def read(self, offset: int, size: int, field: str) -> bytearray: ...

    def write(self, offset: int, data: memoryview, field: str) -> None: ...


class SharedRegions(Protocol):
    """The registered shared memory regions (:class:`halfserve.regions.Regions`, or a front-end's mirror of them)."""

    @property
    def regions(self) -> Mapping[str, SharedRegion]: ...

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None: ...

    def unregister(self, name: str | None) -> None: ...

    def status(self) -> list[dict[str, Any]]: ...

    def get(self, name: object, field: str) -> SharedRegion: ...


M = TypeVar("M")


UNKNOWN_MODEL = "Request for unknown model: "
"""How Triton's answers about a model it cannot serve begin (unknown, no such version, not ready): clients test for it
(Triton's example clients check that an unknown model's error starts with it)."""


SHOWN_NAME = 200
"""Characters of a name or version a client sent that an answer repeats: the rest is cut (a 10 KB name was echoed)."""


def shown(name: str) -> str:
    """A name or version from a request as an answer quotes it: its ``repr``, cut past :data:`SHOWN_NAME`."""
    return repr(name) if len(name) <= SHOWN_NAME else f"{name[:SHOWN_NAME]!r}... ({len(name)} characters)"


class NoModels:
    """The service of an app whose models are not discovered yet: none is known, so none is ready."""

    models: Mapping[str, ModelHandle] = {}
    ready = False

    def get(self, name: str | None) -> ModelHandle:
        what = "None" if name is None else shown(name)
        raise ModelNotFoundError(f"{UNKNOWN_MODEL}{what} is not found (no model is served yet: the server starts)")


def find(models: Mapping[str, M], name: str | None) -> M:
    """The model called ``name`` in ``models``; ``None`` means the only model when there is exactly one."""
    if name is None:
        if len(models) == 1:
            return next(iter(models.values()))
        if models:  # the request's fault, not a model missing: a 400 naming the field to add
            raise InvalidInputError(f'model: several models are served ({", ".join(models)}); name one with "model"')
        raise ModelNotFoundError(f"{UNKNOWN_MODEL}none is served to take a request without a model's name")
    try:
        return models[name]
    except KeyError:
        raise ModelNotFoundError(f"{UNKNOWN_MODEL}{shown(name)} is not found (served: {', '.join(models)})") from None


def why_model_not_ready(model: ModelHandle) -> str | None:
    """Why ``model`` is not ready (its state, or no instance able to serve), as readiness probes report it; None when
    it is ready."""
    if model.state is not ModelState.READY:
        return str(model.state.value)
    if not model.available:
        return "no instance able to serve: restarting"
    return None


def not_serving(model: ModelHandle) -> ModelNotReadyError:
    """The refusal of a request to ``model`` while it takes none (loading, unloaded, failed; released while ready: the
    server draining), in the words its queue answers with."""
    state = "draining" if model.state is ModelState.READY else model.state.value
    return ModelNotReadyError(f"model {model.name!r} is {state}" + (f": {model.error}" if model.error else ""))


def check_ready(model: ModelHandle, version: str | None) -> None:
    """The readiness rule: return when ``model`` takes requests now, else raise why not, in Triton's words.

    A model still loading (or draining) is :class:`ModelNotReadyError` (retry). An unloaded or failed model answers
    as Triton does: :class:`ModelUnavailableError` ("no available versions") when the request names no version, and
    :class:`ModelNotReadyError` without retry when it names the served version, which exists but is not ready.
    """
    if model.serving:
        return
    unavailable = f"{UNKNOWN_MODEL}{model.name!r} " + (
        "has no available versions" if version is None else f"version {version} is not at ready state"
    )
    if model.state is ModelState.LOADING:
        raise ModelNotReadyError(f"{unavailable} (it is loading)")
    if model.state is ModelState.READY:  # released under the request: the server is draining
        raise ModelNotReadyError(f"{unavailable} (it is draining)")
    reason = model.error if model.state is ModelState.FAILED else model.state.value
    if version is None:
        raise ModelUnavailableError(f"{unavailable} ({reason})")
    raise ModelNotReadyError(f"{unavailable} ({reason})", retry=False)


class Interface(str, Enum):
    """The interface an inference request came through."""

    PREDICT = "predict"
    """``POST /predict``, the simple JSON interface."""
    V2 = "v2"
    """``POST /v2/models/{m}/infer``, the KServe V2 protocol (JSON or binary tensors)."""
    GRPC = "grpc"
    """``inference.GRPCInferenceService/ModelInfer`` (and its stream), the KServe V2 protocol over gRPC."""
    TORCHSERVE = "torchserve"
    """``POST /predictions/{model}``, TorchServe's inference API (an image in the body, or images in a form)."""
    KSERVE_V1 = "v1"
    """``POST /v1/models/{model}:predict``, KServe's V1 data plane (TensorFlow Serving's REST API)."""


class RequestRecorder(Protocol):
    """Counts answered requests (:class:`halfserve.metrics.Metrics` in the engine process; a front-end forwards
    them)."""

    def request(
        self, model: str, precision: str, interface: Interface, status: int, rows: int, seconds: float
    ) -> None: ...


@dataclass
class AppState:
    """What an app's routes read: one typed object, filled once, by the app that serves them."""

    settings: Settings
    service: ModelService
    regions: SharedRegions
    """The registered shared memory regions (a front-end's mirror of the engine process's)."""
    metrics: RequestRecorder | None = None
    repository: ModelAdmin | None = None
    """The local repository, for the management and listing routes: only in the process that owns the models
    (a front-end relays those routes to it)."""
    draining: bool = False
    drain_started: float | None = None
    pending: list[Callable[[], str | None]] = field(default_factory=list)
    """Checks readiness also waits on (e.g. front-ends not yet connected): each names what is missing, or None."""
    route_state: dict[type, object] = field(default_factory=dict)
    """What the routes keep per app, by its type (the admin token's lockout, :mod:`halfserve.api.lockout`): theirs to
    define, not the contract's."""
    published: Callable[[], Awaitable[None]] | None = None
    """Returns once every process that decodes requests has the models and regions as they are now (the engine
    process's front-ends); None where this process decodes them all."""

    async def publish(self) -> None:
        """Wait until a change this process made (a model loaded, a region registered) is known to every process
        that decodes requests, so that the client's next request finds it wherever it lands."""
        if self.published is not None:
            await self.published()
