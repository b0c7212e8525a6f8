"""``halfserve import`` holds its calibration photos (and those the JPEG draft check decodes) to the pixel limit a
request's photos are held to by default, read from the header before decoding; ``--max-image-pixels`` raises it as
``serve``'s flag does. A header claiming 65500x65500 is a few hundred bytes here, and a photo "just over" the limit
is one over a limit lowered for the test."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from halfserve import calibration, cli, draftcheck, store
from halfserve.api.dataplane.samples import decode_inputs
from halfserve.errors import OverLimitError
from halfserve.settings import MAX_IMAGE_PIXELS, MOST_IMAGE_PIXELS, Settings
from tests.conftest import DIGITS_CNN_IMPORT, DIGITS_PHOTO
from tests.unit.test_images import claiming, png_claiming
from tests.unit.test_photo_bytes import SERVED

PHOTO_MODEL = [*DIGITS_CNN_IMPORT, "--name", "photo", *DIGITS_PHOTO]
"""digits_cnn fed grey photos resized to 8x8 (an image section)."""
TENSOR_MODEL = [*DIGITS_CNN_IMPORT, "--name", "pixels"]
"""digits_cnn fed its 1x8x8 tensor: a folder of images is read into it without an image section."""


def photo(side: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(side)
    Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def folder_of(tmp_path: Path, **files: bytes) -> Path:
    """A calibration folder of two small photos and ``files`` (by name, ``_`` for ``.``)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.png").write_bytes(photo(12, "PNG"))
    (folder / "b.jpg").write_bytes(photo(12))
    for name, data in files.items():
        (folder / name.replace("_", ".")).write_bytes(data)
    return folder


def refused(capsys: pytest.CaptureFixture[str], model: list[str], folder: Path, store_dir: Path, *flags: str) -> str:
    assert cli.main([*model, "--calibration", str(folder), "--store", str(store_dir), *flags]) == 2
    assert not store_dir.exists() or not any(store_dir.iterdir())  # nothing written
    return capsys.readouterr().err


def test_the_import_s_limit_is_the_request_s_default_and_under_pillow_s_guard() -> None:
    assert Settings().max_image_pixels == MAX_IMAGE_PIXELS == 25_000_000
    assert Settings.model_fields["max_image_pixels"].metadata[-1].le == MOST_IMAGE_PIXELS == Image.MAX_IMAGE_PIXELS
    assert cli.build_parser().parse_args(DIGITS_CNN_IMPORT).max_image_pixels == MAX_IMAGE_PIXELS


@pytest.mark.parametrize("model", [PHOTO_MODEL, TENSOR_MODEL], ids=["image-section", "tensor-input"])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_header_claiming_65500x65500_is_refused_with_the_true_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: list[str], fmt: str
) -> None:
    huge = claiming(fmt, 65500, 65500)
    assert len(huge) < 2000
    folder = folder_of(tmp_path, **{f"huge_{fmt.lower()}": huge})
    err = refused(capsys, model, folder, tmp_path / "s")
    # Pillow refuses past twice its guard before the size is read: the pixels, and this limit, not sys.maxsize.
    assert (
        f"--calibration {folder}: huge.{fmt.lower()}: a {fmt} image of 4290250000 pixels, more than the 25000000 "
        "pixels an image may have (max_image_pixels); --max-image-pixels raises it (to at most 89478485)"
    ) in err


@pytest.mark.parametrize("draft", ["auto", "off"])
def test_a_real_photo_over_a_lowered_limit_is_refused_at_import_and_taken_at_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], draft: str
) -> None:
    # 40x40 is a JPEG draft decodes reduced (at least 32x32 for an 8x8 resize): with draft auto the draft check
    # decodes it first; with draft off only the calibration samples do.
    folder = folder_of(tmp_path, big_jpg=photo(40))
    err = refused(capsys, PHOTO_MODEL, folder, tmp_path / "s", "--image-draft", draft, "--max-image-pixels", "1599")
    assert f"--calibration {folder}: big.jpg: a 40x40 JPEG image, more than the 1599 pixels an image may have" in err
    flags = ["--image-draft", draft, "--max-image-pixels", "1600"]
    assert cli.main([*PHOTO_MODEL, "--calibration", str(folder), "--store", str(tmp_path / "t"), *flags]) == 0


def test_an_image_for_a_tensor_input_is_held_to_the_limit_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = folder_of(tmp_path, big_png=photo(40, "PNG"))
    err = refused(capsys, TENSOR_MODEL, folder, tmp_path / "s", "--max-image-pixels", "1599")
    assert f"--calibration {folder}: big.png: a 40x40 PNG image, more than the 1599 pixels" in err
    (folder / "big.png").write_bytes(png_claiming(300, 300))  # its header only: refused before decoding
    err = refused(capsys, TENSOR_MODEL, folder, tmp_path / "s", "--max-image-pixels", "1599")
    assert "big.png: a 300x300 PNG image, more than the 1599 pixels" in err
    (folder / "big.png").write_bytes(b"%PDF-1.4 not a photo")
    err = refused(capsys, TENSOR_MODEL, folder, tmp_path / "s")
    assert "big.png: a PDF file; calibration images are BMP, GIF, JPEG, PNG, TIFF, WEBP" in err
    (folder / "big.png").write_bytes(b"\x00" * 64)
    assert "big.png: not an image file;" in refused(capsys, TENSOR_MODEL, folder, tmp_path / "s")


def test_the_draft_check_holds_its_photos_to_the_limit(tmp_path: Path) -> None:
    folder = folder_of(tmp_path, big_jpg=photo(40))
    assert cli.main([*PHOTO_MODEL, "--calibration", str(folder), "--store", str(tmp_path / "s")]) == 0
    loaded = store.load(tmp_path / "s", "photo")
    assert draftcheck.measure(loaded, folder, 1600).photos == 1
    with pytest.raises(calibration.CalibrationError, match="big.jpg: a 40x40 JPEG image, more than the 1599 pixels"):
        draftcheck.measure(loaded, folder, 1599)


@pytest.mark.parametrize("given", ["0", str(MOST_IMAGE_PIXELS + 1)])
def test_a_limit_out_of_range_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    assert cli.main([*PHOTO_MODEL, "--max-image-pixels", given, "--store", str(tmp_path)]) == 2
    assert f"--max-image-pixels {given}: from 1 to {MOST_IMAGE_PIXELS}" in capsys.readouterr().err


async def test_a_request_s_photo_keeps_the_server_s_limit() -> None:
    over = claiming("JPEG", 5000, 5001)  # 25,005,000 pixels: a few hundred bytes
    with pytest.raises(
        OverLimitError, match=r"inputs\[0\]\.b64: a 5000x5001 JPEG image, more than the 25000000 pixels"
    ):
        await decode_inputs([{"b64": base64.b64encode(over).decode()}], SERVED, Settings())
    taken = await decode_inputs([{"b64": base64.b64encode(photo(40)).decode()}], SERVED, Settings())
    assert taken["pixels"].shape == (1, 1, 8, 8)
