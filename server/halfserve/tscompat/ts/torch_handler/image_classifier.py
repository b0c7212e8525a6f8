"""TorchServe's ``ImageClassifier``: its transforms (``Resize(256)``, ``CenterCrop(224)``, ``ToTensor()``,
``Normalize`` with ImageNet's mean and std) done with Pillow as the image section does them (no torchvision), and its
top-5 answer of labels and probabilities."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from halfserve import images
from halfserve.imageinput import ImageInput, ImagePreset

from ..utils.util import map_class_to_label
from .vision_handler import VisionHandler


class TorchServeTransforms:
    """TorchServe's ``image_classifier`` transforms: a Pillow image in, a float tensor of 3x224x224 out."""

    spec = ImageInput(input="data", feeds="input", **ImagePreset.TORCHSERVE.transforms)  # type: ignore[arg-type]

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(images.transform(image, self.spec))


class ImageClassifier(VisionHandler):
    """Softmax, then the ``topk`` most likely classes of each row (every class of a model of fewer, as the server's
    own ``image_classifier`` answers), named by ``index_to_name.json``."""

    topk = 5
    image_processing: Any = TorchServeTransforms()

    def set_max_result_classes(self, topk: int) -> None:
        self.topk = topk

    def get_max_result_classes(self) -> int:
        return self.topk

    def postprocess(self, data: torch.Tensor) -> list[Any]:
        ps = F.softmax(data, dim=1)
        probs, classes = torch.topk(ps, min(self.topk, ps.shape[1]), dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
