"""The plans of V2 request headers, kept: a header seen before is neither parsed nor checked again.

A client sends the same JSON header with every request of a shape (only the binary data after it changes), so the
HTTP route keeps what each header decided (:class:`~halfserve.api.dataplane.request.RequestPlan`) by model and header,
and decodes a request whose header has a plan from its binary data alone (:func:`decode_request`).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from halfserve.api.dataplane.bounds import check_size, parse_json
from halfserve.api.dataplane.codec import HEADER_LENGTH, decode_binary, wire_type
from halfserve.api.dataplane.decode import checked_input, decode, tokenize
from halfserve.api.dataplane.json_request import read_request
from halfserve.api.dataplane.request import BinaryData, BinaryInput, Inference, InferRequest, OutputRequest, RequestPlan
from halfserve.api.dataplane.spans import RegionSource
from halfserve.manifest import DataType, sent_inputs
from halfserve.serving import ModelHandle
from halfserve.settings import Settings

PLANS = 256
"""Request headers kept decoded (:class:`RequestPlan`), all models together: past it the oldest goes."""
PLAN_HEADER_BYTES = 4096
"""The longest JSON header kept decoded: a header carrying its tensors as JSON ``data`` is not worth keeping."""

_plans: dict[tuple[str, int, bytes], RequestPlan] = {}


def planned_request(plan: RequestPlan, binary: memoryview, served: ModelHandle) -> Inference:
    """The request of ``plan``'s header with ``binary``'s data (:meth:`RequestPlan.holds` for them)."""
    tensors: dict[str, np.ndarray] = {}
    for i in plan.inputs:
        check_size(plan.settings, served, i.shape[0], f"{i.field}.shape")
        data = binary[i.start : i.start + i.size]
        arr = decode_binary(data, i.wire, i.shape, f"{i.field}.parameters.binary_data_size")
        tensors[i.spec.name] = checked_input(arr, i.wire, i.spec, served, i.field, f"{i.field} (binary data)")
    return Inference(
        tensors, plan.request_id, plan.binary_output, plan.timeout_us, plan.classes, None, plan.outputs, plan
    )


def _plan(request: InferRequest, req: Inference, served: ModelHandle, settings: Settings) -> RequestPlan | None:
    """The plan of a header :func:`decode` has accepted (``request``, decoded as ``req``); None when an input comes as
    JSON data, as text or from shared memory, or an output goes to shared memory, and for a header with an ``id``
    (clients that send one send a new one with each request: a plan would cost each of them 3 us to make and never be
    used)."""
    outputs = req.outputs
    if (
        req.request_id is not None
        or req.output_span is not None
        or (outputs is not None and any(o.span is not None for o in outputs.values()))
    ):
        return None
    text = served.manifest.text or served.manifest.image  # texts and photos are decoded anew each time
    specs = sent_inputs(served.manifest)
    inputs, start = [], 0
    for i, item in enumerate(request.inputs):
        data = item.data
        if type(data) is not BinaryData or (text is not None and item.name == text.input):
            return None
        spec = next(t for t in specs if t.name == item.name)
        size = len(data.view)
        # decode accepted both: a datatype it knows, and a shape of integers
        shape = cast(list[int], item.shape)
        inputs.append(BinaryInput(spec, wire_type(item.datatype, ""), shape, start, size, f"inputs[{i}]"))
        start += size
    m = served.manifest
    if outputs is None:
        wanted = [(m.outputs[0], OutputRequest(req.binary_output, req.classes))]
    else:
        wanted = [(spec, how) for spec in m.outputs if (how := outputs.get(spec.name)) is not None]
    binary_outputs: tuple[tuple[str, DataType], ...] = ()
    if all(how.binary and not how.classes for _, how in wanted):
        binary_outputs = tuple((spec.name, spec.datatype) for spec, _ in wanted)
    return RequestPlan(
        m,
        settings,
        tuple(inputs),
        start,
        req.request_id,
        req.binary_output,
        req.timeout_us,
        req.classes,
        outputs,
        binary_outputs,
        {},
    )


async def decode_request(
    header: bytes,
    binary: memoryview | None,
    served: ModelHandle,
    settings: Settings,
    regions: RegionSource,
    client: float | None = None,
) -> Inference:
    """The V2 inference request of ``header`` (its JSON) and ``binary``, from the plan kept for the header when there
    is one (:class:`RequestPlan`), else read (:func:`~halfserve.api.dataplane.json_request.read_request`) and
    checked (:func:`decode`), and its plan kept; its texts or photos decoded within its deadline (``client``'s, the
    transport's, and its own)."""
    key = (served.name, served.version, header)
    plan = _plans.get(key)
    if plan is not None and plan.holds(served, settings, binary):
        assert binary is not None
        return planned_request(plan, binary, served)
    # A header length that is wrong cuts the JSON short or takes binary data into it: the refusal says what to check.
    hint = "" if binary is None else f"check {HEADER_LENGTH} ({len(header)}): the bytes of JSON before the binary data"
    request = read_request(await parse_json(header, settings.max_json_values, hint), binary, served)
    req = await tokenize(decode(request, served, settings, regions), served, settings, client)
    if len(header) <= PLAN_HEADER_BYTES:
        plan = _plan(request, req, served, settings)
        if plan is not None:
            req.plan = plan
            _plans.pop(key, None)
            if len(_plans) >= PLANS:
                del _plans[next(iter(_plans))]
            _plans[key] = plan
    return req
