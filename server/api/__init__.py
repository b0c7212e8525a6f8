"""HTTP routes. They decode, validate and encode; tensors cross into the server as numpy arrays."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.routing import Route

from server.api import errors, models, predict, v2, v2_repository, v2_triton

HOT_PATHS: list[Route] = [
    Route("/predict", predict.predict, methods=["POST"], include_in_schema=False),
    *(
        Route(path, v2.infer, methods=["POST"], include_in_schema=False)
        for path in ("/v2/models/{model_name}/infer", "/v2/models/{model_name}/versions/{model_version}/infer")
    ),
]
"""Inference endpoints also mounted as plain Starlette routes, ahead of their FastAPI twins.

FastAPI's per-request dependency solving and nested-router matching cost about a third of the event loop's time
on a small model (profiled); the FastAPI declarations stay for the OpenAPI schema and answer nothing in practice.
"""


def install(app: FastAPI) -> None:
    """Add every route and the JSON error handlers to ``app``."""
    errors.install(app)
    # v2_triton ahead of v2: its /v2/models/stats must match before v2's /v2/models/{model_name}.
    for router in (predict.router, models.router, v2_triton.router, v2_repository.router, v2.router):
        # Added flat rather than with include_router, which matches through an extra router layer per request.
        app.router.routes.extend(router.routes)
    app.router.routes[:0] = HOT_PATHS


__all__ = ["install"]
