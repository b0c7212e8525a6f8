"""The answers TorchServe's stock handlers give, for a model this server runs without a handler of its own (an
imported ``image_classifier``, ``object_detector`` or ``image_segmenter`` archive): ``/predictions/{model}`` answers
them, and so does KServe V1 to TorchServe's KServe envelope, as KServe's TorchServe predictor answers it.

A model with labels gives each row's top five classes after softmax, highest first, as ``{"label": probability}``
(``image_classifier``); one whose manifest declares an ``answer``, that shape (:mod:`halfserve.answershapes`); any
other, its output row as a list.
"""

from __future__ import annotations

import asyncio

import numpy as np
import orjson

from halfserve.api.dataplane.refusals import Refusal
from halfserve.api.errors import RefusedError
from halfserve.serving import ModelHandle

TOP_K = 5
"""Classes in a labelled answer: TorchServe's ``image_classifier`` default ``topk``."""
INLINE_VALUES = 1 << 16
"""Output values past which the answers are built in a worker thread: a segmentation of 21 classes at 224x224 (a
million values) took 13 ms of one core here, with its JSON; a detector's 100 boxes per image, well under one."""


def top_classes(row: np.ndarray, labels: list[str], k: int = TOP_K) -> dict[str, float]:
    """The ``k`` most probable classes of one output row after softmax, highest first (the first of equal ones), as
    ``{label: probability}``."""
    scores = row.astype(np.float64)
    exp = np.exp(scores - scores.max())
    probabilities = exp / exp.sum()
    order = np.argsort(-probabilities, kind="stable")[:k]
    return {labels[i]: float(probabilities[i]) for i in order}


async def stock_answers(served: ModelHandle, outputs: dict[str, np.ndarray]) -> list[bytes]:
    """Each row's answer as JSON, off the event loop where the outputs are large; a 500 naming the model where its
    outputs do not hold what its manifest's ``answer`` declares."""
    if sum(a.size for a in outputs.values()) <= INLINE_VALUES:
        return _answers(served, outputs)
    return await asyncio.to_thread(_answers, served, outputs)


def _answers(served: ModelHandle, outputs: dict[str, np.ndarray]) -> list[bytes]:
    manifest = served.manifest
    if manifest.answer is not None:
        try:
            shaped = manifest.answer.answers(outputs, manifest.labels)
        except ValueError as e:  # the model's outputs, not the request, are at fault
            raise RefusedError(Refusal.FAILED, f"model {served.name}: {e}") from None
        return [orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY) for a in shaped]
    out = outputs[manifest.outputs[0].name]
    if manifest.labels is not None and out.ndim == 2:
        return [orjson.dumps(top_classes(row, manifest.labels)) for row in out]
    # Each value as /predict and V2 write it (a float32's shortest form), a NaN or an infinity (overflow policy allow)
    # as null; ndim 1: a value per row.
    rows = out if out.ndim == 1 else out.reshape(len(out), -1)
    return [orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) for row in rows]
