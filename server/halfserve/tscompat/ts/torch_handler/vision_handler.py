"""TorchServe's ``VisionHandler``: each row's image bytes (or base64 text) opened with Pillow and put through
``image_processing``; without captum's explanations."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

from halfserve.images import opened

from .base_handler import BaseHandler

MAX_PIXELS = 25_000_000
"""Most pixels (width times height, read from its header before decoding) an image may have where the context does
not say (a handler whose ``initialize`` does not call ``BaseHandler``'s): the server's default
``--max-image-pixels``. The server gives its own setting as the context's ``max_image_pixels`` system property."""


class VisionHandler(BaseHandler):
    """The base of TorchServe's image handlers."""

    image_processing: Any = None

    def max_pixels(self) -> int:
        """The server's ``--max-image-pixels``, from the context ``initialize`` was given, else :data:`MAX_PIXELS`."""
        properties = self.context.system_properties if self.context is not None else {}
        return int(properties.get("max_image_pixels") or MAX_PIXELS)

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        images = []
        limit = self.max_pixels()
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):  # a KServe V1 instance's data, as TorchServe's KServe envelope hands it
                try:
                    image = base64.b64decode(image)
                except binascii.Error as e:  # its own message names neither the value nor base64
                    raise ValueError(f"data: not base64 ({e})") from None
            if isinstance(image, (bytearray, bytes)):
                # Any format Pillow decodes itself but EPS and ICO (images.in_process_formats), held to the server's
                # pixel limit, and refused cut short rather than filled in grey.
                with opened(bytes(image), None, limit, "data") as picture:
                    images.append(self.image_processing(picture))
            else:
                images.append(torch.FloatTensor(image))
        return torch.stack(images).to(self.device)
