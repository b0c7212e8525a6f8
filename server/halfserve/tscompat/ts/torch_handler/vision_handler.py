"""TorchServe's ``VisionHandler``: each row's image bytes (or base64 text) opened with Pillow and put through
``image_processing``; without captum's explanations."""

from __future__ import annotations

import base64
from typing import Any

import torch

from halfserve.images import opened

from .base_handler import BaseHandler

MAX_PIXELS = 25_000_000
"""Most pixels (width times height, read from its header before decoding) an image may have: the server's default
``--max-image-pixels``."""
SETTING = "MAX_PIXELS of TorchServe's VisionHandler"
"""What a refusal names as setting :data:`MAX_PIXELS`: not the server's ``--max-image-pixels``, which it does not
follow."""


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
                # Any format Pillow decodes itself but EPS and ICO (images.in_process_formats), held to MAX_PIXELS,
                # and refused cut short rather than filled in grey.
                with opened(bytes(image), None, MAX_PIXELS, "data", SETTING) as picture:
                    images.append(self.image_processing(picture))
            else:
                images.append(torch.FloatTensor(image))
        return torch.stack(images).to(self.device)
