"""Triton's model configuration and statistics extensions to the V2 protocol.

``GET /v2/models/{m}[/versions/{v}]/config`` describes a model as a Triton ``ModelConfig``; ``GET
/v2/models[/{m}[/versions/{v}]]/stats`` reports what its batcher has done since the model was loaded, in Triton's
statistics shape: ``inference_count`` counts rows and ``execution_count`` batches, so their ratio is the mean batch
size.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.admin import model_config, model_stats
from halfserve.api.errors import APIError
from halfserve.api.http.deps import json_response, local_model, model_route, repository, version_of
from halfserve.api.http.errors import Responses, error_responses, json_ok
from halfserve.serving import check_ready

router = APIRouter()

BACKEND = "pytorch"

_CONFIG_RESPONSES: Responses = {
    **json_ok("Triton's ModelConfig of the model.", {"type": "object", "required": ["name", "max_batch_size"]}),
    **error_responses({404: "Unknown model, or a version it does not serve."}),
}
_STATS: dict[str, Any] = {"type": "object", "required": ["model_stats"]}
_STATS_RESPONSES: Responses = {
    **json_ok("The model's statistics.", _STATS),
    **error_responses(
        {
            404: "Unknown model or version, or a model with no available version (unloaded, failed).",
            503: "The model is loading, or the version named is not ready.",
        }
    ),
}


@model_route(router, "GET", "/config", responses=_CONFIG_RESPONSES)
async def config(model_name: str, request: Request) -> Response:
    """The model's configuration in Triton's ``ModelConfig`` JSON."""
    served = local_model(request, model_name, version_of(request))
    device = repository(request).device
    return json_response(model_config(served, device.type, device.index))


# Declared (and installed) ahead of /v2/models/{model_name}, which would otherwise take "stats" for a model name.
@router.get("/v2/models/stats", response_class=Response, responses=json_ok("Every loaded model's statistics.", _STATS))
async def all_stats(request: Request) -> Response:
    """Statistics of every loaded model (a model's statistics start afresh each time it is loaded)."""
    models = repository(request).models.values()
    return json_response({"model_stats": [model_stats(m, s) for m in models if (s := m.batch_stats) is not None]})


@model_route(router, "GET", "/stats", responses=_STATS_RESPONSES)
async def stats(model_name: str, request: Request) -> Response:
    """Statistics of one model: requests, rows, batches and time, with a breakdown per batch size."""
    version = version_of(request)
    served = local_model(request, model_name, version)
    check_ready(served, version)
    found = served.batch_stats
    if found is None:  # unloaded between the check and here
        raise APIError(503, f"model {model_name!r} is {served.state.value}")
    return json_response({"model_stats": [model_stats(served, found)]})
