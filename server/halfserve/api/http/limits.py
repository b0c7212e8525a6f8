"""What one HTTP request may ask of the server: its body's size and encoding, how long it may wait.

Every refusal is a 4xx JSON error naming the field and the setting that decides it: 413 for a body over its limit
(``max_body_bytes`` and ``max_compression_ratio``; a gzip or deflate body counts decompressed), 400 for a malformed
timeout header or a compressed body that is not one whole stream, 415 for a ``Content-Encoding`` other than
identity, gzip or deflate. What a request may carry, whichever transport carried it (rows, values, non-finite
inputs), is the data plane's: :mod:`halfserve.api.dataplane.bounds`.
"""

from __future__ import annotations

import asyncio
import math
import re
import zlib
from collections.abc import Collection
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.types import Scope

from halfserve import text
from halfserve.api.dataplane.bounds import INLINE_BYTES, MAX_TIMEOUT_US, parse_json
from halfserve.api.dataplane.codec import COMPRESSED_BYTES
from halfserve.api.errors import APIError
from halfserve.errors import InvalidInputError
from halfserve.serving import AppState
from halfserve.settings import Settings

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
"""A client's deadline in milliseconds: a request whose rows have not all started by then is answered 504."""

_TIMEOUT_KEY = TIMEOUT_HEADER.lower().encode()
MAX_TIMEOUT_MS = MAX_TIMEOUT_US / 1000
_MILLISECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
"""A decimal number, as the header's value must be: no sign, exponent, underscore or name (``inf``)."""

TIMEOUT_PARAMETER: dict[str, Any] = {
    "name": TIMEOUT_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": int(MAX_TIMEOUT_MS)},
    "description": "Answer 504 if the request's rows have not all started within this many milliseconds.",
}
"""The timeout header in the OpenAPI schema of every inference route that reads it (:func:`client_timeout`)."""


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


async def read_fields(request: Request, settings: Settings, fields: Collection[str], hint: str) -> dict[str, Any]:
    """An inference route's JSON object body, held to ``max_body_bytes`` and ``max_json_values``: a 400 for anything
    but an object and for a key not among ``fields``, named (``hint`` says what the route reads): a misspelt field
    would otherwise be left out silently."""
    payload = await parse_json(await read_body(request, settings.max_body_bytes), settings.max_json_values)
    if not isinstance(payload, dict):
        raise InvalidInputError(f"body: expected a JSON object, got {type(payload).__name__}")
    for key in payload:
        if key not in fields:
            shown = orjson.dumps(key[:200]).decode()[1:-1]  # as the client wrote it, escapes and all
            raise InvalidInputError(f"{shown}: unexpected field; {hint}")
    return payload


def too_large_message(declared: str | None, limit: int, setting: str) -> str:
    """The 413 of a body past ``limit`` (named by ``setting``): of its ``declared`` length, or of one counted past the
    limit as it arrived (chunked), in one wording wherever it is refused (a route, or a front-end's relay)."""
    if declared is None:
        return f"body: more than {limit} bytes ({setting})"
    return f"body: {declared} bytes exceed the limit of {limit} bytes ({setting})"


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
        raise APIError(413, too_large_message(declared.decode(), limit, setting))
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
    if len(body) <= INLINE_BYTES // 16:  # a small body inflates to little: not worth a thread hop
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
            raise APIError(413, too_large_message(None, limit, setting))
        parts.append(part)
    body = parts[0] if len(parts) == 1 else b"".join(parts)
    request._body = body  # Starlette's cache of the body: request.body() answers from it
    return body


_FREE_INFLATE_BYTES = 1 << 20
"""What any compressed body may inflate to, whatever its ratio (a small JSON request compresses well)."""


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
    thousandfold) and with a 400 when it is not whole streams of its encoding. gzip's may be several members one after
    another (RFC 1952 section 2.2, as ``cat a.gz b.gz`` and block compressors make them), read as one body, the limit
    counted over all of them, and at most :data:`MAX_GZIP_MEMBERS`."""
    view = memoryview(body)
    parts: list[bytes] = []
    size = pos = members = 0
    while True:
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise APIError(400, f"body: more than {MAX_GZIP_MEMBERS} gzip members (Content-Encoding: {encoding})")
        d = zlib.decompressobj(wbits)
        try:
            while not d.eof:
                # At most a chunk at a time: what zlib keeps of the input after a member ends (unused_data) is then
                # one chunk at most, not a copy of the rest of the body per member.
                if d.unconsumed_tail:
                    chunk: bytes | memoryview = d.unconsumed_tail
                elif pos < len(view):
                    chunk, pos = view[pos : pos + _INFLATE_CHUNK], min(pos + _INFLATE_CHUNK, len(view))
                else:
                    break
                out = d.decompress(chunk, limit - size + 1)
                size += len(out)
                if size > limit:
                    raise APIError(413, f"body: decompresses to more than {limit} bytes ({setting})")
                parts.append(out)
        except zlib.error as e:
            if wbits == zlib.MAX_WBITS:  # deflate sent raw, without zlib's header (some clients do)
                return _decompress(body, -zlib.MAX_WBITS, encoding, limit, setting)
            raise APIError(400, f"body: not valid {encoding} data (Content-Encoding: {encoding}): {e}") from None
        if not d.eof:
            raise APIError(400, f"body: ends before its compressed stream does (Content-Encoding: {encoding})")
        pos -= len(d.unused_data)
        if pos == len(view):
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if wbits != _GZIP or view[pos : pos + 2] != _GZIP_MAGIC:
            raise APIError(400, f"body: has bytes after its compressed stream (Content-Encoding: {encoding})")


MAX_GZIP_MEMBERS = 4096
"""The most gzip members a body may be made of: a block compressor's 64 KiB blocks fill a 64 MiB body with 1,024,
and each member costs a decompressor of its own, whatever it holds (an empty one is 20 bytes)."""
_INFLATE_CHUNK = 1 << 16
_GZIP = 16 + zlib.MAX_WBITS
_GZIP_MAGIC = b"\x1f\x8b"
"""How every gzip member begins (RFC 1952 section 2.3.1)."""


def client_timeout(request: Request) -> float | None:
    """The ``X-Request-Timeout-Ms`` header in seconds, ``None`` without one; a 400 when it is not a positive number
    of milliseconds."""
    given = [bytes(value) for key, value in request.scope["headers"] if key == _TIMEOUT_KEY]
    if not given:
        return None
    if len(given) > 1:  # which one would be meant? A proxy's shorter deadline appended after the client's was lost
        raise APIError(400, f"{TIMEOUT_HEADER}: given {len(given)} times; send it once")
    raw = given[0]
    text = raw.decode("latin-1")
    ms = float(text) if _MILLISECONDS.fullmatch(text) else math.nan
    if not 0 < ms <= MAX_TIMEOUT_MS:  # also refuses NaN
        sent = raw[:100].decode("utf-8", "replace")  # as the client wrote it: UTF-8 read as Latin-1 was garbled
        raise APIError(400, f"{TIMEOUT_HEADER}: expected milliseconds in (0, {MAX_TIMEOUT_MS:.0f}], got {sent!r}")
    return ms / 1000.0
