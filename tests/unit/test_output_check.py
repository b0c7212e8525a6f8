"""A forward's outputs against the declared ones: how many, each one's shape per row (fewer values along the first
dimension where the server pads them; any where it is variable), and floating, integer or boolean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from halfserve.manifest import DataType, Manifest, TensorSpec
from halfserve.outputcheck import InputMismatchError, OutputMismatchError, at_load, mismatch, returned
from halfserve.store import LoadedModel

ROWS = 2


def declaring(*outputs: TensorSpec) -> Manifest:
    """A manifest of ``outputs``, with a variable input where one of them is variable (it follows that input)."""
    variable = any(t.variable for t in outputs)
    x = (
        TensorSpec(name="x", datatype=DataType.INT64, shape=[-1], max_length=8)
        if variable
        else TensorSpec(name="x", shape=[4])
    )
    return Manifest(name="m", architecture="mlp", inputs=[x], outputs=list(outputs))


BOXES = TensorSpec(name="boxes", shape=[5, 4])
SCORES = TensorSpec(name="scores", shape=[5])


@pytest.mark.parametrize(
    ("y", "outputs"),
    [
        (torch.zeros(ROWS, 3), [TensorSpec(name="y", shape=[3])]),
        ((torch.zeros(ROWS, 3), torch.zeros(())), [TensorSpec(name="y", shape=[3])]),  # a loss after it: not served
        ({"boxes": torch.zeros(ROWS, 2, 4), "scores": torch.zeros(ROWS, 2)}, [BOXES, SCORES]),  # padded to 5 rows
        ({"tokens": torch.zeros(ROWS, 7, 3), "n": torch.zeros(ROWS, 1)}, [TensorSpec(name="tokens", shape=[-1, 3])]),
        (torch.zeros(ROWS, 1, dtype=torch.int32), [TensorSpec(name="y", datatype=DataType.INT64, shape=[1])]),
        (torch.zeros(ROWS, 1, dtype=torch.bool), [TensorSpec(name="y", datatype=DataType.BOOL, shape=[1])]),
        (torch.zeros(ROWS), [TensorSpec(name="y", shape=[])]),  # one value per row
        (
            {"logits": torch.zeros(ROWS, 3), "cls": torch.zeros(ROWS, dtype=torch.int64)},
            [TensorSpec(name="logits", shape=[3]), TensorSpec(name="cls", datatype=DataType.INT64, shape=[])],
        ),
    ],
)
def test_outputs_returned_as_declared_fit(y: object, outputs: list[TensorSpec]) -> None:
    assert mismatch(y, declaring(*outputs)) is None


@pytest.mark.parametrize(
    ("y", "outputs", "reason"),
    [
        (torch.zeros(ROWS), [TensorSpec(name="y", shape=[1])], "output 'y' has rows of shape [], declared [1]"),
        (torch.zeros(ROWS, 2), [TensorSpec(name="y", shape=[3])], "output 'y' has rows of shape [2], declared [3]"),
        (torch.zeros(ROWS, 1), [TensorSpec(name="y", shape=[])], "output 'y' has rows of shape [1], declared []"),
        (torch.zeros(3, 3), [TensorSpec(name="y", shape=[3])], "output 'y' has 3 rows for 2 input rows"),
        (torch.zeros(()), [TensorSpec(name="y", shape=[3])], "output 'y' has a scalar for 2 input rows"),
        (
            {"boxes": torch.zeros(ROWS, 6, 4), "scores": torch.zeros(ROWS, 6)},
            [BOXES, SCORES],
            "output 'boxes' has rows of shape [6, 4], declared [5, 4]",
        ),
        (
            torch.zeros(ROWS, 1, dtype=torch.int64),
            [TensorSpec(name="y", shape=[1])],
            "output 'y' is integer (int64), declared FP32 (floating)",
        ),
        (
            torch.zeros(ROWS, 1, dtype=torch.int64),
            [TensorSpec(name="y", datatype=DataType.BOOL, shape=[1])],
            "output 'y' is integer (int64), declared BOOL (boolean)",
        ),
        ({"a": torch.zeros(ROWS, 3)}, [TensorSpec(name="b", shape=[3])], "no output named 'b' (it returned ['a'])"),
        (
            (torch.zeros(ROWS, 3),),
            [TensorSpec(name="a", shape=[3]), TensorSpec(name="b", shape=[3])],
            "returned 1 values",
        ),
    ],
)
def test_outputs_not_returned_as_declared_are_named(y: object, outputs: list[TensorSpec], reason: str) -> None:
    got = mismatch(y, declaring(*outputs))
    assert got is not None
    assert reason in got


def test_what_a_forward_returned_is_told_tensor_by_tensor() -> None:
    y = {"logits": torch.zeros(ROWS, 3), "loss": torch.zeros(()), "extra": None}
    assert returned(y) == (
        "a mapping: logits rows of shape [3] float32, loss shape [] float32 (not one row per input row), extra NoneType"
    )
    assert returned(torch.zeros(ROWS, dtype=torch.int64)) == "one tensor, rows of shape [] int64"


class Squeezed(torch.nn.Module):
    """A forward that drops the batch dimension of a batch of one (``squeeze()``), as a team might ship it."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).squeeze()


def loaded_as(tmp_path: Path, module: torch.nn.Module, inputs: list[TensorSpec]) -> LoadedModel:
    manifest = Manifest(name="m", architecture="mlp", inputs=inputs, outputs=[TensorSpec(name="y", shape=[2])])
    return LoadedModel(manifest, 1, module.eval(), tmp_path / "m" / "1" / "model.safetensors")


def test_declared_inputs_the_model_cannot_take_fail_the_load_naming_the_manifest_and_inputs(tmp_path: Path) -> None:
    loaded = loaded_as(tmp_path, torch.nn.Linear(4, 2), [TensorSpec(name="x", shape=[5])])
    with pytest.raises(InputMismatchError) as caught:
        at_load(loaded)
    assert str(caught.value).startswith(
        f"{tmp_path / 'm' / 'config.json'}: inputs: the declared inputs (x FP32 [5]) did not run through the model "
        "(2 rows of zeros, fp32): RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )


def test_a_forward_that_drops_the_batch_dimension_of_one_row_fails_the_load_naming_the_manifest(
    tmp_path: Path,
) -> None:
    loaded = loaded_as(tmp_path, Squeezed(), [TensorSpec(name="x", shape=[4])])
    with pytest.raises(OutputMismatchError) as caught:
        at_load(loaded)
    assert str(caught.value) == (
        f"{tmp_path / 'm' / 'config.json'}: outputs: output 'y' has 2 rows for 1 input row, not one row per input "
        "row; the model's forward returns one tensor, shape [2] float32 (not one row per input row) (for 1 row): "
        "a batch of one (a lone request) must be answered with one row: keep the batch dimension (squeeze() drops it)"
    )
    at_load(loaded_as(tmp_path, torch.nn.Linear(4, 2), [TensorSpec(name="x", shape=[4])]))  # a forward that keeps it
