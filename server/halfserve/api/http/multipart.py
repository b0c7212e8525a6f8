"""``multipart/form-data`` bodies (RFC 7578), as ``curl -F data=@photo.jpg`` sends them: the parts' names and bytes.

The body is already read and held to ``max_body_bytes`` (:func:`~halfserve.api.http.limits.read_body`), so parsing it
is a few ``bytes.find`` calls over memory, counted part by part against the caller's limit; python-multipart, which
Starlette's streaming form parser needs, would add a dependency for what a bounded, in-memory body does not need
(spooling parts to disk, streaming callbacks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from halfserve.api.errors import APIError

MULTIPART = "multipart/form-data"
_BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(r';\s*name="([^"]*)"|;\s*name=([^\s;"]+)', re.IGNORECASE)
LONGEST_HEADERS = 8192
"""Most bytes of one part's headers: a client's form field has a line or two."""
SHOWN_NAME = 64
"""Most characters of a field's name an error message repeats."""


def shown(name: str) -> str:
    """A field's name as an error message shows it: cut to :data:`SHOWN_NAME` characters."""
    return name if len(name) <= SHOWN_NAME else name[:SHOWN_NAME] + "..."


@dataclass(frozen=True)
class Part:
    """A form field: its name and its bytes."""

    name: str
    data: bytes


def is_multipart(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == MULTIPART


def parts(body: bytes, content_type: str, most: int, setting: str) -> list[Part]:
    """The fields of a ``multipart/form-data`` ``body`` with that ``content_type``: a 400 for a body that is not
    one, a 413 naming ``setting`` past ``most`` fields (counted before the next is read)."""
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise APIError(400, f"Content-Type: {MULTIPART} without a boundary")
    delimiter = b"--" + (found.group(1) or found.group(2)).encode("latin-1")
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise APIError(400, f"body: not {MULTIPART}: no boundary line")
    fields: list[Part] = []
    at = start + len(delimiter)
    while True:
        if body.startswith(b"--", at):  # the closing delimiter
            return fields
        if not body.startswith(b"\r\n", at):
            raise APIError(400, f"body: form part {len(fields)}: malformed boundary line")
        if len(fields) == most:
            raise APIError(413, f"form: more than {most} fields in one request ({setting})")
        end = body.find(b"\r\n" + delimiter, at)
        if end < 0:
            raise APIError(400, f"body: form part {len(fields)}: no closing boundary (a truncated body?)")
        fields.append(_part(body[at + 2 : end], len(fields)))
        at = end + 2 + len(delimiter)


def _part(raw: bytes, index: int) -> Part:
    # A part with no headers at all starts with the blank line that ends them.
    split = -2 if raw.startswith(b"\r\n") else raw.find(b"\r\n\r\n", 0, LONGEST_HEADERS)
    if split == -1:
        raise APIError(400, f"body: form part {index}: no end to its headers within {LONGEST_HEADERS} bytes")
    name = None
    # Field names are UTF-8 (RFC 7578 4.2); one that is not is shown with replacement characters.
    for line in raw[: max(split, 0)].decode("utf-8", "replace").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-disposition":
            found = _NAME.search(value)
            if found is not None:
                name = found.group(1) if found.group(1) is not None else found.group(2)
    if name is None:
        raise APIError(400, f"body: form part {index}: no Content-Disposition with a name")
    return Part(name, raw[split + 4 :])
