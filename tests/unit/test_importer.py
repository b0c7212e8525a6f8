"""``halfserve import``: state dicts (wrapped, DataParallel-prefixed), safetensors files; pickled models refused; the
output signature derived; calibration samples stored and the agreement recorded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from halfserve import cli, fidelity, models, storage, store
from halfserve.importer import ImportFailure, derive_outputs, describe, import_model, read_state_dict
from halfserve.importflags import parse_tensor, with_format
from halfserve.manifest import DataType, InputFormat, Manifest, TensorSpec
from tests.conftest import HALF_FAILS

MLP = {"in_features": 6, "hidden": [8], "out_features": 4}
FEATURES = [TensorSpec(name="features", shape=[6])]
CPU = torch.device("cpu")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return models.build("mlp", **MLP)


def same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


def test_a_wrapped_data_parallel_state_dict_imports_as_the_next_version(tmp_path: Path) -> None:
    source = mlp()
    path = tmp_path / "weights.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}, "epoch": 3}, path)
    for version in (1, 2):
        result = import_model(path, tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
        assert result.version_dir == tmp_path / "store" / "net" / str(version)
    loaded = store.load(tmp_path / "store", "net")
    same_weights(loaded.module, source)
    assert [(t.name, t.datatype, t.shape) for t in loaded.manifest.outputs] == [("output", DataType.FP32, [4])]
    samples = fidelity.read_samples(result.version_dir, loaded.manifest)
    assert samples is not None
    assert samples.shape == (64, 6)
    evaluation = loaded.manifest.evaluation
    assert evaluation is not None
    assert evaluation["calibration_samples"] == 64
    assert 0.0 <= evaluation["bf16_top1_agreement"] <= 1.0
    assert evaluation["bf16_max_abs_error"] > 0  # bf16 is not fp32


def test_a_safetensors_file_and_given_calibration_samples(tmp_path: Path) -> None:
    source = mlp()
    save_file(source.state_dict(), str(tmp_path / "w.safetensors"))
    calibration = np.random.default_rng(1).standard_normal((10, 6)).astype(np.float32)
    np.save(tmp_path / "cal.npy", calibration)
    result = import_model(
        tmp_path / "w.safetensors",
        tmp_path / "store",
        "net",
        "mlp",
        FEATURES,
        [TensorSpec(name="logits", shape=[4])],
        arch_kwargs=MLP,
        calibration=tmp_path / "cal.npy",
        device=CPU,
    )
    assert result.fidelity is not None
    assert result.fidelity.samples == 10
    assert "10 samples from" in result.samples_from
    stored = fidelity.read_samples(result.version_dir, result.manifest)
    np.testing.assert_array_equal(stored, calibration)
    same_weights(store.load(tmp_path / "store", "net").module, source)


def test_the_report_says_a_bar_met_on_random_samples_is_not_met_on_your_data_and_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "w.pth"
    torch.save(mlp().state_dict(), path)
    random = import_model(path, tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)
    assert random.shortfall is None
    said = describe(random)
    assert "met on 64 random samples, not your data (give --calibration FILE to measure on real inputs), so " in said
    assert random.record is not None
    assert fidelity.caveat(random.record.fidelity) == (
        "measured on 64 random samples, not your data: import it again with --calibration FILE to measure it on real "
        "inputs"
    )
    np.save(tmp_path / "cal.npy", np.random.default_rng(1).standard_normal((10, 6)).astype(np.float32))
    given = import_model(
        path, tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP, calibration=tmp_path / "cal.npy", device=CPU
    )
    assert "fidelity bar (top-1 agreement >= 0.98, cosine >= 0.999, relative error <= 0.02): met, so " in describe(
        given
    )
    assert "random" not in describe(given)
    assert given.record is not None
    assert fidelity.caveat(given.record.fidelity) is None


def test_a_pickled_model_is_refused_with_how_to_save_a_state_dict(tmp_path: Path) -> None:
    torch.save(mlp(), tmp_path / "model.pt")
    with pytest.raises(ImportFailure, match=r"pickled model object.*torch\.save\(model\.state_dict\(\)"):
        read_state_dict(tmp_path / "model.pt")
    code = cli.main(
        ["import", str(tmp_path / "model.pt"), "--store", str(tmp_path / "s"), "--name", "n", "--architecture", "mlp"]
        + ["--input", "features:FP32:6"]
    )
    assert code == 2
    assert not (tmp_path / "s" / "n").exists(), "nothing written"


def test_weights_that_do_not_fit_name_the_tensors(tmp_path: Path) -> None:
    torch.save({"net.0.weight": torch.zeros(8, 6)}, tmp_path / "w.pth")
    with pytest.raises(storage.StoreError, match="missing: net.0.bias"):
        import_model(tmp_path / "w.pth", tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP, device=CPU)


class Heads(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor | None]:
        return {"sum": a + b, "argmax": (a - b).argmax(-1, keepdim=True), "loss": None}


def test_outputs_are_derived_from_one_forward_by_name_and_dtype() -> None:
    specs = [TensorSpec(name="a", shape=[3]), TensorSpec(name="b", shape=[3])]
    derived, dropped = derive_outputs(Heads(), specs)
    assert [(t.name, t.datatype, t.shape) for t in derived] == [
        ("sum", DataType.FP32, [3]),
        ("argmax", DataType.INT64, [1]),
    ]
    assert dropped == ["loss (None, not a tensor)"]


class LossBetween(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * 2, x.sum(), x[:, :2]


def test_a_tuples_outputs_are_derived_up_to_its_first_entry_the_server_cannot_batch() -> None:
    # The server takes a tuple's entries by position: after the loss, "output2" would be served the loss.
    (derived,), dropped = derive_outputs(LossBetween(), [TensorSpec(name="x", shape=[3])])
    assert (derived.name, derived.shape) == ("output0", [3])
    assert dropped == [
        "output1 (one value for 2 input rows, not one row per input row)",
        "output2 (after output1: a tuple's outputs are served by position)",
    ]


@models.register("test_value_per_row")
class ValuePerRow(nn.Module):
    """A regression head as teams write it: ``Linear(n, 1)`` squeezed to one value per row, ``[B]``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).squeeze(-1)


@models.register("test_scores_and_class")
class ScoresAndClass(nn.Module):
    """Class scores, the class index and an offset index (INT64, one value per row) beside them, and what no client
    can be served: a loss over the batch, a count, an int16 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        y = self.head(x)
        cls = y.argmax(-1)
        return {"logits": y, "cls": cls, "big": cls + 2**40, "loss": y.sum(), "n": 3, "small": cls.to(torch.int16)}


def test_a_value_per_row_output_imports_as_shape_empty_measured_by_relative_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.save(ValuePerRow().state_dict(), tmp_path / "w.pth")
    result = import_model(tmp_path / "w.pth", tmp_path / "store", "reg", "test_value_per_row", FEATURES, device=CPU)
    assert [(t.name, t.datatype, t.shape) for t in result.manifest.outputs] == [("output", DataType.FP32, [])]
    assert result.dropped == []
    f = result.fidelity
    assert f is not None
    assert (f.top1_agreement, f.min_cosine) == (None, None)
    assert f.max_rel_error is not None
    assert f.max_rel_error > 0  # bf16 is not fp32
    assert store.load(tmp_path / "store", "reg").manifest.outputs[0].shape == []  # its load's output check passes
    # Declared, it is spelled with nothing after the dtype.
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "store"), "--name", "reg", "--device", "cpu"]
    args += ["--architecture", "test_value_per_row", "--input", "features:FP32:6", "--output", "value:FP32:"]
    assert cli.main(args) == 0
    assert [(t.name, t.shape) for t in store.load(tmp_path / "store", "reg").manifest.outputs] == [("value", [])]


def test_every_output_of_a_row_each_is_kept_and_those_not_are_named_in_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    torch.save(ScoresAndClass().state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--device", "cpu"]
    assert cli.main([*args, "--architecture", "test_scores_and_class", "--input", "features:FP32:6"]) == 0
    manifest = store.load(tmp_path / "s", "n").manifest
    assert [(t.name, t.datatype, t.shape) for t in manifest.outputs] == [
        ("logits", DataType.FP32, [4]),
        ("cls", DataType.INT64, []),
        ("big", DataType.INT64, []),
    ]
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert warning == (
        "  WARNING: returned by the forward but not served (clients will not get it): "
        "loss (one value for 2 input rows, not one row per input row); n (int, not a tensor); "
        "small (dtype int16, not one the server returns (float32, float16, bfloat16, float64, int64, int32, uint8, "
        "bool): cast it in the forward)"
    )


def test_an_output_of_one_value_per_row_is_given_with_no_shape_and_an_input_never() -> None:
    value = parse_tensor("value:FP32:", "--output")
    assert (value.name, value.datatype, value.shape) == ("value", DataType.FP32, [])
    assert parse_tensor("cls:INT64:", "--output").shape == []
    with pytest.raises(ImportFailure, match=r"^--input 'x:FP32:': no shape; an input has sizes joined by x"):
        parse_tensor("x:FP32:", "--input")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("image:FP32:3x224x224", ("image", DataType.FP32, [3, 224, 224])),
        ("features:64", ("features", DataType.FP32, [64])),
        ("input_ids:int64:128", ("input_ids", DataType.INT64, [128])),
    ],
)
def test_tensor_options_parse(text: str, want: tuple[str, DataType, list[int]]) -> None:
    t = parse_tensor(text, "--input")
    assert (t.name, t.datatype, t.shape) == want


@pytest.mark.parametrize("text", ["image", "image:FP99:3", "image:FP32:3xa", "a:b:c:d", "image:FP32:0"])
def test_bad_tensor_options_are_named(text: str) -> None:
    with pytest.raises(ImportFailure, match=f"--input {text!r}"):
        parse_tensor(text, "--input")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        # Each had read Python's "invalid literal for int() with base 10: 'int64'" (or "''").
        ("y:INT64", "no shape after the dtype; expected NAME:DTYPE:SHAPE, e.g. image:FP32:3x224x224"),
        ("y:FP32:3x", "shape '3x': expected sizes joined by x, e.g. 3x224x224"),
        ("y::3", "dtype '': expected one of FP32, FP16, BF16, FP64, INT64"),
        # A typing slip had reached the probe forward: 5.8 GB allocated, or torch's "Overflow when unpacking long".
        ("y:FP32:30x30x30x30x30x30", "shape: [30, 30, 30, 30, 30, 30] is 729000000 values a sample, more than the"),
        ("y:FP32:999999999999999999999", "shape: [999999999999999999999] is 999999999999999999999 values a sample"),
    ],
)
def test_a_tensor_option_s_mistake_is_named_in_its_own_words(text: str, reason: str) -> None:
    with pytest.raises(ImportFailure) as e:
        parse_tensor(text, "--output")
    assert str(e.value).startswith(f"--output {text!r}: {reason}")


def test_a_folder_needs_a_hugging_face_architecture_and_a_file_needs_another(tmp_path: Path) -> None:
    with pytest.raises(ImportFailure, match="for a state dict, give its .pt, .pth or .safetensors file"):
        import_model(tmp_path, tmp_path / "store", "net", "mlp", FEATURES, arch_kwargs=MLP)
    (tmp_path / "w.pth").write_bytes(b"")
    with pytest.raises(ImportFailure, match="imports from a Hugging Face model folder"):
        import_model(tmp_path / "w.pth", tmp_path / "store", "net", "transformers:AutoModel", FEATURES)


def test_variable_inputs_need_a_max_length_and_get_their_mask() -> None:
    from halfserve.importer import sequence_inputs

    ids = parse_tensor("input_ids:INT64:-1", "--input")
    with pytest.raises(ImportFailure, match="give --max-length"):
        sequence_inputs([ids], None, None)
    with pytest.raises(ImportFailure, match="--mask needs an --input with a variable length"):
        sequence_inputs(FEATURES, None, "attention_mask")
    out = sequence_inputs([ids], 64, "attention_mask")
    assert [(t.name, t.shape, t.max_length, t.mask_for) for t in out] == [
        ("input_ids", [-1], 64, None),
        ("attention_mask", [-1], None, "input_ids"),
    ]


@pytest.mark.parametrize(
    ("shape", "datatype", "want"),
    [
        ([3, 224, 224], DataType.FP32, InputFormat.NCHW),
        ([1, 28, 28], DataType.FP32, InputFormat.NCHW),
        ([224, 224, 3], DataType.UINT8, InputFormat.NHWC),
        ([3, 8, 3], DataType.FP32, InputFormat.NONE),  # either way round
        ([5, 8, 8], DataType.FP32, InputFormat.NONE),  # no image's channel count
        ([3, 8, 8], DataType.INT64, InputFormat.NONE),  # token ids, not pixels
        ([3, 224], DataType.FP32, InputFormat.NONE),
        ([64], DataType.FP32, InputFormat.NONE),
    ],
)
def test_an_image_inputs_format_is_derived_only_where_its_shape_shows_it(
    shape: list[int], datatype: DataType, want: InputFormat
) -> None:
    assert TensorSpec(name="x", datatype=datatype, shape=shape).image_format is want
    declared = TensorSpec(name="x", shape=[3, 8, 3], format=InputFormat.NHWC)
    assert declared.image_format is InputFormat.NHWC
    assert declared.model_dump()["format"] == "FORMAT_NHWC"
    assert "format" not in TensorSpec(name="x", shape=shape).model_dump()  # unset, the manifest reads as before


def test_a_format_fits_an_image_input_only() -> None:
    with pytest.raises(ValueError, match=r"format FORMAT_NCHW needs three fixed per-sample dimensions.*\[16\]"):
        TensorSpec(name="x", shape=[16], format=InputFormat.NCHW)
    image = TensorSpec(name="image", shape=[3, 8, 8], format=InputFormat.NHWC)
    out = TensorSpec(name="y", shape=[4])
    with pytest.raises(ValueError, match="normalize takes channels first"):
        Manifest(name="m", architecture="mlp", inputs=[image], outputs=[out], normalize={"mean": [0.5] * 3})
    with pytest.raises(ValueError, match="format applies to inputs"):
        Manifest(name="m", architecture="mlp", inputs=[image], outputs=[image.model_copy(update={"name": "y"})])


def test_the_input_format_option_sets_the_image_inputs_layout() -> None:
    image, features = parse_tensor("image:FP32:3x8x3", "--input"), FEATURES[0]
    assert [t.format for t in with_format([image, features], "nhwc")] == [InputFormat.NHWC, None]
    assert with_format([image], "FORMAT_NCHW")[0].format is InputFormat.NCHW
    with pytest.raises(ImportFailure, match="--input-format: 'CHW' is not an input format; expected NCHW, NHWC or"):
        with_format([image], "CHW")
    with pytest.raises(ImportFailure, match=r"--input-format: no input has three fixed dimensions.*features \[6\]"):
        with_format(FEATURES, "NCHW")


@pytest.mark.parametrize("architecture", ["bert", "BertForSequenceClassification", "mlp", "torchvision:resnet18"])
def test_a_hugging_face_folder_with_another_architecture_is_told_which_to_use(
    tmp_path: Path, architecture: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["BertForSequenceClassification"], "model_type": "bert"}')
    args = ["import", str(folder), "--store", str(tmp_path / "s"), "--name", "n", "--architecture", architecture]
    assert cli.main([*args, "--input", "input_ids:INT64:16"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"--architecture {architecture!r} cannot build a Hugging Face model folder" in line
    assert "use --architecture transformers:AutoModelForSequenceClassification" in line
    assert "An architecture is 'transformers:<AutoClass>' for such a folder" in line
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("architecture", "message"),
    [
        ("bert", "manifest: architecture: unknown architecture 'bert'; expected a registered name ("),
        ("no such thing", "manifest: architecture: 'no such thing' is not an architecture; expected a registered"),
    ],
)
def test_an_unknown_architecture_is_one_line(
    tmp_path: Path, architecture: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(mlp().state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n"]
    assert cli.main([*args, "--architecture", architecture, "--input", "features:FP32:6"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"halfserve import: {message}")
    assert "transformers:<AutoClass>" in line
    assert "pydantic" not in line


def test_a_bad_tensor_name_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(mlp().state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--architecture", "mlp"]
    assert cli.main([*args, "--input", "9features:FP32:6"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("halfserve import: --input '9features:FP32:6': name: String should match pattern")


def test_an_input_shape_the_model_cannot_take_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(models.build("small_cnn").state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n"]
    assert cli.main([*args, "--architecture", "small_cnn", "--input", "image:FP32:32"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("halfserve import: --input image FP32 [32]: the model's forward fails on rows of it (")
    assert line.endswith("its first layer, features.0 (Conv2d), takes [1, N, N] per sample (channels, then size)")
    assert not (tmp_path / "s" / "n").exists()


def diverged_mlp() -> nn.Module:
    """An MLP whose finite weights overflow fp32 for every input: a training run that diverged."""
    module = mlp()
    with torch.no_grad():
        first, last = module.net[0], module.net[-1]
        first.weight.copy_(torch.tensor([[1e30], [-1e30]]).repeat(4, 6))  # one row of each pair passes the ReLU
        last.weight.fill_(1e30)
    return module


def test_a_model_whose_fp32_answers_are_all_not_finite_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(diverged_mlp().state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--architecture", "mlp"]
    assert cli.main([*args, "--arch-kwargs", json.dumps(MLP), "--input", "features:6", "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"halfserve import: {tmp_path / 'w.pth'}: in fp32 the model answers NaN or nothing finite for every one of "
        "the 64 random samples, so every answer would be NaN"
    )
    assert not (tmp_path / "s" / "n").exists()


def test_a_checkpoint_holding_a_nan_buffer_is_refused_naming_the_file_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = models.build("small_cnn", width=4).state_dict()
    state["features.1.running_var"][2] = float("nan")
    torch.save(state, tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n"]
    args += ["--architecture", "small_cnn", "--arch-kwargs", '{"width": 4}', "--input", "image:FP32:1x8x8"]
    assert cli.main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"halfserve import: {tmp_path / 'w.pth'}: buffer 'features.1.running_var' holds NaN or infinite values: the "
        "checkpoint is damaged (a training run that diverged?), and every answer would be NaN"
    )
    assert not (tmp_path / "s" / "n").exists()


def test_an_empty_state_dict_is_called_empty(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "empty.pth")
    with pytest.raises(ImportFailure, match=r"empty\.pth: an empty state dict \(no tensors\)"):
        read_state_dict(tmp_path / "empty.pth")


def test_a_hugging_face_model_class_is_told_its_auto_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["BertForSequenceClassification"], "model_type": "bert"}')
    args = ["import", str(folder), "--store", str(tmp_path / "s"), "--name", "n", "--input", "input_ids:INT64:16"]
    assert cli.main([*args, "--architecture", "transformers:BertForSequenceClassification"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("use --architecture transformers:AutoModelForSequenceClassification")
    assert "config.json:" not in line  # no file of the store, not written yet, is named as the culprit
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (
            ["logits:FP32:2"],
            "--output logits FP32 [2]: output 'logits' has rows of shape [4], declared [2]; the model's forward "
            "returns one tensor, rows of shape [4] float32 (for 2 rows)",
        ),
        (
            ["logits:INT64:4"],
            "--output logits INT64 [4]: output 'logits' is floating (float32), declared INT64 (integer)",
        ),
        (
            ["a:FP32:4", "b:FP32:4"],
            "--output a FP32 [4], b FP32 [4]: model returned one tensor; the manifest declares 2 outputs ['a', 'b']",
        ),
    ],
)
def test_outputs_the_forward_does_not_return_as_declared_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outputs: list[str], message: str
) -> None:
    torch.save(mlp().state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--architecture", "mlp"]
    args += ["--arch-kwargs", json.dumps(MLP), "--input", "features:FP32:6"]
    assert cli.main([*args, *(a for o in outputs for a in ("--output", o)), "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"halfserve import: {message}")
    assert line.endswith("declare what it returns, or leave --output out to derive it")
    assert not (tmp_path / "s").exists(), "nothing written"
    # Declared as the forward returns them, the same weights import.
    assert cli.main([*args, "--output", "logits:FP32:4", "--device", "cpu"]) == 0
    assert [t.shape for t in store.load(tmp_path / "s", "n").manifest.outputs] == [[4]]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ([], None),
        (["--strict"], "halfserve import: --strict: bf16 forward fails where fp32's does not: RuntimeError: "),
        (
            ["--fidelity", '{"check": false}'],
            "halfserve import: bf16 forward fails where fp32's does not: RuntimeError",
        ),
    ],
    ids=["served-in-fp32", "strict", "check-off"],
)
def test_a_model_whose_half_forward_raises_is_a_fidelity_failure_not_a_traceback(
    tmp_path: Path, half_fails_code: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str | None
) -> None:
    models.add_code_path([half_fails_code])
    torch.save(models.build(f"{HALF_FAILS}:build").state_dict(), tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--code-path"]
    args += [str(half_fails_code), "--architecture", f"{HALF_FAILS}:build", "--input", "ids:INT64:6"]
    args += ["--input", "keep:BOOL:6", "--device", "cpu", *flags]
    code = cli.main(args)
    out, err = capsys.readouterr()
    if said is None:
        assert code == 0
        assert "  WARNING: bf16 forward fails where fp32's does not: RuntimeError: " in out
        assert out.rstrip().endswith(": the server serves it in fp32")
        assert (tmp_path / "s" / "n" / "1" / "model.safetensors").is_file()
        assert not (tmp_path / "s" / "n" / "1" / "precision.json").exists()  # nothing measured: a load finds out
    else:
        assert code == 2
        (line,) = err.splitlines()
        assert line.startswith(said)
        assert not (tmp_path / "s" / "n").exists()


def test_a_forward_that_drops_the_batch_dimension_of_one_row_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "opcode_squeezed.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.l = nn.Linear(4, 2)\n\n    def forward(self, x):\n        return self.l(x).squeeze()\n\n\n"
        "def build():\n    return Net()\n"
    )
    torch.save({"l.weight": torch.randn(2, 4), "l.bias": torch.randn(2)}, tmp_path / "w.pth")
    args = ["import", str(tmp_path / "w.pth"), "--store", str(tmp_path / "s"), "--name", "n", "--code-path", str(code)]
    assert cli.main([*args, "--architecture", "opcode_squeezed:build", "--input", "x:4", "--device", "cpu"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("halfserve import: output 'output' has 2 rows for 1 input row, not one row per input row")
    assert line.endswith("keep the batch dimension (squeeze() drops it)")
    assert not (tmp_path / "s" / "n").exists()
