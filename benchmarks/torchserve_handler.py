"""TorchServe's ``image_classifier`` handler without torchvision, for ``torchserve_bench.py``.

The peers kit's TorchServe venv has no torchvision, which the stock handler imports. This handler does the same
transforms with Pillow and torch: ``Resize(256)`` (bilinear, antialiased: Pillow's own ``resize``, which torchvision
calls on a Pillow image), ``CenterCrop(224)`` (torchvision's offsets, ``int(round((side - 224) / 2))``), ``ToTensor``
and ImageNet's ``Normalize``, then the stock answer: softmax, top 5, labelled with ``index_to_name.json``.

The benchmark packs it into the ``.mar`` as ``image_classifier.py`` beside the manifest's ``"handler":
"image_classifier"``: TorchServe imports a handler name as a module from the model's folder before its own stock
handlers, so TorchServe runs this file, while ``halfserve import`` reads the same archive as the stock handler's.
TorchServe runs it in its own venv; it is not part of halfserve.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import map_class_to_label

RESIZE = 256
CROP = 224
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
TOPK = 5


def pixels(data: bytes) -> torch.Tensor:
    """One encoded image as the stock handler's transforms leave it: float32 3x224x224."""
    with Image.open(io.BytesIO(data)) as opened:
        image = opened.convert("RGB")
    w, h = image.size
    size = (RESIZE, int(RESIZE * h / w)) if w <= h else (int(RESIZE * w / h), RESIZE)
    if size != image.size:
        image = image.resize(size, Image.Resampling.BILINEAR)
    left, top = int(round((image.width - CROP) / 2.0)), int(round((image.height - CROP) / 2.0))
    image = image.crop((left, top, left + CROP, top + CROP))
    tensor = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (tensor - MEAN) / STD


class PillowImageClassifier(BaseHandler):  # type: ignore[misc]
    """The stock ``image_classifier``'s preprocess and postprocess, in Pillow and torch."""

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):  # base64, as the stock handler takes it
                image = base64.b64decode(image)
            images.append(pixels(bytes(image)))
        return torch.stack(images).to(self.device)

    def postprocess(self, data: torch.Tensor) -> list[Any]:
        ps = torch.nn.functional.softmax(data.float(), dim=1)
        probs, classes = torch.topk(ps, TOPK, dim=1)
        answer: list[Any] = map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
        return answer
