"""The manifest's ``answer`` section: TorchServe's ``object_detector`` and ``image_segmenter`` answer shapes, checked
against the outputs at validation, and built from outputs as TorchServe's handlers build them."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from halfserve.answershapes import AnswerSection, detections, segmentation
from halfserve.manifest import Manifest

DETECTION_OUTPUTS = [
    {"name": "boxes", "shape": [3, 4]},
    {"name": "scores", "shape": [3]},
    {"name": "labels", "datatype": "INT64", "shape": [3]},
]


def manifest(outputs: list[dict[str, Any]], answer: dict[str, Any], labels: list[str] | None = None) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "m",
            "architecture": "small_cnn",
            "inputs": [{"name": "image", "shape": [3, 8, 8]}],
            "outputs": outputs,
            "labels": labels,
            "answer": answer,
        }
    )


def test_a_detection_answer_names_outputs_of_boxes_scores_and_labels() -> None:
    # Labels name the classes the labels output holds: any number of them, not the first output's last dimension.
    found = manifest(DETECTION_OUTPUTS, {"detections": {}}, ["cat", "dog"]).answer
    assert found is not None
    assert found.detections is not None
    assert found.detections.threshold == 0.5
    with pytest.raises(ValidationError, match=r"answer.detections.scores: 'score' names no output"):
        manifest(DETECTION_OUTPUTS, {"detections": {"scores": "score"}})
    boxes5 = [{"name": "boxes", "shape": [3, 5]}, *DETECTION_OUTPUTS[1:]]
    with pytest.raises(ValidationError, match=r"output 'boxes' has shape \[3, 5\], not \[N, 4\]"):
        manifest(boxes5, {"detections": {}})
    fewer = [*DETECTION_OUTPUTS[:2], {"name": "labels", "datatype": "INT64", "shape": [2]}]
    with pytest.raises(ValidationError, match="must hold the same number of detections"):
        manifest(fewer, {"detections": {}})
    flat = [{"name": "boxes", "shape": [12]}, *DETECTION_OUTPUTS[1:]]
    with pytest.raises(ValidationError, match=r"output 'boxes' has shape \[12\]; 2 dimensions expected"):
        manifest(flat, {"detections": {}})
    whole = [*DETECTION_OUTPUTS[:1], {"name": "scores", "datatype": "INT64", "shape": [3]}, DETECTION_OUTPUTS[2]]
    with pytest.raises(ValidationError, match="output 'scores' is INT64; a floating output expected"):
        manifest(whole, {"detections": {}})
    with pytest.raises(ValidationError, match="a handler's postprocess answers /predictions itself"):
        Manifest.model_validate(
            {**manifest(DETECTION_OUTPUTS, {"detections": {}}).model_dump(), "handler": {"code": "m:Handler"}}
        )
    with pytest.raises(ValidationError, match="threshold"):  # 0 would answer the padding
        manifest(DETECTION_OUTPUTS, {"detections": {"threshold": 0}})


def test_a_segmentation_answer_names_an_output_of_classes_by_height_by_width() -> None:
    out = [{"name": "out", "shape": [4, 8, 8]}]
    assert manifest(out, {"segmentation": {}}, ["a", "b", "c", "d"]).answer is not None
    with pytest.raises(ValidationError, match=r"labels has 3 entries but output 'out' has 4 classes"):
        manifest(out, {"segmentation": {}}, ["a", "b", "c"])
    with pytest.raises(ValidationError, match=r"output 'out' has shape \[4, 64\]; 3 dimensions expected"):
        manifest([{"name": "out", "shape": [4, 64]}], {"segmentation": {}})
    with pytest.raises(ValidationError, match="give one of detections or segmentation"):
        manifest(out, {})
    with pytest.raises(ValidationError, match="give one of detections or segmentation"):
        manifest(out, {"segmentation": {}, "detections": {}})


def test_detections_keep_scores_at_the_threshold_and_above_in_the_model_s_order() -> None:
    boxes = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    scores = np.array([[0.9, 0.5, 0.0], [0.2, 0.0, 0.0]], dtype=np.float32)
    classes = np.array([[1, 0, 0], [1, 0, 0]])
    out = {"boxes": boxes, "scores": scores, "labels": classes}
    spec = AnswerSection.model_validate({"detections": {}})
    assert spec.detections is not None
    assert detections(spec.detections, out, ["cat", "dog"]) == [
        [{"dog": [0.0, 1.0, 2.0, 3.0], "score": pytest.approx(0.9)}, {"cat": [4.0, 5.0, 6.0, 7.0], "score": 0.5}],
        [],
    ]
    # Without labels the class is its number as a string, as TorchServe's handler answers it.
    assert detections(spec.detections, out, None)[0][0] == {"1": [0.0, 1.0, 2.0, 3.0], "score": pytest.approx(0.9)}
    lower = AnswerSection.model_validate({"detections": {"threshold": 0.1}})
    assert [len(a) for a in lower.answers(out, None)] == [2, 1]


@pytest.mark.parametrize("bad", [7.0, -1.0, 0.5, float("nan")])
def test_a_class_that_is_not_one_of_the_labels_is_the_model_s_fault(bad: float) -> None:
    out = {
        "boxes": np.zeros((1, 1, 4), np.float32),
        "scores": np.ones((1, 1), np.float32),
        "labels": np.array([[bad]], np.float32),
    }
    with pytest.raises(ValueError, match="^output labels: "):
        AnswerSection.model_validate({"detections": {}}).answers(out, ["cat", "dog"])


def test_segmentation_answers_each_pixel_s_class_and_its_probability_after_softmax() -> None:
    rng = np.random.default_rng(0)
    out = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    answers = segmentation(out)
    got = np.array(answers)
    assert got.shape == (2, 4, 5, 2)
    assert got.dtype == np.float32  # as TorchServe computes it; JSON-able by orjson's numpy option
    exp = np.exp(out.astype(np.float64))
    probabilities = exp / exp.sum(1, keepdims=True)
    np.testing.assert_array_equal(got[..., 0], probabilities.argmax(1))
    np.testing.assert_allclose(got[..., 1], probabilities.max(1), rtol=1e-6)
    written = orjson.loads(orjson.dumps(answers[0], option=orjson.OPT_SERIALIZE_NUMPY))
    np.testing.assert_array_equal(np.array(written, np.float32), got[0])  # float32's shortest repr, read back exact
    with pytest.raises(ValueError, match="not finite"):
        segmentation(np.full((1, 2, 1, 1), np.nan, np.float32))
