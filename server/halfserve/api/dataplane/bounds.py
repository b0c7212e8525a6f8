"""What one request may carry, whichever transport carried it: rows and values per request (``max_request_rows``,
by default the model's ``max_batch_size`` and never past its ``max_queue_rows``; ``max_request_elements``), values in
a JSON header (``max_json_values``, counted before it is parsed), and non-finite inputs (``allow_nonfinite_inputs`` in
the model's manifest).

Over a limit is an :class:`~halfserve.errors.OverLimitError` naming the field and the setting, a malformed or
non-finite input an :class:`~halfserve.errors.InvalidInputError`. The transports' own limits (a body's bytes, its
encoding, a deadline header) are theirs: :mod:`halfserve.api.http.limits`, :mod:`halfserve.api.grpc.grpc_limits`.
"""

from __future__ import annotations

import asyncio
import gc
import math
from contextvars import ContextVar
from typing import Any

import numpy as np
import orjson

from halfserve.errors import InvalidInputError, OverLimitError
from halfserve.execution import Batching
from halfserve.manifest import sample_values
from halfserve.serving import ModelHandle
from halfserve.settings import Settings

INLINE_BYTES = 1 << 20
"""Bodies up to this size are checked and parsed on the event loop; larger ones in a worker thread."""
MAX_TIMEOUT_US = 3_600_000_000
"""The longest a request may ask to wait for its rows to start, in microseconds (an hour, as ``request_timeout_ms``):
``parameters.timeout`` over HTTP or gRPC, and HTTP's ``X-Request-Timeout-Ms`` header, are held to it alike."""

JSON_LITERALS: ContextVar[bool] = ContextVar("halfserve_json_literals", default=True)
"""Whether the JSON body parsed for the request being answered (:func:`parse_json`) may hold a ``true`` or ``false``
(True where none was parsed): only then do the decoders of its numbers look for one among them
(:func:`halfserve.api.dataplane.codec.refuse_booleans`), since numpy reads one beside numbers as 1 or 0."""

_LITERALS = ((b"true", 2), (b"false", 3))
"""The JSON literals, each with the index of a letter that no JSON number holds and few keys do (``u``, ``s``)."""


_LITERALS_BY_NUMPY = 32 << 10
"""Bodies from this size are searched for literals with numpy, whose fixed cost (about 27 us on the 2-core EPYC) a
byte search of both literals (about 1 ns a byte) passes there."""


def holds_literals(body: bytes) -> bool:
    """Whether ``body`` holds the text ``true`` or ``false`` (in a string too: that only costs the exact look).

    A large body by numpy over its bytes: a pass for each literal's rare letter, then its neighbours at the few places
    found (0.4 ms for a JSON body of 4 MB of floats on the 2-core EPYC, beside 8 ms to parse it; a byte search takes 4
    ms, and a look at every value's type 3 ms)."""
    if len(body) < _LITERALS_BY_NUMPY:
        return b"true" in body or b"false" in body
    b = np.frombuffer(body, dtype=np.uint8)
    for word, at in _LITERALS:
        where = np.flatnonzero(b == word[at])
        where = where[(where >= at) & (where < len(b) - (len(word) - 1 - at))] - at
        if not where.size:
            continue
        found = np.ones(where.size, dtype=bool)
        for k, letter in enumerate(word):
            found &= b[where + k] == letter
        if found.any():
            return True
    return False


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
        raise OverLimitError(f"{field}: {rows} rows exceed the limit of {max_rows} per request ({setting})")
    elements = rows * sample_values(served.manifest)
    if elements > s.max_request_elements:
        raise OverLimitError(
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
    raise InvalidInputError(
        f"{field}: row {row} holds a NaN or infinite value (or one beyond the range of {x.dtype.name}); "
        f"model {served.name!r} does not accept them (allow_nonfinite_inputs)",
    )


async def parse_json(body: bytes, max_values: int, hint: str = "") -> Any:
    """Decode a JSON body, or fail with a 400 naming the problem, or a 413 when it holds more than ``max_values``
    values and containers (``max_json_values``), counted before anything is parsed.

    Counting is a few passes of ``bytes.count``, which no body can make expensive. Parsing is bounded by the count:
    with the default, 2^18 empty lists or 2^19 floats, each parsed in 20-45 ms on a 2-core AVX2 host with the
    collector paused. A body over 1 MiB is counted in slices in a worker thread, so the event loop gets the GIL
    between slices; orjson holds the GIL while it parses, which the count bounds. ``hint`` ends the refusal of
    malformed JSON (what to check).
    """
    if not body:
        raise InvalidInputError("body: empty; expected a JSON object")
    if len(body) <= INLINE_BYTES:
        payload, literals = _loads(body, max_values, hint)
    else:
        payload, literals = await asyncio.to_thread(_loads, body, max_values, hint)
    JSON_LITERALS.set(literals)  # in the request's own context: the worker thread's is a copy
    return payload


def _loads(body: bytes, max_values: int, hint: str) -> tuple[Any, bool]:
    found = 0
    # Every counted byte is one byte of the body, so a body no longer than the limit is under it without a count.
    for start in range(0, len(body) if len(body) > max_values else 0, INLINE_BYTES):
        end = start + INLINE_BYTES
        found += body.count(b",", start, end) + body.count(b"[", start, end) + body.count(b"{", start, end)
        if found > max_values:
            raise OverLimitError(
                f"body: JSON with more than {max_values} values and containers (max_json_values); send large tensors "
                "as binary data (binary tensor extension)",
            )
    # Every list and dict orjson builds is tracked by the cyclic collector, which otherwise runs over and over
    # during a parse of many containers (4x the parse's own time for 2M lists); nothing parsed can form a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body), holds_literals(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInputError(_malformed(body, e) + (f"; {hint}" if hint else "")) from None
    finally:
        if collecting:
            gc.enable()


def _malformed(body: bytes, e: orjson.JSONDecodeError) -> str:
    """Why ``body`` is not JSON: bytes that are not UTF-8 named by their offset, since orjson's position for them
    (line 1 column 1) is not where they are."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"body: not valid UTF-8 JSON (byte {u.start} of its {len(body)} is not UTF-8)"
    return f"body: malformed JSON ({e})"
