"""The manifest's ``answer`` section: the answer shapes of TorchServe's ``object_detector`` and ``image_segmenter``
stock handlers, built from a model's outputs for ``/predictions`` (the V2 routes answer the tensors themselves).

* ``detections``: per image, a list of ``{"<label>": [x1, y1, x2, y2], "score": s}``, one per detection whose score
  is at least the threshold (TorchServe's 0.5 by default), in the model's order; the label is the manifest's
  ``labels`` entry for the class, or the class number as a string without labels. A model answers a batch, not a list
  of dicts as torchvision's detectors do: its ``boxes`` ``[B, N, 4]``, ``scores`` ``[B, N]`` and ``labels``
  ``[B, N]`` outputs hold at most the declared ``N`` detections per image, and an image with fewer has the rest
  padded with score 0 (a model may return fewer than ``N`` columns for a batch: the server pads them with zeros).
  The threshold is above 0, so padding never answers.
* ``segmentation``: per image, its ``[C, H, W]`` output's class per pixel after softmax over the classes, as
  TorchServe answers it: ``H`` rows of ``W`` pairs ``[class, probability]`` (the class as a number, as its handler
  stacks the two into one float tensor).

Torch-free and numpy-only: the manifest imports it, and the routes call it on the outputs they receive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from halfserve.declared import DeclaredTensor

SCORE_THRESHOLD = 0.5
"""TorchServe's ``object_detector`` threshold: detections scoring at least this answer."""


_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"


class Detections(BaseModel):
    """TorchServe's ``object_detector`` answer: the outputs it is built from, and the score threshold."""

    model_config = ConfigDict(extra="forbid")

    boxes: str = Field(default="boxes", pattern=_NAME)
    """The output of ``[N, 4]`` boxes per image, ``[x1, y1, x2, y2]`` in the input's pixels."""
    scores: str = Field(default="scores", pattern=_NAME)
    """The output of ``[N]`` scores per image (0 for padding)."""
    labels: str = Field(default="labels", pattern=_NAME)
    """The output of ``[N]`` class numbers per image (the manifest's ``labels`` name them)."""
    threshold: float = Field(default=SCORE_THRESHOLD, gt=0.0, le=1.0)
    """Detections scoring at least this answer; above 0, so the padding (score 0) never does."""


class Segmentation(BaseModel):
    """TorchServe's ``image_segmenter`` answer: the output of class scores per pixel it is built from."""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(default="out", pattern=_NAME)
    """The output of ``[C, H, W]`` class scores per image (torchvision's segmentation models name it ``out``)."""


class AnswerSection(BaseModel):
    """How ``/predictions`` answers: one of TorchServe's stock answer shapes (unset: classification's, or the
    output as a list)."""

    model_config = ConfigDict(extra="forbid")

    detections: Detections | None = None
    segmentation: Segmentation | None = None

    @model_validator(mode="after")
    def _one(self) -> AnswerSection:
        if (self.detections is None) == (self.segmentation is None):
            raise ValueError("give one of detections or segmentation")
        return self

    def check(self, outputs: Sequence[DeclaredTensor], labels: Sequence[str] | None) -> None:
        """Raise ``ValueError`` naming the field unless the outputs the section names exist with the shapes it
        reads."""
        by_name = {t.name: t for t in outputs}

        def output(field: str, name: str, dims: int, floating: bool) -> DeclaredTensor:
            t = by_name.get(name)
            if t is None:
                raise ValueError(f"answer.{field}: {name!r} names no output (outputs: {', '.join(by_name)})")
            if len(t.shape) != dims or t.shape[0] < 1:
                raise ValueError(f"answer.{field}: output {name!r} has shape {t.shape}; {dims} dimensions expected")
            if floating and t.datatype.numpy.kind != "f":
                raise ValueError(f"answer.{field}: output {name!r} is {t.datatype.value}; a floating output expected")
            return t

        if self.detections is not None:
            d = self.detections
            boxes = output("detections.boxes", d.boxes, 2, True)
            scores = output("detections.scores", d.scores, 1, True)
            classes = output("detections.labels", d.labels, 1, False)
            if boxes.shape[1] != 4:
                raise ValueError(f"answer.detections.boxes: output {d.boxes!r} has shape {boxes.shape}, not [N, 4]")
            if not boxes.shape[0] == scores.shape[0] == classes.shape[0]:
                raise ValueError(
                    f"answer.detections: boxes {boxes.shape}, scores {scores.shape} and labels {classes.shape} must "
                    "hold the same number of detections"
                )
        if self.segmentation is not None:
            out = output("segmentation.output", self.segmentation.output, 3, True)
            if labels is not None and len(labels) != out.shape[0]:
                raise ValueError(
                    f"labels has {len(labels)} entries but output {out.name!r} has {out.shape[0]} classes (its first "
                    "dimension)"
                )

    def answers(self, outputs: Mapping[str, np.ndarray], labels: Sequence[str] | None) -> list[Any]:
        """One answer per row of ``outputs`` (the batch's outputs by name), JSON-able by ``orjson`` with
        ``OPT_SERIALIZE_NUMPY`` (a segmentation's are arrays); ``ValueError`` where an
        output does not hold what the section declares (a class past the labels, a score that is not a number)."""
        if self.detections is not None:
            return detections(self.detections, outputs, labels)
        assert self.segmentation is not None  # one of the two, checked at construction
        return segmentation(outputs[self.segmentation.output])


def detections(
    spec: Detections, outputs: Mapping[str, np.ndarray], labels: Sequence[str] | None
) -> list[list[dict[str, Any]]]:
    """TorchServe's ``object_detector`` answers: per row, ``{label: [x1, y1, x2, y2], "score": s}`` for each detection
    whose score is at least the threshold, in the model's order."""
    boxes, scores, classes = outputs[spec.boxes], outputs[spec.scores], outputs[spec.labels]
    answers = []
    for row_boxes, row_scores, row_classes in zip(boxes, scores, classes, strict=True):
        kept = np.flatnonzero(row_scores >= spec.threshold)
        answer = []
        for i in kept:
            answer.append({_label(row_classes[i], labels): row_boxes[i].tolist(), "score": float(row_scores[i])})
        answers.append(answer)
    return answers


def _label(value: np.generic, labels: Sequence[str] | None) -> str:
    number = float(value)
    if not np.isfinite(number) or number != round(number) or number < 0:
        raise ValueError(f"output labels: {number!r} is not a class number")
    index = int(number)
    if labels is None:
        return str(index)
    if index >= len(labels):
        raise ValueError(f"output labels: class {index} is past the model's {len(labels)} labels")
    return labels[index]


def segmentation(out: np.ndarray) -> list[np.ndarray]:
    """TorchServe's ``image_segmenter`` answers: per row of ``[C, H, W]`` class scores, an ``[H, W, 2]`` float32 array
    of each pixel's ``[class, probability]``, its most probable class after softmax (the first of equal ones), as
    TorchServe answers it (JSON-able with ``orjson.OPT_SERIALIZE_NUMPY``).

    In float32, as TorchServe computes it; the best class's probability is ``1 / sum(exp(s - max))``, since its own
    term is ``exp(0)``: 7 ms for 21 classes of 224x224 on the 2-core host, where float64 and a second pass took 16
    (and ``tolist`` for the JSON 50 more)."""
    scores = out.astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        total = np.exp(scores - scores.max(axis=1, keepdims=True)).sum(axis=1)
        best = 1 / total
    if not np.isfinite(best).all():
        raise ValueError("output: class scores that are not finite numbers")
    pairs = np.stack([scores.argmax(axis=1).astype(np.float32), best], axis=-1)
    return list(pairs)
