"""``halfserve import --image``: the manifest's image section from the flags (a preset, flags over it), checked
against the input at import; ``--labels`` reads TorchServe's ``index_to_name.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from halfserve import cli, images
from halfserve.importer import ImportFailure
from halfserve.importflags import image_section, read_labels
from halfserve.manifest import TensorSpec, load_manifest
from tests.conftest import DIGITS_CNN_IMPORT, DIGITS_PHOTO

PIXELS = [TensorSpec(name="pixels", shape=[1, 8, 8])]
DIGITS_FLAGS = [*DIGITS_CNN_IMPORT, "--samples", "8"]


def test_a_preset_gives_torchserve_s_transforms_and_flags_override_them() -> None:
    section = image_section("image", PIXELS, "torchserve", crop="200x180", mean="0.5, 0.5,0.5", scale="1/127.5")
    assert section["input"] == "image"
    assert section["feeds"] == "pixels"
    assert section["resize"] == 256
    assert section["crop"] == [200, 180]
    assert section["mean"] == [0.5, 0.5, 0.5]
    assert section["std"] == [0.229, 0.224, 0.225]
    assert section["scale"] == pytest.approx(1 / 127.5)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"resize": "8x"}, "--image-resize '8x': expected a size"),
        ({"crop": "big"}, "--image-crop 'big': expected a size"),
        ({"scale": "1/0"}, "--image-scale '1/0': expected a number"),
        ({"mean": "0.5,x"}, "--image-mean 'x': expected a number"),
    ],
)
def test_bad_flags_name_themselves(given: dict[str, str], message: str) -> None:
    with pytest.raises(ImportFailure, match=message):
        image_section("image", PIXELS, **given)


def test_an_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ImportFailure, match="--image-preset 'keras': expected one of torchserve"):
        image_section("image", PIXELS, "keras")


def test_labels_from_torchserve_s_index_to_name(tmp_path: Path) -> None:
    path = tmp_path / "index_to_name.json"
    path.write_text(json.dumps({"1": ["n01443537", "goldfish"], "0": ["n01440764", "tench"]}))
    assert read_labels(path) == ["tench", "goldfish"]
    path.write_text(json.dumps({"0": "tabby", "1": "tiger cat"}))
    assert read_labels(path) == ["tabby", "tiger cat"]
    path.write_text(json.dumps({"0": "a", "2": "c"}))
    with pytest.raises(ImportFailure, match=r"classes 0 to 1 each need a name; missing \[1\]"):
        read_labels(path)
    path.write_text(json.dumps({"zero": "a"}))
    with pytest.raises(ImportFailure, match="key 'zero' is not a class index"):
        read_labels(path)
    path.write_text(json.dumps({"0": 3}))
    with pytest.raises(ImportFailure, match="class 0: expected a name"):
        read_labels(path)
    path.write_text("[")
    with pytest.raises(ImportFailure, match="not valid JSON"):
        read_labels(path)
    text = tmp_path / "labels.txt"
    text.write_text("zero\none\n")
    assert read_labels(text) == ["zero", "one"]


def test_import_writes_the_image_section_and_the_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "index_to_name.json"
    labels.write_text(json.dumps({str(i): ["id", f"digit {i}"] for i in range(10)}))
    flags = ["--name", "photo", *DIGITS_PHOTO]
    assert cli.main([*DIGITS_FLAGS, *flags, "--labels", str(labels), "--store", str(tmp_path)]) == 0
    manifest = load_manifest(tmp_path / "photo")
    assert manifest.labels == [f"digit {i}" for i in range(10)]
    assert manifest.image is not None
    assert (manifest.image.input, manifest.image.feeds, manifest.image.shape) == ("image", "pixels", [1, 8, 8])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--image", "image", "--image-preset", "torchserve"], "transforms give RGB pixels of shape [3, 224, 224]"),
        (["--image", "image", "--image-mode", "L", "--image-resize", "256"], "give crop, or resize as"),
        (["--image-mode", "L"], "--image-*: give --image NAME too"),
        (
            ["--image", "pixels", "--image-mode", "L", "--image-resize", "8x8"],
            "--image pixels: 'pixels' is also the tensor input's name (--input); photos and the tensor",
        ),
    ],
)
def test_import_refuses_transforms_that_do_not_fit_the_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert cli.main([*DIGITS_FLAGS, "--name", "photo", *flags, "--store", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "photo").exists()


def test_calibration_photos_go_through_the_image_section_as_requests_do(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (24, 40), dtype=np.uint8)).save(photos / f"{i}.png")
    flags = ["--name", "photo", "--image", "image", "--image-mode", "L", "--image-resize", "8x8"]
    assert cli.main([*DIGITS_FLAGS, *flags, "--calibration", str(photos), "--store", str(tmp_path / "s")]) == 0
    stored = load_file(str(tmp_path / "s" / "photo" / "1" / "calibration.safetensors"))["pixels"]
    manifest = load_manifest(tmp_path / "s" / "photo")
    assert manifest.image is not None
    files = sorted(photos.iterdir())
    want = images.decode_all([f.read_bytes() for f in files], manifest.image, 10**6, [f.name for f in files])
    np.testing.assert_array_equal(stored, want)
    (photos / "3.gif").write_bytes(b"GIF89a")
    code = cli.main([*DIGITS_FLAGS, *flags, "--calibration", str(photos), "--store", str(tmp_path / "t")])
    assert code == 2
