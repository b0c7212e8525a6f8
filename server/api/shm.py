"""Triton's system shared memory extension: tensors read from, and written into, POSIX shared memory on this host.

A client on the same host creates a shared memory object (``shm_open``, or tritonclient's
``tritonclient.utils.shared_memory``), registers a region of it under a name, and then names the region in an
inference request instead of sending the tensor's bytes: an input's ``parameters`` give ``shared_memory_region``,
``shared_memory_byte_size`` and (optionally) ``shared_memory_offset``, and the server reads the input there; an
output's give the same, and the server writes the output there and answers with its datatype and shape only. A
150 KB image then costs the HTTP request a few hundred bytes of JSON.

Registering opens the object in the server (and in each front-end, which decode requests themselves), so it is a
management call: it needs the admin token, and a server without one cannot be made to open anything. Keys are POSIX
shared memory names (``/name``), opened in ``/dev/shm`` without following links, and must hold the region.

The object is the client's, and it may shrink it, or fill the tmpfs it lives on, at any moment. A mapping would turn
either into SIGBUS on the next access, which kills the process however it is guarded: a size check before the access
always leaves a window. So the server never maps a client's object: it reads with ``preadv`` into a buffer of its own
and writes with ``pwrite``, and a shrunk object is a short read (400), a full tmpfs ``ENOSPC`` (507).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from server.api.errors import APIError, count, error_responses, json_ok
from server.api.models import json_response
from server.api.v2_repository import AUTH_ERRORS, BEARER, OPTIONAL_JSON_BODY, json_object, require_admin

SHM_DIR = Path("/dev/shm")
_KEY = re.compile(r"/[^/\x00]{1,254}")


@dataclass(frozen=True)
class Region:
    """A registered region: ``byte_size`` bytes from ``offset`` into the shared memory object ``key``."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    """Every read and write goes through it (closed when the region is dropped)."""

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check(self, offset: int, size: int, field: str) -> None:
        """A 400 naming ``field`` when ``size`` bytes from ``offset`` fall outside the region."""
        if offset + size > self.byte_size:
            raise APIError(
                400,
                f"{field}: {size} bytes from offset {offset} overrun shared memory region {self.name!r} "
                f"({self.byte_size} bytes)",
            )

    def read(self, offset: int, size: int, field: str) -> bytearray:
        """A copy of ``size`` bytes from ``offset`` into the region, or a 400 naming ``field`` when they fall outside
        it or past the end of the object as it is now."""
        self.check(offset, size, field)
        buf = bytearray(size)
        got = os.preadv(self.fd, [buf], self.offset + offset)
        if got != size:
            raise APIError(400, f"{field}: the shared memory object of region {self.name!r} shrank below it")
        return buf

    def write(self, offset: int, data: memoryview, field: str) -> None:
        """``data`` written from ``offset`` into the region; a 400 when the object shrank below it, a 507 when the
        file system holding the object has no room for its pages."""
        self.check(offset, len(data), field)
        start = self.offset + offset
        # Not grown back: an object its owner shrank is the owner's decision (a shrink after this check is not
        # harmful either: pwrite extends the file, where a mapping would fault).
        if os.fstat(self.fd).st_size < start + len(data):
            raise APIError(400, f"{field}: the shared memory object of region {self.name!r} shrank below it")
        try:
            written = os.pwrite(self.fd, data, start)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise APIError(
                    507, f"{field}: no room to write shared memory region {self.name!r}: {e.strerror}"
                ) from None
            raise APIError(400, f"{field}: cannot write shared memory region {self.name!r}: {e.strerror}") from None
        if written != len(data):
            raise APIError(507, f"{field}: only {written} of {len(data)} bytes fit shared memory region {self.name!r}")


def open_region(name: str, key: str, offset: int, byte_size: int) -> Region:
    """Map ``key`` and check that it holds ``byte_size`` bytes from ``offset``; a 400 naming the problem if not."""
    if not _KEY.fullmatch(key):
        raise APIError(400, f"key: expected a POSIX shared memory name such as '/input0', got {key!r}")
    path = SHM_DIR / key[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise APIError(400, f"key: cannot open shared memory {key!r}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise APIError(400, f"key: {key!r} is not a shared memory object")
        if offset + byte_size > info.st_size or byte_size == 0:
            raise APIError(
                400, f"byte_size: {byte_size} bytes from offset {offset} do not fit {key!r} ({info.st_size} bytes)"
            )
    except BaseException:
        os.close(fd)
        raise
    region = Region(name, key, offset, byte_size, fd)
    weakref.finalize(region, os.close, fd)
    return region


class Regions:
    """The registered regions, by name. Unregistering drops a region from the table; its descriptor is closed once
    no request still reads or writes it."""

    def __init__(self) -> None:
        self.regions: dict[str, Region] = {}
        self.generation = 0
        """Counts changes, so that the engine process knows when to tell its front-ends."""

    def register(self, name: str, body: dict[str, Any]) -> None:
        if name in self.regions:
            raise APIError(400, f"shared memory region {name!r} is already registered; unregister it first")
        key = body.get("key")
        if not isinstance(key, str):
            raise APIError(400, f"key: expected a string, got {key!r}")
        offset = count(body.get("offset", 0), "offset")
        byte_size = count(body.get("byte_size"), "byte_size")
        self.regions[name] = open_region(name, key, offset, byte_size)
        self.generation += 1

    def unregister(self, name: str | None) -> None:
        """Drop ``name`` (every region when None); a name not registered is not an error, as in Triton."""
        if name is None:
            self.regions.clear()
        else:
            self.regions.pop(name, None)
        self.generation += 1

    def status(self) -> list[dict[str, Any]]:
        return [r.status() for r in self.regions.values()]

    def get(self, name: object, field: str) -> Region:
        region = self.regions.get(name) if isinstance(name, str) else None
        if region is None:
            raise APIError(400, f"{field}: no shared memory region {name!r} is registered")
        return region

    def sync(self, listing: list[dict[str, Any]]) -> None:
        """Mirror the engine process's regions (a front-end's copy): open the new ones, drop the gone ones."""
        fresh: dict[str, Region] = {}
        for entry in listing:
            old = self.regions.get(entry["name"])
            if old is not None and old.status() == entry:
                fresh[old.name] = old
                continue
            try:
                fresh[entry["name"]] = open_region(entry["name"], entry["key"], entry["offset"], entry["byte_size"])
            except APIError:
                continue  # gone since the engine process mapped it: requests naming it fail as unregistered
        self.regions = fresh


@dataclass(frozen=True)
class Span:
    """Where a tensor lies in a region: ``size`` bytes from ``offset`` (checked against the region when made)."""

    region: Region
    offset: int
    size: int
    field: str

    def read(self) -> bytearray:
        """A copy of the span's bytes, read now."""
        return self.region.read(self.offset, self.size, self.field)

    def write(self, data: memoryview) -> None:
        self.region.write(self.offset, data, self.field)


RegionSource = Callable[[], Regions]
"""The regions a request may name, asked for only when it names one (the check behind it may refuse)."""


def span(regions: RegionSource | None, params: dict[str, Any], where: str) -> Span:
    """The span named by a tensor's ``shared_memory_*`` parameters (``where`` names them in errors)."""
    if "shared_memory_byte_size" not in params:
        raise APIError(400, f"{where}: shared_memory_region needs shared_memory_byte_size")
    if regions is None:
        raise APIError(400, f"{where}.shared_memory_region: shared memory is not served here")
    region = regions().get(params["shared_memory_region"], f"{where}.shared_memory_region")
    size = count(params["shared_memory_byte_size"], f"{where}.shared_memory_byte_size")
    offset = count(params.get("shared_memory_offset", 0), f"{where}.shared_memory_offset")
    region.check(offset, size, where)  # now, not after the forward; the object's size is checked on each use
    return Span(region, offset, size, where)


def regions_of(request: Request) -> Regions:
    found: Regions = request.app.state.shm
    return found


def authorised_regions(request: Request) -> Regions:
    """The registered regions, for a request that carries the admin token: a region is another client's memory, so
    reading it (as an input) or writing it (as an output) is for holders of the token that registered it."""
    try:
        require_admin(request)
    except APIError as e:
        raise APIError(
            e.status,
            f"shared_memory_region: using a shared memory region needs the admin token: {e.message}",
            e.headers,
        ) from None
    return regions_of(request)


# Endpoints ---------------------------------------------------------------------------------------------------------

router = APIRouter()

_LIST: dict[str, Any] = {"type": "array", "items": {"type": "object"}}
_STATUS = {
    **json_ok("The registered regions: name, key, offset, byte_size.", _LIST),
    **AUTH_ERRORS,
    **error_responses({404: "No region of that name is registered."}),
}
_CHANGE = {**json_ok("Done.", {"type": "object"}), **AUTH_ERRORS}


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
    responses=_CHANGE,
    dependencies=BEARER,
    openapi_extra=OPTIONAL_JSON_BODY,
)
async def system_register(region_name: str, request: Request) -> Response:
    """Map ``byte_size`` bytes from ``offset`` into the POSIX shared memory object ``key`` under ``region_name``."""
    require_admin(request)
    regions_of(request).register(region_name, await json_object(request))
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
