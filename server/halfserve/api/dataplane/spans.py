"""Where a request's tensors lie in the shared memory regions it names (Triton's system shared memory extension, whose
registration routes are :mod:`halfserve.api.http.shm`): an input read from a span, an output written into one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from halfserve.api.dataplane.refusals import count
from halfserve.errors import InvalidInputError
from halfserve.serving import SharedRegion, SharedRegions


@dataclass(frozen=True)
class Span:
    """Where a tensor lies in a region: ``size`` bytes from ``offset`` (checked against the region when made)."""

    region: SharedRegion
    offset: int
    size: int
    field: str

    def read(self) -> bytearray:
        """A copy of the span's bytes, read now."""
        return self.region.read(self.offset, self.size, self.field)

    def write(self, data: memoryview) -> None:
        self.region.write(self.offset, data, self.field)


RegionSource = Callable[[], SharedRegions]
"""The regions a request may name, asked for only when it names one (the check behind it may refuse)."""


def span(regions: RegionSource | None, params: dict[str, Any], where: str) -> Span:
    """The span named by a tensor's ``shared_memory_*`` parameters (``where`` names them in errors)."""
    if "shared_memory_byte_size" not in params:
        raise InvalidInputError(f"{where}: shared_memory_region needs shared_memory_byte_size")
    if regions is None:
        raise InvalidInputError(f"{where}.shared_memory_region: shared memory is not served here")
    region = regions().get(params["shared_memory_region"], f"{where}.shared_memory_region")
    size = count(params["shared_memory_byte_size"], f"{where}.shared_memory_byte_size")
    offset = count(params.get("shared_memory_offset", 0), f"{where}.shared_memory_offset")
    region.check(offset, size, where)  # now, not after the forward; the object's size is checked on each use
    return Span(region, offset, size, where)
