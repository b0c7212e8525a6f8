"""What an operator looks at: ``GET /metrics`` for Prometheus, and the status page at ``/``.

The status page is one static HTML file with a few lines of JavaScript that poll ``/models`` and ``/ready``; it needs
no build step and no route of its own beyond serving the file.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, Response

from halfserve.api.errors import APIError
from halfserve.api.http import deps
from halfserve.metrics import CONTENT_TYPE, Metrics

router = APIRouter()

STATUS_PAGE = resources.files("halfserve.api.http").joinpath("static/status.html").read_bytes()


@router.get(
    "/metrics",
    response_class=Response,
    responses={"200": {"description": "Prometheus text exposition format.", "content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    """Counters, histograms and gauges in the Prometheus text format: requests and rows by model, precision,
    protocol and status; latency, queue and compute time; batch sizes; queue depth; weight bytes on the device."""
    registry = deps.state(request).metrics
    if not isinstance(registry, Metrics):
        raise APIError(503, "this process keeps no metrics registry")
    return Response(registry.render(), media_type=CONTENT_TYPE)


@router.get(
    "/",
    response_class=HTMLResponse,
    responses={"200": {"description": "The status page.", "content": {"text/html": {}}}},
)
async def status_page() -> Response:
    """A status page: each model's precision, device, weight bytes and fp16/bf16-vs-fp32 agreement, with live
    request rate, batch size and latency."""
    return HTMLResponse(STATUS_PAGE)
