"""TorchServe's ``VisionHandler``: each row's image bytes (or base64 text) opened with Pillow and put through
``image_processing``; without captum's explanations."""

from __future__ import annotations

import base64
import io
from typing import Any

import torch
from PIL import Image

from halfserve.images import cut_short

from .base_handler import BaseHandler

MAX_PIXELS = 25_000_000
"""Most pixels (width times height, read from its header before decoding) an image may have: the server's default
``--max-image-pixels``."""


class VisionHandler(BaseHandler):
    """The base of TorchServe's image handlers."""

    image_processing: Any = None

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):
                image = base64.b64decode(image)
            if isinstance(image, (bytearray, bytes)):
                opened = Image.open(io.BytesIO(image))
                if opened.width * opened.height > MAX_PIXELS:
                    raise ValueError(
                        f"image of {opened.width}x{opened.height} pixels, more than the {MAX_PIXELS} allowed"
                    )
                problem = cut_short(bytes(image), str(opened.format), opened.width, opened.height)
                if problem is not None:
                    raise ValueError(problem)
                images.append(self.image_processing(opened))
            else:
                images.append(torch.FloatTensor(image))
        return torch.stack(images).to(self.device)
