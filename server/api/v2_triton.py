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

from server.api.dataplane.metadata import PLATFORM
from server.api.deps import json_response, local_model, model_route, repository, version_of
from server.api.errors import APIError, Responses, error_responses, json_ok
from server.batching import BatchStats
from server.manifest import InputFormat, Manifest, TensorSpec, sent_inputs
from server.repository import ServedModel
from server.serving import check_ready

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


def _tensor_config(spec: TensorSpec) -> dict[str, object]:
    return {"name": spec.name, "data_type": f"TYPE_{spec.datatype.value}", "dims": list(spec.shape)}


def input_configs(manifest: Manifest) -> list[dict[str, object]]:
    """The inputs clients send as Triton's ``ModelInput``: each with its ``format`` (Triton's image clients lay out
    the pixels they send by it), and the text input a text model takes (``TYPE_STRING``, one text per row), as the
    metadata lists it."""
    configs = [{**_tensor_config(s), "format": s.image_format.value} for s in sent_inputs(manifest)]
    if manifest.text is not None:
        text = {"name": manifest.text.input, "data_type": "TYPE_STRING", "dims": [1]}
        configs.append({**text, "format": InputFormat.NONE.value})
    return configs


def model_config(served: ServedModel, device_type: str, device_index: int | None) -> dict[str, object]:
    """``served`` as a Triton ``ModelConfig``: per-sample ``dims`` (the batch dimension is implied by
    ``max_batch_size``), the dynamic batcher's delay, one instance on the serving device. Settings Triton has no
    field for (precision, the queue bound in rows, the adaptive delay) are string ``parameters``."""
    b = served.batching
    gpu = device_type == "cuda"
    instance: dict[str, object] = {"name": f"{served.name}_0", "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
    if gpu:
        instance["gpus"] = [device_index or 0]
    parameters = {
        "max_queue_rows": {"string_value": str(b.max_queue_rows)},
        # Triton has no field for it: max_queue_delay_microseconds is then the longest wait, not every wait.
        "adaptive_delay": {"string_value": str(b.adaptive_delay).lower()},
    }
    if served.precision is not None:
        parameters["precision"] = {"string_value": served.precision.value}
    dynamic_batching: dict[str, object] = {"max_queue_delay_microseconds": round(b.max_delay_ms * 1000)}
    if b.request_timeout_ms is not None:
        # Triton's own name for a queued request's deadline; a client's shorter parameters.timeout overrides it.
        dynamic_batching["default_queue_policy"] = {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": round(b.request_timeout_ms * 1000),
            "allow_timeout_override": True,
        }
    return {
        "name": served.name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": {"specific": {"versions": [served.version]}},
        "max_batch_size": b.max_batch_size,
        "input": input_configs(served.manifest),
        "output": [_tensor_config(s) for s in served.manifest.outputs],
        "dynamic_batching": dynamic_batching,
        "instance_group": [instance],
        "parameters": parameters,
    }


@model_route(router, "GET", "/config", responses=_CONFIG_RESPONSES)
async def config(model_name: str, request: Request) -> Response:
    """The model's configuration in Triton's ``ModelConfig`` JSON."""
    served = local_model(request, model_name, version_of(request))
    device = repository(request).device
    return json_response(model_config(served, device.type, device.index))


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": round(seconds * 1e9)}


def model_stats(served: ServedModel, stats: BatchStats) -> dict[str, object]:
    """One ``model_stats`` entry.

    ``success`` and ``fail`` count requests, with their time from queueing to answer; ``queue`` counts the chunks
    cut into batches (a request larger than a batch waits once per chunk). The engine times a batch as a whole
    (host-to-device copy, cast, forward, copy back), so ``compute_infer`` holds it all, counted per batch, and
    ``compute_input`` / ``compute_output`` hold counts with zero time.
    """
    compute = sum(stats.batch_compute_seconds.values())
    return {
        "name": served.name,
        "version": str(served.version),
        "last_inference": round(stats.last_inference * 1000),
        "inference_count": stats.rows,
        "execution_count": stats.batches,
        "inference_stats": {
            "success": _duration(stats.succeeded, stats.success_seconds),
            "fail": _duration(stats.failed, stats.fail_seconds),
            "queue": _duration(stats.queued_chunks, stats.queue_seconds),
            "compute_input": _duration(stats.batches, 0.0),
            "compute_infer": _duration(stats.batches, compute),
            "compute_output": _duration(stats.batches, 0.0),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(count, 0.0),
                "compute_infer": _duration(count, stats.batch_compute_seconds[size]),
                "compute_output": _duration(count, 0.0),
            }
            for size, count in sorted(stats.batch_sizes.items())
        ],
    }


# Declared (and installed) ahead of /v2/models/{model_name}, which would otherwise take "stats" for a model name.
@router.get("/v2/models/stats", response_class=Response, responses=json_ok("Every loaded model's statistics.", _STATS))
async def all_stats(request: Request) -> Response:
    """Statistics of every loaded model (a model's statistics start afresh each time it is loaded)."""
    models = repository(request).models.values()
    return json_response({"model_stats": [model_stats(m, m.batcher.stats) for m in models if m.batcher is not None]})


@model_route(router, "GET", "/stats", responses=_STATS_RESPONSES)
async def stats(model_name: str, request: Request) -> Response:
    """Statistics of one model: requests, rows, batches and time, with a breakdown per batch size."""
    version = version_of(request)
    served = local_model(request, model_name, version)
    check_ready(served, version)
    if served.batcher is None:  # unloaded between the check and here
        raise APIError(503, f"model {model_name!r} is {served.state.value}")
    return json_response({"model_stats": [model_stats(served, served.batcher.stats)]})
