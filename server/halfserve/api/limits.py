"""What one request may ask of the server: body size, rows and values, how long it may wait, non-finite inputs.

Every refusal is a 4xx JSON error naming the field and the setting that decides it: 413 for a body, a row count or a
value count over its limit (``max_body_bytes`` and ``max_compression_ratio``, ``max_request_rows`` (by default the
model's ``max_batch_size``; never past its ``max_queue_rows``),
``max_request_elements``, and ``max_json_values`` for a JSON body, counted before it is parsed; a gzip or deflate
body counts decompressed), 400 for a malformed timeout header, a
compressed body that is not one whole stream, or a NaN / infinite input the model does not accept
(``allow_nonfinite_inputs`` in its manifest), 415 for a ``Content-Encoding`` other than identity, gzip or deflate.
"""

from __future__ import annotations

import asyncio
import gc
import math
import zlib
from contextvars import ContextVar
from typing import Any

import numpy as np
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import Scope

from halfserve import text
from halfserve.api.errors import APIError
from halfserve.manifest import Batching, sample_values
from halfserve.serving import AppState, ModelHandle
from halfserve.settings import Settings

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
"""A client's deadline in milliseconds: a request whose rows have not all started by then is answered 504."""

_TIMEOUT_KEY = TIMEOUT_HEADER.lower().encode()
MAX_TIMEOUT_MS = 3_600_000.0


def raw_header(request: Request, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), straight from the ASGI scope.

    On the inference routes this stands in for ``request.headers``, whose construction and mapping lookups cost
    more than a scan of the few raw headers a request carries.
    """
    return scope_header(request.scope, name)


def scope_header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in an ASGI scope."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


COMPRESSED_BYTES: ContextVar[int | None] = ContextVar("halfserve_compressed_bytes", default=None)
"""The compressed size of the body :func:`read_body` last inflated for the request being answered (None: it came
uncompressed): the text it carries is held to ``max_compression_ratio`` times it too, as tokenizing is work its
inflated bytes buy (a body's first MiB inflates freely, and 16 texts of 65,000 ``!`` gzip to about a kilobyte)."""


async def read_body(request: Request, limit: int, setting: str = "max_body_bytes") -> bytes:
    """The request body, decompressed when its ``Content-Encoding`` is gzip or deflate (as Triton and tritonclient's
    ``request_compression_algorithm`` do); a 413 once it is known to exceed ``limit`` (``max_body_bytes``), before
    reading it when the ``Content-Length`` header tells, and as it decompresses past the limit."""
    encoding = raw_header(request, b"content-encoding")
    codec = _codec(encoding)  # before reading: an unknown encoding is refused whatever the body
    declared = raw_header(request, b"content-length")
    # The HTTP server hands the app no more than Content-Length bytes, so a declared length over the limit is refused
    # before reading; a body without one (chunked) is counted as it arrives.
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"body: {declared.decode()} bytes exceed the limit of {limit} bytes ({setting})")
    COMPRESSED_BYTES.set(None)  # a connection's requests may share a context: none inherits another's
    text.CLIENT.set(request.client.host if request.client is not None else "")
    body = await _receive_body(request, limit, setting)
    if codec is None:
        return body
    assert encoding is not None
    COMPRESSED_BYTES.set(len(body))
    app: AppState = request.app.state.serving
    ratio = app.settings.max_compression_ratio
    if limit > (allowed := max(_FREE_INFLATE_BYTES, int(ratio * len(body)))):
        limit, setting = allowed, f"max_compression_ratio: {ratio:g} times its {len(body)} compressed bytes"
    if len(body) <= _INLINE_BYTES // 16:  # a small body inflates to little: not worth a thread hop
        return _decompress(body, codec, encoding.decode("latin-1"), limit, setting)
    # zlib lets go of the GIL while it inflates: in a worker thread, a body that inflates to max_body_bytes costs the
    # event loop nothing.
    return await asyncio.to_thread(_decompress, body, codec, encoding.decode("latin-1"), limit, setting)


async def _receive_body(request: Request, limit: int, setting: str) -> bytes:
    """The body's bytes as the server hands them over, refused past ``limit`` as they arrive.

    Read straight from the ASGI ``receive`` rather than through ``Request.stream``, whose async generator costs more
    than the one message a small body comes in; the body is left on the request as Starlette caches it, so a later
    ``request.body()`` returns it. A client gone before the body is complete raises :class:`ClientDisconnect`.
    """
    parts: list[bytes] = []
    received = 0
    more = True
    while more:
        message = await request.receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnect()
        part: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        received += len(part)
        if received > limit:
            raise APIError(413, f"body: more than {limit} bytes ({setting})")
        parts.append(part)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    request._body = body  # Starlette's cache of the body: request.body() answers from it
    return body


_INLINE_BYTES = 1 << 20
"""Bodies up to this size are checked and parsed on the event loop; larger ones in a worker thread."""
_FREE_INFLATE_BYTES = 1 << 20
"""What any compressed body may inflate to, whatever its ratio (a small JSON request compresses well)."""
"""Bodies up to this size are checked and parsed on the event loop; larger ones in a worker thread."""


async def parse_json(body: bytes, max_values: int) -> Any:
    """Decode a JSON body, or fail with a 400 naming the problem, or a 413 when it holds more than ``max_values``
    values and containers (``max_json_values``), counted before anything is parsed.

    Counting is a few passes of ``bytes.count``, which no body can make expensive. Parsing is bounded by the count:
    with the default, 2^18 empty lists or 2^19 floats, each parsed in 20-45 ms on a 2-core AVX2 host with the
    collector paused. A body over 1 MiB is counted in slices in a worker thread, so the event loop gets the GIL
    between slices; orjson holds the GIL while it parses, which the count bounds.
    """
    if not body:
        raise APIError(400, "body: empty; expected a JSON object")
    if len(body) <= _INLINE_BYTES:
        return _loads(body, max_values)
    return await asyncio.to_thread(_loads, body, max_values)


def _loads(body: bytes, max_values: int) -> Any:
    found = 0
    # Every counted byte is one byte of the body, so a body no longer than the limit is under it without a count.
    for start in range(0, len(body) if len(body) > max_values else 0, _INLINE_BYTES):
        end = start + _INLINE_BYTES
        found += body.count(b",", start, end) + body.count(b"[", start, end) + body.count(b"{", start, end)
        if found > max_values:
            raise APIError(
                413,
                f"body: JSON with more than {max_values} values and containers (max_json_values); send large tensors "
                "as binary data (binary tensor extension)",
            )
    # Every list and dict orjson builds is tracked by the cyclic collector, which otherwise runs over and over
    # during a parse of many containers (4x the parse's own time for 2M lists); nothing parsed can form a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"body: malformed JSON ({e})") from None
    finally:
        if collecting:
            gc.enable()


_CODECS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
"""zlib's ``wbits`` per ``Content-Encoding``: gzip's wrapper, or deflate's (which HTTP defines as zlib's format)."""


def _codec(encoding: bytes | None) -> int | None:
    """zlib's ``wbits`` for a ``Content-Encoding``, None for an uncompressed body, a 415 for any other encoding."""
    if encoding is None:
        return None
    name = encoding.strip().lower()
    if name in (b"", b"identity"):
        return None
    if name not in _CODECS:
        text = encoding.decode("latin-1")
        raise APIError(415, f"Content-Encoding: {text!r} is not supported; send identity, gzip or deflate")
    return _CODECS[name]


def _decompress(body: bytes, wbits: int, encoding: str, limit: int, setting: str) -> bytes:
    """``body`` decompressed, refused with a 413 as soon as it grows past ``limit`` (a small body can inflate a
    thousandfold) and with a 400 when it is not one whole stream of its encoding."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
        if len(out) <= limit and not d.eof:
            out += d.flush()
    except zlib.error as e:
        if wbits == zlib.MAX_WBITS:  # deflate sent raw, without zlib's header (some clients do)
            return _decompress(body, -zlib.MAX_WBITS, encoding, limit, setting)
        raise APIError(400, f"body: not valid {encoding} data (Content-Encoding: {encoding}): {e}") from None
    if len(out) > limit:
        raise APIError(413, f"body: decompresses to more than {limit} bytes ({setting})")
    if not d.eof or d.unused_data:
        what = "ends before its compressed stream does" if not d.eof else "has bytes after its compressed stream"
        raise APIError(400, f"body: {what} (Content-Encoding: {encoding})")
    return out


def row_limit(s: Settings, batching: Batching) -> tuple[int, str]:
    """Most rows one request to a model batched by ``batching`` may carry, and the setting that decides it."""
    if s.max_request_rows is None:
        return batching.max_batch_size, "the model's max_batch_size; max_request_rows"
    if s.max_request_rows <= batching.max_queue_rows:
        return s.max_request_rows, "max_request_rows"
    return batching.max_queue_rows, "the model's max_queue_rows"


def check_size(s: Settings, served: ModelHandle, rows: int, field: str) -> None:
    """Fail with a 413 naming ``field`` when ``rows`` samples are more than one request may carry."""
    max_rows, setting = row_limit(s, served.batching)
    if rows > max_rows:
        raise APIError(413, f"{field}: {rows} rows exceed the limit of {max_rows} per request ({setting})")
    elements = rows * sample_values(served.manifest)
    if elements > s.max_request_elements:
        raise APIError(
            413,
            f"{field}: {elements} input values exceed the limit of {s.max_request_elements} per request "
            "(max_request_elements)",
        )


def check_finite(x: np.ndarray, served: ModelHandle, field: str) -> None:
    """Fail with a 400 naming ``field`` and the first bad row when ``x`` holds NaN or infinite values the model does
    not accept."""
    if x.dtype.kind != "f" or served.manifest.allow_nonfinite_inputs:
        return
    # One reduction: the sum is finite when every value is (a sum overflowing from finite values goes on to the
    # exact check below).
    if math.isfinite(x.sum()):
        return
    finite = np.isfinite(x)
    if finite.all():
        return
    row = int(np.flatnonzero(~finite.reshape(x.shape[0], -1).all(axis=1))[0])
    raise APIError(
        400,
        f"{field}: row {row} holds a NaN or infinite value (or one beyond the range of {x.dtype.name}); "
        f"model {served.name!r} does not accept them (allow_nonfinite_inputs)",
    )


def client_timeout(request: Request) -> float | None:
    """The ``X-Request-Timeout-Ms`` header in seconds, ``None`` without one; a 400 when it is not a positive number
    of milliseconds."""
    raw = raw_header(request, _TIMEOUT_KEY)
    if raw is None:
        return None
    text = raw.decode("latin-1")
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_TIMEOUT_MS:  # also refuses NaN
        raise APIError(400, f"{TIMEOUT_HEADER}: expected milliseconds in (0, {MAX_TIMEOUT_MS:.0f}], got {text!r}")
    return ms / 1000.0
