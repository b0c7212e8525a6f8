"""Calibration samples of every input kind: ragged sequences (.npz with lengths, .jsonl), several named inputs, images
decoded and laid out as the manifest says; stored with each row's length and their source, read back at load as the
engine takes rows, and files written before lengths were kept still read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from halfserve import calibration, store
from halfserve.calibration import CalibrationError
from halfserve.manifest import DataType, Manifest, Normalize, TensorSpec

MAX = 12


def sequence_manifest(truncate: bool = False) -> Manifest:
    return Manifest(
        name="seq",
        architecture="mlp",
        inputs=[
            TensorSpec(name="ids", datatype=DataType.INT64, shape=[-1], max_length=MAX, truncate=truncate, pad=7),
            TensorSpec(name="mask", datatype=DataType.INT64, shape=[-1], mask_for="ids"),
            TensorSpec(name="extra", shape=[2]),
        ],
        outputs=[TensorSpec(name="y", shape=[3])],
    )


RAGGED = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


def test_ragged_npz_rows_are_stored_with_their_lengths_and_replayed_as_records(tmp_path: Path) -> None:
    padded = np.zeros((3, 6), np.int64)
    for i, row in enumerate(RAGGED):
        padded[i, : len(row)] = row
    extra = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.savez(tmp_path / "c.npz", ids=padded, extra=extra, **{"ids#length": np.array([3, 6, 1])})
    manifest = sequence_manifest()
    samples = calibration.read(tmp_path / "c.npz", manifest)
    assert samples.source == f"3 sequences from {tmp_path / 'c.npz'} (lengths 1..6)"
    samples.save(tmp_path)
    back = calibration.stored(tmp_path, manifest)
    assert back is not None
    assert back.source == samples.source
    assert calibration.source_of(tmp_path) == samples.source
    rows = back.rows(manifest)
    assert rows["ids#length"].tolist() == [3, 6, 1]
    assert rows["ids"][0].tolist() == [1, 2, 3] + [7] * (MAX - 3)  # padded with the input's pad value, not zeros
    assert rows["ids"][2].tolist() == [10] + [7] * (MAX - 1)
    np.testing.assert_array_equal(rows["extra"], extra)


def test_jsonl_samples_may_differ_in_length_and_name_several_inputs(tmp_path: Path) -> None:
    lines = [json.dumps({"ids": row, "extra": [i, -i]}) for i, row in enumerate(RAGGED)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n\n")
    samples = calibration.read(tmp_path / "c.jsonl", sequence_manifest())
    assert samples.source.startswith("3 sequences from")
    assert samples.source.endswith("(lengths 1..6)")
    assert samples.arrays["ids#length"].tolist() == [3, 6, 1]
    assert samples.arrays["ids"][1].tolist() == RAGGED[1]
    assert samples.arrays["extra"].tolist() == [[0, 0], [1, -1], [2, -2]]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"ids": [1, 2]}'], r"line 1: no 'extra' \(the model takes \['ids', 'extra'\]\)"),
        (['{"ids": [1], "extra": [1, 2], "other": 1}'], "line 1: 'other' is no input of the model"),
        (['{"ids": [1], "extra": [1, 2, 3]}'], r"sample 0 of 'extra' has shape \[3\], not \[2\]"),
        (["[1, 2]"], "line 1: expected an object by input name"),
        (["{nope"], "line 1: not JSON"),
    ],
)
def test_jsonl_samples_that_do_not_fit_are_named(tmp_path: Path, lines: list[str], message: str) -> None:
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    with pytest.raises(CalibrationError, match=message):
        calibration.read(tmp_path / "c.jsonl", sequence_manifest())


def test_a_sample_past_max_length_is_refused_unless_the_input_truncates(tmp_path: Path) -> None:
    lines = [json.dumps({"ids": list(range(MAX + 5)), "extra": [0, 0]}), json.dumps({"ids": [1], "extra": [0, 0]})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    with pytest.raises(CalibrationError, match=f"sample 0 of 'ids' is {MAX + 5} long, more than its max_length {MAX}"):
        calibration.read(tmp_path / "c.jsonl", sequence_manifest())
    cut = calibration.read(tmp_path / "c.jsonl", sequence_manifest(truncate=True))
    assert cut.arrays["ids#length"].tolist() == [MAX, 1]
    assert cut.arrays["ids"][0].tolist() == list(range(MAX))


def test_an_object_array_is_refused_rather_than_unpickled(tmp_path: Path) -> None:
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.arange(3), np.arange(5)
    np.savez(tmp_path / "c.npz", ids=ragged, extra=np.zeros((2, 2), np.float32))
    with pytest.raises(CalibrationError, match="object array .* unpickle it, which is refused.*'<name>#length'"):
        calibration.read(tmp_path / "c.npz", sequence_manifest())


def test_a_file_written_before_lengths_were_kept_still_reads(tmp_path: Path) -> None:
    manifest = sequence_manifest()
    save_file(
        {"ids": np.ones((4, 5), np.int64), "extra": np.zeros((4, 2), np.float32)},
        str(tmp_path / "calibration.safetensors"),
    )
    samples = calibration.stored(tmp_path, manifest)
    assert samples is not None
    assert samples.source == "4 samples from calibration.safetensors"
    assert calibration.source_of(tmp_path) == "calibration.safetensors"
    assert samples.rows(manifest)["ids#length"].tolist() == [5] * 4


def test_random_integer_samples_stay_within_the_models_first_embedding(tmp_path: Path) -> None:
    loaded = store.load(Path(__file__).parents[2] / "model_store", "digits_transformer")
    samples = calibration.at_load(loaded, 8)
    assert samples.random
    assert "random" in samples.source
    assert samples.arrays["tokens"].min() >= 0
    assert samples.arrays["tokens"].max() < 18


def test_random_token_ids_are_drawn_from_the_whole_vocabulary() -> None:
    import torch.nn as nn

    vocabulary = 1000
    module = nn.Sequential(nn.Embedding(vocabulary, 4), nn.Linear(4, 3))
    spec = TensorSpec(name="ids", datatype=DataType.INT64, shape=[-1], max_length=MAX)
    samples = calibration.random_samples([spec], 64, calibration.int_range(module))
    ids = samples.arrays["ids"]
    assert ids.min() >= 0
    assert ids.max() < vocabulary
    assert ids.max() >= calibration.INT_RANGE  # not only the first hundred ids
    assert f"integers in [0, {vocabulary})" in samples.source


def image_manifest(datatype: DataType, shape: list[int], normalize: Normalize | None = None) -> Manifest:
    return Manifest(
        name="img",
        architecture="mlp",
        inputs=[TensorSpec(name="image", datatype=datatype, shape=shape)],
        outputs=[TensorSpec(name="y", shape=[3])],
        normalize=normalize,
    )


def test_a_folder_of_images_is_decoded_to_the_inputs_size_layout_and_scale(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    pixels = np.zeros((8, 6, 3), np.uint8)
    pixels[..., 0], pixels[..., 2] = 255, 51  # a red-and-blue image, 6 wide and 8 high
    image.fromarray(pixels).save(tmp_path / "a.png")
    image.fromarray(pixels[..., 0], mode="L").save(tmp_path / "b.png")
    (tmp_path / "notes.txt").write_text("not an image")
    chw = calibration.read(tmp_path, image_manifest(DataType.FP32, [3, 4, 5]))
    x = chw.arrays["image"]
    assert x.shape == (2, 3, 4, 5)
    assert x.dtype == np.float32
    assert x[0, :, 0, 0] == pytest.approx([1.0, 0.0, 0.2])  # RGB, channels first, values / 255
    assert x[1, :, 0, 0] == pytest.approx([1.0, 1.0, 1.0])  # a grey image as RGB
    assert chw.source == f"images from {tmp_path} (2 files, RGB 5x4, pixel values / 255)"
    hwc = calibration.read(tmp_path, image_manifest(DataType.UINT8, [6, 5, 3]))
    assert hwc.arrays["image"].dtype == np.uint8
    assert hwc.arrays["image"][0, 0, 0].tolist() == [255, 0, 51]  # channels last, the bytes as they are
    norm = Normalize(scale=1 / 255, mean=[0.5], std=[0.5])
    grey = calibration.read(tmp_path, image_manifest(DataType.FP32, [1, 4, 5], norm))
    assert grey.arrays["image"][1, 0, 0, 0] == 255.0  # the server normalises on the device, as for requests
    with pytest.raises(CalibrationError, match="one image input"):
        calibration.read(tmp_path, sequence_manifest())
