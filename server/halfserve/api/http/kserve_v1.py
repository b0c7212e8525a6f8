"""KServe's V1 data plane, TensorFlow Serving's REST API, which KServe's V1 predictors speak: ``GET /v1/models``,
``GET /v1/models/{name}`` (readiness) and ``POST /v1/models/{name}:predict``, so a client written for a KServe V1
InferenceService works unchanged.

A predict's ``instances`` (the row format: one sample per entry; for a model of several inputs, one object of input
name to its sample) or ``inputs`` (the column format: ``/predict``'s ``inputs``) are decoded by ``/predict``'s rules
(texts, ``{"b64": ...}`` photos, the same limits) and batched with every other request. The answer is
``{"predictions": [...]}``, one per instance (for a model of several outputs, an object of output name to its row).
Errors are KServe's ``{"error": "..."}``, naming the field. A model with a handler is fed tensors, as ``/predict`` and
V2 feed it, except for TorchServe's KServe envelope (``{"instances": [{"data": ...}]}``, which KServe's TorchServe
predictor sends): each instance is one payload of a handler batch, as a file of ``/predictions``' form is
(:func:`envelope`), and the answer is the handler's, one prediction per instance. A model without a handler whose
manifest decodes photos or texts through one input (an imported stock ``image_classifier`` archive) takes the
envelope too, its payloads as photos or texts, answered as ``/predictions`` answers them
(:mod:`~halfserve.api.dataplane.stockanswers`: a labelled model's top five classes), as TorchServe's would be.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Scope

from halfserve.api.access import check_taken
from halfserve.api.dataplane import handled
from halfserve.api.dataplane.decode import from_base64
from halfserve.api.dataplane.infer import infer
from halfserve.api.dataplane.photos import decode_photos, image_count
from halfserve.api.dataplane.samples import decode_inputs
from halfserve.api.dataplane.stockanswers import stock_answers
from halfserve.api.errors import APIError
from halfserve.api.http import deps, guard
from halfserve.api.http.errors import RoutingShape, error_response, error_responses, json_ok
from halfserve.api.http.limits import TIMEOUT_PARAMETER, client_timeout, read_fields
from halfserve.api.http.telemetry import answered, metered, note
from halfserve.errors import IdOutOfRangeError, InvalidInputError
from halfserve.handlerinput import HandlerStyle
from halfserve.manifest import sent_inputs
from halfserve.serving import Interface, ModelHandle, Tensors, why_model_not_ready

router = APIRouter()

FIELDS = ("instances", "inputs")
"""The fields of a V1 predict body, one of them given: any other is refused, naming it."""

FIELDS_TS = frozenset({"data", "body"})
"""The fields of an instance in TorchServe's KServe envelope, which its handlers read."""
VERBS = (":predict", ":explain")
"""The verbs of V1's model paths (``/v1/models/{name}:predict``)."""
_OBJECT: dict[str, Any] = {"type": "object"}
PREDICT_SCHEMA: dict[str, Any] = {
    "parameters": [TIMEOUT_PARAMETER],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "instances": {
                            "type": "array",
                            "minItems": 1,
                            "description": "One entry per sample: the sample (a nested list, a text, or "
                            '{"b64": "<base64 of a photo>"}), or an object of input name to the sample for a model '
                            "of several inputs; for a model with a handler, or one of photos or texts, TorchServe's "
                            'KServe envelope: {"data": "<base64 of the bytes, or a text>"}, one request each.',
                        },
                        "inputs": {
                            "anyOf": [{"type": "array", "minItems": 1}, {"type": "object"}],
                            "description": "The samples by column: a list of samples, or an object of input name "
                            "to its samples (as /predict's inputs). Give instances or inputs.",
                        },
                    },
                }
            }
        },
    },
    "responses": {
        **json_ok("One prediction per instance.", _OBJECT),
        **error_responses(
            {
                400: "Malformed request; the error names the field.",
                404: "Unknown model.",
                413: "Body, JSON values, rows or input values over the limits.",
                500: "The model failed on this request's rows.",
                503: "Queue full, model not loaded, or the request cut off by shutdown (with Retry-After).",
                504: "The request's deadline passed before its rows had all started.",
            }
        ),
    },
}


@router.get("/v1/models", response_class=Response, responses=json_ok("The served models' names.", _OBJECT))
async def list_models(request: Request) -> Response:
    """The names of the models served, as KServe lists them."""
    return deps.json_response({"models": sorted(deps.service(request).models)})


@router.get(
    "/v1/models/{model_name}",
    response_class=Response,
    responses={
        **json_ok("Ready.", _OBJECT),
        **error_responses({404: "Unknown model.", 503: "Known but not ready: loading, failed or unloaded."}),
    },
)
async def model_ready(model_name: str, request: Request) -> Response:
    """The model's readiness: 200 when it is ready, 503 with the reason when it is not (KServe's ``ModelNotReady``),
    404 when it is unknown."""
    if model_name.endswith(VERBS):  # a GET of a verb's route, which this one matches with the verb in the name
        raise _verb_refused(model_name, request.method)
    served = deps.served_model(request, model_name, None)
    why = why_model_not_ready(served)
    if why is not None:
        detail = f": {served.error}" if served.error else ""  # a failed load's reason, as V2's readiness gives it
        raise APIError(503, f"model {served.name!r} is not ready: {why}{detail}")
    return deps.json_response({"name": served.name, "ready": True})


def as_columns(instances: object, served: ModelHandle) -> object:
    """The row format's ``instances`` as ``/predict``'s ``inputs``: a list of samples as it is; a list of objects of
    input name to sample (not a ``{"b64": ...}`` photo) as an object of input name to its samples, every instance
    naming the same inputs. A model of several inputs takes only the second."""
    if not isinstance(instances, list):
        raise InvalidInputError(f"instances: expected a list of instances, got {type(instances).__name__}")
    if not instances:  # as /predict words an empty inputs
        raise InvalidInputError("instances: empty; send at least one instance")
    first = instances[0]
    if not isinstance(first, dict) or "b64" in first:
        names = [t.name for t in sent_inputs(served.manifest)]
        if len(names) > 1 and served.manifest.text is None:
            example = ", ".join(f'"{n}": sample' for n in names)
            raise InvalidInputError(
                f"instances[0]: model {served.name!r} takes several inputs; send each instance as {{{example}}}"
            )
        for i, instance in enumerate(instances):
            if isinstance(instance, dict) and "b64" not in first:  # the first is a sample: a named one is no row
                raise InvalidInputError(
                    f"instances[{i}]: an object of input name to sample, but instances[0] is a sample; give every "
                    "instance alike"
                )
        return instances
    names = list(first)
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise InvalidInputError(
                f"instances[{i}]: expected an object of input name to sample, as instances[0] is, got "
                f"{type(instance).__name__}"
            )
        if instance.keys() != first.keys():
            raise InvalidInputError(
                f"instances[{i}]: names {sorted(instance)}, but instances[0] names {sorted(names)}; every instance "
                "names the same inputs"
            )
        for name in names:
            columns[name].append(instance[name])
    return columns


@router.post("/v1/models/{model_name}:predict", openapi_extra=PREDICT_SCHEMA, response_class=Response)
@metered(Interface.KSERVE_V1)
async def predict(request: Request) -> Response:
    """Run the instances through the model; concurrent calls (of every protocol) are batched together."""
    guard.content_type(request.scope, guard.JSON)
    app = deps.state(request)
    settings = app.settings
    timeout = client_timeout(request)
    served = deps.served_model(request, request.path_params["model_name"], None)
    note(request, served)
    check_taken(served)  # before the body is read: nothing of it decoded, nor handed to a handler, for no model
    payload = await read_fields(request, settings, FIELDS, "send instances (or inputs)")
    if len(payload) != 1:
        raise InvalidInputError(
            "body: give instances (one sample per entry) or inputs (samples by column), not both"
            if payload
            else 'instances: missing; send {"instances": [sample, ...]}'
        )
    field, given = next(iter(payload.items()))
    spec = handled.section(served)
    if spec is not None and _enveloped(given):  # tensors are fed to the model, as /predict and V2 feed them
        if field != "instances":
            raise InvalidInputError(
                f'inputs[0]: TorchServe\'s KServe envelope is sent as instances: {{"instances": [{{"data": ...}}]}}, '
                f"each instance one request to the handler of model {served.name!r}"
            )
        image_count(settings, served, len(given), field)  # before any instance is decoded
        payloads = envelope(given, spec.style)
        fields = [f"instances[{i}].{p.field}" for i, p in enumerate(payloads)]
        handled.payload_count(settings, served, payloads, fields, "instances")
        answer = await handled.answer(app, served, settings, payloads, timeout)
        answered(request, answer.prediction)
        return Response(b'{"predictions":[' + b",".join(answer.answers) + b"]}", media_type="application/json")
    decoding: Awaitable[Tensors]
    enveloped = field == "instances" and _enveloped(given) and _reads_envelope(served)
    stock = enveloped and served.manifest.image is not None  # an image_classifier's photos, answered as it answers
    if enveloped:
        # An imported archive whose handler this server runs itself (a stock image_classifier's photos, a text
        # classifier's texts): the envelope's texts are its photos' base64, or its texts, as that handler reads them.
        if served.manifest.image is not None:
            image_count(settings, served, len(given), field)  # before any instance is decoded
            photos = envelope(given, HandlerStyle.HALFSERVE)  # the base64 decoded, a 400 naming instances[i].data
            fields = [f"instances[{i}].{p.field}" for i, p in enumerate(photos)]
            decoding = decode_photos([p.data for p in photos if isinstance(p.data, bytes)], fields, served, settings)
        else:
            texts = [p.data for p in envelope(given, HandlerStyle.TORCHSERVE)]
            decoding = decode_inputs(texts, served, settings, field)
    else:
        samples = as_columns(given, served) if field == "instances" else given
        decoding = decode_inputs(samples, served, settings, field)
    try:
        result = await infer(app, served, decoding, timeout)
    except IdOutOfRangeError as e:  # found below the routes, which name rows by inputs
        if field != "instances":
            raise
        raise e.in_rows(field) from None
    answered(request, result)
    if stock:  # as KServe's TorchServe predictor gives the stock handler's answers
        answers = await stock_answers(served, result.outputs)
        return Response(b'{"predictions":[' + b",".join(answers) + b"]}", media_type="application/json")
    specs = served.manifest.outputs
    if len(specs) == 1:
        predictions: Any = result.outputs[specs[0].name]
    else:
        columns = [(t.name, result.outputs[t.name]) for t in specs]
        predictions = [{name: rows[i] for name, rows in columns} for i in range(len(columns[0][1]))]
    return Response(
        orjson.dumps({"predictions": predictions}, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


def routing_error(status: int, headers: dict[str, str] | None, scope: Scope) -> Response | None:
    """The router's 405 on a model's verb path (``/v1/models/{name}:predict``), which the readiness route matches
    too: POST is its method (the readiness route's ``Allow: GET`` had been named); an unknown verb is a 404 naming the
    ones served. None elsewhere, for the server's own answer."""
    path: str = scope["path"]
    name = path.removeprefix(ROUTES_PREFIX)
    if "/" in name or ":" not in name:
        return None
    verb = name[name.rindex(":") :]
    if verb not in VERBS:
        return error_response(404, f"{path[:200]}: no verb {verb[:40]!r} here; V1 serves /v1/models/{{model}}:predict")
    if status == 405 or verb == ":explain":
        e = _verb_refused(name, scope["method"])
        return error_response(e.status, e.message, e.headers)
    return None


def _verb_refused(name: str, method: str) -> APIError:
    """The answer to ``method`` on a verb's path other than ``POST ...:predict`` (``name`` ends with the verb):
    ``:explain`` a 404 whatever the method, ``:predict`` a 405 naming POST."""
    verb = name[name.rindex(":") :]
    if verb == ":explain":
        return _not_explained(name.removesuffix(verb))
    return APIError(405, f"{method} /v1/models/{{model}}{verb}: use POST", {"Allow": "POST"})


ROUTES_PREFIX = "/v1/models/"
ROUTING_SHAPES: dict[str, RoutingShape] = {ROUTES_PREFIX: routing_error}
"""The path prefixes whose routing errors this module answers (:func:`halfserve.api.http.errors.install`)."""


def envelope(instances: list[Any], style: HandlerStyle) -> list[handled.Payload]:
    """TorchServe's KServe envelope's instances (``[{"data": ...}]`` or ``[{"body": ...}]``, one text each) as one
    handler payload each, carried as TorchServe carries them to a ``torchserve``-style handler: the text as it is (its
    ``VisionHandler`` base64-decodes a text; a text model's handler reads it as sent). A ``halfserve``-style handler
    is given bytes wherever it runs, so there the text is base64, decoded here."""
    payloads = []
    for i, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise InvalidInputError(
                f'instances[{i}]: expected {{"data": ...}}, as instances[0] is, got {type(instance).__name__}'
            )
        fields = sorted(instance)
        if len(fields) != 1 or fields[0] not in FIELDS_TS:
            named = ", ".join(f[:40] for f in fields[:8]) or "nothing"
            raise InvalidInputError(f"instances[{i}]: names {named}; give one of data or body, the request's payload")
        name = fields[0]
        value = instance[name]
        if not isinstance(value, str):
            raise InvalidInputError(
                f"instances[{i}].{name}: expected a string (base64 of bytes, or a text), got {type(value).__name__}"
            )
        data = value if style is HandlerStyle.TORCHSERVE else from_base64(value, f"instances[{i}].{name}")
        payloads.append(handled.Payload(name, data, ""))
    return payloads


def _reads_envelope(served: ModelHandle) -> bool:
    """Whether a model without a handler takes TorchServe's KServe envelope: one whose manifest decodes what a stock
    handler would read (photos, or texts), with one input of them, so the envelope's payload is a whole instance."""
    manifest = served.manifest
    return (manifest.image is not None or manifest.text is not None) and len(sent_inputs(manifest)) == 1


def _enveloped(given: object) -> bool:
    """Whether instances are TorchServe's KServe envelope's (``[{"data": ...}]`` or ``[{"body": ...}]``)."""
    return isinstance(given, list) and bool(given) and isinstance(given[0], dict) and bool(given[0].keys() & FIELDS_TS)


def _not_explained(name: str) -> APIError:
    """The 404 of ``:explain``, whatever the method: explanations are not served."""
    return APIError(404, f"explanations are not served here; /v1/models/{name[:200]}:predict answers the model")
