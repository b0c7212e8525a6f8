"""TorchServe's ``ts.utils.util``: the label mapping helpers its handlers call."""

from __future__ import annotations

import json
import os
from typing import Any


def load_label_mapping(mapping_file_path: str) -> dict[str, Any] | None:
    """``index_to_name.json`` read as TorchServe reads it: ``None`` where the file is not there; values of
    ``[id, name]`` become the name, the last."""
    if not os.path.isfile(mapping_file_path):
        return None
    with open(mapping_file_path, encoding="utf-8") as f:
        mapping = json.load(f)
    if not isinstance(mapping, dict):
        raise ValueError("index_to_name.json: expected an object of class index to name")
    if not all(isinstance(v, (str, list)) for v in mapping.values()):
        raise ValueError("index_to_name.json: each value must be a name or a list of strings")
    if all(isinstance(v, list) and v for v in mapping.values()):
        mapping = {k: v[-1] for k, v in mapping.items()}
    return mapping


def map_class_to_label(
    probs: list[list[float]], mapping: dict[str, Any] | None = None, lbl_classes: list[list[int]] | None = None
) -> list[dict[str, float]]:
    """One ``{label: probability}`` per row, as TorchServe's: each class named by ``mapping``, else its index as a
    string."""
    if not isinstance(probs, list):
        raise TypeError("probs must be a list of rows")
    if lbl_classes is None:
        lbl_classes = [list(range(len(row))) for row in probs]
    results = []
    for row_classes, row_probs in zip(lbl_classes, probs, strict=True):
        results.append(
            {
                (mapping[str(index)] if mapping is not None else str(index)): prob
                for index, prob in zip(row_classes, row_probs, strict=True)
            }
        )
    return results
