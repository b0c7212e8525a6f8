"""The values the data plane passes along: an inference request as a transport reads it (:class:`InferRequest`, no
transport's wire format), the decoded request the batcher takes (:class:`Inference`), how one output goes back, and the
plan a request's JSON header makes (what :mod:`.plan` keeps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from halfserve.api.dataplane.spans import Span
from halfserve.errors import InvalidInputError
from halfserve.manifest import DataType, Manifest, TensorSpec
from halfserve.serving import ModelHandle
from halfserve.settings import Settings


@dataclass(slots=True)
class JsonValues:
    """A tensor's values as JSON gave them (flat or nested), not yet checked."""

    values: object


@dataclass(slots=True)
class BinaryData:
    """A tensor's bytes, exactly its own: its slice of the binary data after an HTTP request's JSON header, or its
    ``raw_input_contents`` entry (or typed ``contents``, as bytes) of a gRPC request."""

    view: memoryview
    source: str = ""
    """The request field that holds the bytes, as a refusal names it (gRPC's ``raw_input_contents[k]``); empty: the
    input's ``parameters.binary_data_size`` (HTTP's binary data)."""


@dataclass(slots=True)
class SharedMemory:
    """A tensor in a registered shared memory region, named by its input's ``shared_memory_*`` parameters (checked
    and read when the request is decoded)."""


SHARED_MEMORY = SharedMemory()
"""The one :class:`SharedMemory`: it holds nothing of its own."""


@dataclass(slots=True)
class Texts:
    """A ``BYTES`` tensor's elements, one per value (gRPC's ``bytes_contents``)."""

    items: list[bytes]


InputData = JsonValues | BinaryData | SharedMemory | Texts
"""Where an input's tensor is."""


@dataclass(slots=True)
class RequestInput:
    """One input of an :class:`InferRequest`, as the client declared it; nothing here is checked against the model."""

    name: str
    datatype: object
    """A datatype's name as the client sent it (:func:`~halfserve.api.dataplane.codec.wire_type` checks it)."""
    shape: object
    """The shape as the client sent it (checked against the model's signature when decoded)."""
    parameters: dict[str, Any]
    data: InputData


@dataclass(slots=True)
class RequestOutput:
    """One output an :class:`InferRequest` asks for, and its parameters (``binary_data``, ``classification``,
    ``shared_memory_*``)."""

    name: str
    parameters: dict[str, Any]


@dataclass(slots=True)
class InferRequest:
    """A V2 inference request as a transport reads it from its wire (HTTP's JSON header and binary data, gRPC's
    ``ModelInferRequest``), before it is checked against the model (:func:`~halfserve.api.dataplane.decode.decode`)."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None
    """The outputs asked for; None: none named (every output, as the request's parameters say)."""


@dataclass
class Inference:
    """A decoded inference request, ready for the batcher."""

    inputs: dict[str, np.ndarray]
    request_id: str | None
    binary_output: bool
    timeout_us: int = 0
    """The request's own ``parameters.timeout`` in microseconds; 0: none."""
    classes: int = 0
    """The top classes to return per row instead of the output (the classification extension); 0: the output."""
    output_span: Span | None = None
    """Where in shared memory the output goes (the shared memory extension); None: in the body."""
    outputs: dict[str, OutputRequest] | None = None
    """For a model with several outputs, the ones to return and how (None: the only output, as above)."""
    plan: RequestPlan | None = None
    """What its JSON header decided, when the header is one the route keeps (:class:`RequestPlan`)."""
    texts: tuple[Sequence[bytes | str], str] | None = None
    """A text model's texts and their field, checked but not yet tokenized: :func:`tokenize` does that off the event
    loop and adds the token ids to ``inputs``."""
    photos: tuple[list[bytes], list[str]] | None = None
    """An image model's encoded photos and each one's field, checked against the limits but not yet decoded:
    :func:`tokenize` decodes them off the event loop into the input they feed."""
    left: float | None = None
    """Seconds left of its deadline (the client's as it was on arrival, its own and the model's, the shortest) once its
    texts or photos were tokenized or decoded (:func:`tokenize`); None: none were, or it has no deadline."""

    def timeout(self, client: float | None) -> float | None:
        """Seconds the request may wait in the queue: the shorter of ``client`` (the transport's: a header, a gRPC
        deadline, as they were when the request arrived) and ``parameters.timeout``; once its texts or photos were
        decoded, what was left then (:attr:`left`, the model's limit in it); None for neither."""
        if self.left is not None:
            return self.left
        own = self.timeout_us / 1e6 if self.timeout_us else None
        limits = [t for t in (client, own) if t is not None]
        return min(limits) if limits else None

    @property
    def x(self) -> np.ndarray:
        """The first input's rows (a model with one input: its only one)."""
        return next(iter(self.inputs.values()))


@dataclass
class OutputRequest:
    """How one output goes back: as binary data or JSON, as its top classes, or into shared memory."""

    binary: bool
    classes: int = 0
    span: Span | None = None


PLAN_RESPONSES = 8
"""Response headers a plan keeps: one per precision and output shape its answers have had."""


@dataclass(frozen=True)
class BinaryInput:
    """One input of a :class:`RequestPlan`: its spec, datatype and shape, and where its bytes lie."""

    spec: TensorSpec
    wire: DataType
    shape: list[int]
    start: int
    """Where its bytes start in the binary data."""
    size: int
    field: str


@dataclass
class RequestPlan:
    """What a V2 request's JSON header decides for a model, when every input comes as binary data: each input's
    spec, datatype, shape and bytes, and how the outputs go back; and the response's JSON header for each precision
    and output shape seen, when every output goes back as binary data.

    A client sends the same header with every request of a shape (only the binary data changes), so the inference
    route keeps plans by header (:func:`~halfserve.api.dataplane.plan.decode_request`) and a header it has seen is
    neither parsed nor checked again: only the data is (its size, dtype and values), and whatever the model's
    settings decide now (the request's size limit, the precision's input dtype). A plan holds for the manifest and
    settings it was made with, by identity.
    """

    manifest: Manifest
    settings: Settings
    inputs: tuple[BinaryInput, ...]
    declared: int
    """The bytes of binary data the header declares."""
    request_id: str | None
    binary_output: bool
    timeout_us: int
    classes: int
    outputs: dict[str, OutputRequest] | None
    binary_outputs: tuple[tuple[str, DataType], ...]
    """Each output the request wants with its datatype, when all go back as binary data (else empty)."""
    responses: dict[tuple[object, ...], bytes]
    """Response headers by precision and output shapes (at most :data:`PLAN_RESPONSES`)."""

    def holds(self, served: ModelHandle, settings: Settings, binary: memoryview | None) -> bool:
        return (
            self.manifest is served.manifest
            and self.settings is settings
            and binary is not None
            and len(binary) == self.declared
        )


def parameters(obj: dict[str, Any], field: str) -> dict[str, Any]:
    """An entry's ``parameters`` object (empty when it has none), or a 400 naming ``field``."""
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidInputError(f"{field}: expected an object, got {type(params).__name__}")
    return params


def flag(params: dict[str, Any], key: str, field: str, default: bool) -> bool:
    """The boolean parameter ``key`` (``default`` when absent), or a 400 naming ``field.key``."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInputError(f"{field}.{key}: expected true or false, got {value!r}")
    return value
