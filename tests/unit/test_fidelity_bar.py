"""The fidelity bar's pure pieces: which output is held to which measure, the bar a manifest sets over the default,
the shortfall's wording, and the server's switch from flag and environment."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from halfserve import fidelity
from halfserve.cli import build_parser
from halfserve.fidelity import DEFAULT_BAR, Fidelity, scores_output, shortfall
from halfserve.manifest import Manifest, Precision
from halfserve.settings import FidelityCheck, Settings


def manifest(outputs: list[dict[str, object]], **fields: object) -> Manifest:
    return Manifest.model_validate(
        {
            "name": "m",
            "architecture": "mlp",
            "inputs": [{"name": "x", "shape": [-1], "datatype": "INT64", "max_length": 8}],
            "outputs": outputs,
            **fields,
        }
    )


def test_class_scores_are_the_labelled_output_else_the_first_one_dimensional_floating_one() -> None:
    per_token = {"name": "tokens", "shape": [-1, 5]}
    scores = {"name": "scores", "shape": [5]}
    value = {"name": "value", "shape": [1]}
    assert scores_output(manifest([per_token, value, scores])) == "scores"
    assert scores_output(manifest([per_token, value])) is None  # per-token rows and a regression value
    assert scores_output(manifest([{"name": "ids", "shape": [5], "datatype": "INT64"}])) is None
    labelled = manifest([{"name": "logits", "shape": [2, 3]}, scores], labels=["a", "b", "c"])
    assert scores_output(labelled) == "logits"


def test_unlabelled_class_scores_are_held_to_cosine_too_labelled_ones_to_top1_alone() -> None:
    """Three values per row without labels may be a box, probabilities or a regression head read value by value: a
    top index that holds while the values are ruined (fp32 [0.31, 0.11, -0.11], served [0.66, -0.54, -0.40]) must not
    pass. A labelled classifier's user sees only its top class."""
    want = np.array([[0.31, 0.11, -0.11], [0.2, 0.5, 0.1]], np.float32)
    got = np.array([[0.66, -0.54, -0.40], [0.2, 0.5, 0.1]], np.float32)
    unlabelled = manifest([{"name": "y", "shape": [3]}])
    f = fidelity.compare(want, got, unlabelled, Precision.FP16)
    assert f.top1_agreement == 1.0
    assert f.min_cosine is not None
    assert f.min_cosine < 0.6
    reason = shortfall(f, DEFAULT_BAR)
    assert reason is not None
    assert "lowest cosine similarity with fp32 is" in reason
    assert "top-1" not in reason
    labelled = manifest([{"name": "y", "shape": [3]}], labels=["a", "b", "c"])
    f = fidelity.compare(want, got, labelled, Precision.FP16)
    assert (f.top1_agreement, f.min_cosine) == (1.0, None)
    assert shortfall(f, DEFAULT_BAR) is None


def test_integer_outputs_agree_only_where_every_value_is_fp32_s() -> None:
    """A model whose only output is its argmax (or a class id beside its scores) had passed unmeasured: a half
    precision computes such values from scores it rounded, and a changed id is a changed answer."""
    argmax_only = manifest([{"name": "cls", "shape": [], "datatype": "INT64"}])
    want = np.array([0, 1, 2, 1], np.int64)
    f = fidelity.compare(want, np.array([0, 2, 2, 1], np.int64), argmax_only, Precision.BF16)
    assert f.top1_agreement == 0.75
    reason = shortfall(f, DEFAULT_BAR)
    assert reason is not None
    assert "top-1 agreement with fp32 is 0.7500" in reason
    assert fidelity.compare(want, want.copy(), argmax_only, Precision.BF16).top1_agreement == 1.0
    both = manifest([{"name": "y", "shape": [2]}, {"name": "ids", "shape": [2], "datatype": "INT64"}])
    rows = np.dtype([("y", np.float32, (2,)), ("ids", np.int64, (2,))])
    want_rows = np.array([([1.0, 0.0], [0, 1]), ([0.0, 1.0], [1, 1])], rows)
    got_rows = want_rows.copy()
    got_rows["ids"][1] = [1, 0]  # the scores' top holds in both rows; the second row's ids do not
    f = fidelity.compare(want_rows, got_rows, both, Precision.BF16)
    assert f.top1_agreement == 0.5


def test_cosines_of_rows() -> None:
    w = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [3.0, 4.0], [1.0, 2.0]])
    g = np.array([[0.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [np.inf, 2.0]])
    np.testing.assert_allclose(fidelity._cosines(w, g), [0.0, 1.0, 1.0, 0.0, -1.0])


def test_scores_not_finite_in_one_precision_where_the_other_has_numbers_do_not_agree() -> None:
    """NaN's argmax is its first NaN's index: a half-precision row of NaNs agreed with every fp32 row whose top class
    was the first, as many as one in ten with ten classes."""
    scores = manifest([{"name": "scores", "shape": [3]}])
    nan, inf = math.nan, math.inf
    w = np.array([[3, 1, 2], [3, 1, 2], [nan, 1, 2], [nan, 1, 2], [inf, 1, 2], [0, 5, 1], [2, 0.5, -1e9]])
    g = np.array([[nan, nan, nan], [inf, 1, 2], [nan, 0, 3], [2, 1, 0], [inf, 0, 2], [0, 4, 1], [2, 0.5, -inf]])
    measured = fidelity.rows(w.astype(np.float32), g.astype(np.float32), scores)
    assert measured.top1 is not None
    # An infinity away from the top (a mask's -1e9, -inf in fp16) agrees; a NaN or an infinite top where the other
    # has a number does not.
    assert measured.top1.tolist() == [False, False, True, False, True, True, True]
    assert list(measured.abs_error[5:6]) == [1.0]
    assert measured.abs_error[:5].tolist() == [math.inf] * 5


def test_a_manifest_s_bar_overrides_the_default_field_by_field() -> None:
    plain = fidelity.bar(manifest([{"name": "y", "shape": [3]}]))
    assert plain.as_dict() == DEFAULT_BAR.as_dict()
    assert plain.origin("min_cosine") == "the default min_cosine"
    lowered = fidelity.bar(manifest([{"name": "y", "shape": [3]}], fidelity={"min_cosine": 0.9}))
    assert (lowered.min_top1_agreement, lowered.min_cosine, lowered.check) == (0.98, 0.9, True)
    assert lowered.origin("min_cosine") == "the manifest's fidelity.min_cosine"
    assert not fidelity.bar(manifest([{"name": "y", "shape": [3]}], fidelity={"check": False})).check


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"min_top1_agreement": 1.5}, "min_top1_agreement"),
        ({"min_cosine": -2}, "min_cosine"),
        ({"max_rel_error": -0.1}, "max_rel_error"),
        ({"min_agreement": 0.9}, "min_agreement"),
    ],
)
def test_a_wrong_fidelity_section_names_its_field(section: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        manifest([{"name": "y", "shape": [3]}], fidelity=section)


def test_the_shortfall_names_each_figure_its_bar_and_where_the_bar_comes_from() -> None:
    held_to = fidelity.bar(manifest([{"name": "y", "shape": [3]}], fidelity={"max_rel_error": 0.1}))
    measured = Fidelity(64, "fp16", 0.5, 3.0, 0.25, 0.99, "random")
    reason = shortfall(measured, held_to)
    assert reason == (
        "fp16 top-1 agreement with fp32 is 0.5000 on 64 random samples, below the default min_top1_agreement 0.98; "
        "lowest cosine similarity with fp32 is 0.990000 on 64 random samples, below the default min_cosine 0.999; "
        "largest relative error from fp32 is 0.25 on 64 random samples, above the manifest's fidelity.max_rel_error 0.1"
    )
    assert shortfall(Fidelity(64, "bf16", 0.99, 3.0, 0.01, 0.9999), held_to) is None
    assert shortfall(Fidelity(64, "bf16", None, math.inf, math.inf, None), held_to) is not None  # overflowed
    assert shortfall(Fidelity(64, "bf16", None, 1.0, None, math.nan), held_to) is not None


def test_the_server_s_switch_from_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().fidelity_bar is FidelityCheck.DEFAULT
    assert build_parser().parse_args(["serve", "--fidelity-bar", "off"]).fidelity_bar == "off"
    monkeypatch.setenv("HALFSERVE_FIDELITY_BAR", "off")
    assert Settings().fidelity_bar is FidelityCheck.OFF
    monkeypatch.setenv("HALFSERVE_FIDELITY_BAR", "sometimes")
    with pytest.raises(ValidationError, match="fidelity_bar"):
        Settings()


def test_answers_nan_or_not_finite_in_every_row_make_a_model_unanswerable() -> None:
    m = manifest([{"name": "y", "shape": [3]}])
    nan, inf = math.nan, math.inf
    everywhere = np.array([[nan, 1.0, 2.0], [nan, nan, nan], [inf, -inf, inf]], np.float32)
    why = fidelity.unanswerable(everywhere, m, fidelity.Source.RANDOM)
    assert why is not None
    assert why.startswith("in fp32 the model answers NaN or nothing finite for every one of the 3 random samples")
    assert why.endswith("if the model takes only some values, give calibration samples of its real inputs")
    calibrated = fidelity.unanswerable(everywhere, m, fidelity.Source.CALIBRATION)
    assert calibrated is not None
    assert "3 calibration samples" in calibrated
    assert "give calibration samples" not in calibrated
    # One row answered is the model's own range: a NaN for some inputs (a log of a negative one) is left to it.
    assert fidelity.unanswerable(np.vstack([everywhere, [[0.0, 1.0, 2.0]]]), m, fidelity.Source.RANDOM) is None
    # An infinity beside finite values may be by design (a mask's -inf).
    assert fidelity.unanswerable(np.array([[-inf, 1.0, 2.0]] * 4, np.float32), m, fidelity.Source.RANDOM) is None
