"""Triton's system shared memory extension: tensors read from, and written into, POSIX shared memory on this host.

A client on the same host creates a shared memory object (``shm_open``, or tritonclient's
``tritonclient.utils.shared_memory``), registers a region of it under a name, and then names the region in an
inference request instead of sending the tensor's bytes: an input's ``parameters`` give ``shared_memory_region``,
``shared_memory_byte_size`` and (optionally) ``shared_memory_offset``, and the server reads the input there; an
output's give the same, and the server writes the output there and answers with its datatype and shape only. A
150 KB image then costs the HTTP request a few hundred bytes of JSON.

Registering opens the object in the server (and in each front-end, which decode requests themselves), so it is a
management call: it needs the admin token, and a server without one cannot be made to open anything. Keys are POSIX
shared memory names (``/name``), opened in ``/dev/shm`` without following links, and must hold the region. Each region
holds a descriptor open, so at most ``max_shm_regions`` are registered at once (one more is a 413 naming the setting),
a name is at most 128 printable ASCII characters, and a server out of descriptors answers 503, its own shortage.

The regions themselves, and how they are read and written without mapping a client's object, are
:mod:`halfserve.regions`: a shrunk object is a 400, a full tmpfs ``ENOSPC`` a 507.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from halfserve.api.access import admitted_regions
from halfserve.api.dataplane.refusals import count
from halfserve.api.errors import APIError
from halfserve.api.http import deps
from halfserve.api.http.deps import (
    AUTH_ERRORS,
    BEARER,
    OPTIONAL_JSON_BODY,
    json_object,
    json_response,
    require_admin,
)
from halfserve.api.http.errors import error_responses, json_ok
from halfserve.serving import SharedRegions


def regions_of(request: Request) -> SharedRegions:
    return deps.state(request).regions


def authorised_regions(request: Request) -> SharedRegions:
    """The registered regions, for a request that carries the admin token: a region is another client's memory, so
    reading it (as an input) or writing it (as an output) is for holders of the token that registered it."""
    return admitted_regions(deps.state(request), deps.client_address(request), request.headers.get("authorization", ""))


# Endpoints ---------------------------------------------------------------------------------------------------------

router = APIRouter()

_LIST: dict[str, Any] = {"type": "array", "items": {"type": "object"}}
_STATUS = {
    **json_ok("The registered regions: name, key, offset, byte_size.", _LIST),
    **AUTH_ERRORS,
    **error_responses({404: "No region of that name is registered."}),
}
_CHANGE = {**json_ok("Done.", {"type": "object"}), **AUTH_ERRORS}
_REGISTER = {
    **_CHANGE,
    **error_responses(
        {
            400: "Malformed body; a key that is no shared memory object, a range it does not hold, a name taken or "
            "malformed.",
            413: "A body over 64 KiB, or max_shm_regions regions registered already.",
            503: "The server is out of file descriptors.",
        }
    ),
}


@router.get("/v2/systemsharedmemory/status", response_class=Response, responses=_STATUS, dependencies=BEARER)
async def system_status(request: Request) -> Response:
    """Every registered system shared memory region (names and keys are the owners': admin token only)."""
    require_admin(request)
    return json_response(regions_of(request).status())


@router.get(
    "/v2/systemsharedmemory/region/{region_name}/status",
    response_class=Response,
    responses=_STATUS,
    dependencies=BEARER,
)
async def system_region_status(region_name: str, request: Request) -> Response:
    """One registered region (admin token only)."""
    require_admin(request)
    region = regions_of(request).regions.get(region_name)
    if region is None:
        raise APIError(404, f"no shared memory region {region_name!r} is registered")
    return json_response([region.status()])


@router.post(
    "/v2/systemsharedmemory/region/{region_name}/register",
    response_class=Response,
    responses=_REGISTER,
    dependencies=BEARER,
    openapi_extra=OPTIONAL_JSON_BODY,
)
async def system_register(region_name: str, request: Request) -> Response:
    """Map ``byte_size`` bytes from ``offset`` into the POSIX shared memory object ``key`` under ``region_name``."""
    require_admin(request)
    body = await json_object(request)
    key = body.get("key")
    if not isinstance(key, str):
        raise APIError(400, f"key: expected a string, got {key!r}")
    offset = count(body.get("offset", 0), "offset")
    byte_size = count(body.get("byte_size"), "byte_size")
    regions_of(request).register(region_name, key, offset, byte_size)
    return json_response({})


@router.post(
    "/v2/systemsharedmemory/region/{region_name}/unregister",
    response_class=Response,
    responses=_CHANGE,
    dependencies=BEARER,
)
async def system_unregister(region_name: str, request: Request) -> Response:
    """Forget a region (requests already holding it finish with it)."""
    require_admin(request)
    regions_of(request).unregister(region_name)
    return json_response({})


@router.post("/v2/systemsharedmemory/unregister", response_class=Response, responses=_CHANGE, dependencies=BEARER)
async def system_unregister_all(request: Request) -> Response:
    """Forget every region."""
    require_admin(request)
    regions_of(request).unregister(None)
    return json_response({})


@router.get("/v2/cudasharedmemory/status", response_class=Response, responses=json_ok("None: not served.", _LIST))
async def cuda_status() -> Response:
    """CUDA shared memory is not served: no region is ever registered."""
    return json_response([])


@router.post(
    "/v2/cudasharedmemory/region/{region_name}/register",
    response_class=Response,
    responses=error_responses({400: "CUDA shared memory is not served."}),
)
async def cuda_register(region_name: str) -> Response:
    """Refused: CUDA shared memory (cudaIpc handles) is not served; system shared memory is."""
    raise APIError(400, "CUDA shared memory is not supported; register system shared memory instead")


@router.post("/v2/cudasharedmemory/region/{region_name}/unregister", response_class=Response, responses=_CHANGE)
@router.post("/v2/cudasharedmemory/unregister", response_class=Response, responses=_CHANGE)
async def cuda_unregister() -> Response:
    """Nothing to forget: no CUDA region is ever registered."""
    return json_response({})
