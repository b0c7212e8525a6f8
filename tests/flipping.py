"""Damaging a file on disk the way a failing disk or a hostile edit would: one byte changed in place, the size kept,
so that only a check of the content (a digest, a loader's own) can tell."""

from __future__ import annotations

from pathlib import Path


def flipped(entry: Path) -> Path:
    """``entry`` with every bit of its middle byte inverted, written back in place; returned for use inline. The
    middle, not the start: a header a loader checks first would catch a flipped first byte without any digest."""
    data = bytearray(entry.read_bytes())
    assert data, f"{entry} is empty: nothing to flip"
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    return entry
