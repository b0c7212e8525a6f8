"""Synthetic photo-like pictures, seeded: what the JPEG draft measurement (``jpeg_draft.py``) and the image tests
decode. Numpy and Pillow only, no sibling imports, so a benchmark script (``import photos``) and the tests
(``from benchmarks.photos import photo``) both import it."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A photo-like RGB picture: smooth colour gradients, a dozen hard-edged discs and sensor-like noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([255 * x / width, 255 * y / height, 128 + 100 * np.sin(x / 97 + y / 53)], axis=-1)
    for _ in range(12):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(0.02, 0.2) * min(width, height)
        pixels[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 6, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def jpeg(image: Image.Image, quality: int = 90) -> bytes:
    """``image`` encoded as a JPEG of ``quality`` (a phone saves at about 90)."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
