"""``halfserve import`` chooses the image section's JPEG ``draft`` on the calibration photos (issue 51): the decision
on made-up measurements, and imports of real photos that turn it on, leave it off with the reason, or are told."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from benchmarks.photos import jpeg
from halfserve import cli, draftcheck, fidelity, images
from halfserve.draftcheck import Measured, decide
from halfserve.imagedraft import DraftReason
from halfserve.manifest import load_manifest
from tests.conftest import DIGITS_CNN_IMPORT, DIGITS_PHOTO

IMPORT = [*DIGITS_CNN_IMPORT, "--name", "photo", *DIGITS_PHOTO]
"""digits_cnn fed grey photos resized to exactly 8x8: draft decodes a JPEG of at least 32x32 reduced."""


def answers(top1: float | None = 1.0, cosine: float | None = None, rel: float | None = None) -> fidelity.Fidelity:
    return fidelity.Fidelity(8, "fp32", top1, 0.01, rel, cosine)


def test_draft_is_on_where_the_pixels_and_the_answers_agree() -> None:
    check = decide(Measured(10, 8, 0.2, 4.0, answers()), fidelity.DEFAULT_BAR)
    assert check.on
    assert check.reason is DraftReason.AGREES
    assert (check.photos, check.mean_levels, check.max_levels, check.top1_agreement) == (8, 0.2, 4.0, 1.0)
    assert check.detail.startswith("on: the 8 of 10 calibration photos")


@pytest.mark.parametrize(
    ("measured", "said"),
    [
        (Measured(10, 8, 0.2, 4.0, answers(top1=0.875)), "top-1 agreement 0.8750, below 0.98"),
        (Measured(10, 8, 1.5, 30.0, answers()), "the pixels differ by 1.5 levels on average, more than 1.0"),
        (Measured(10, 8, 0.2, 4.0, answers(None, cosine=0.99)), "lowest cosine similarity 0.990000, below 0.999"),
        (Measured(10, 8, 0.2, 4.0, answers(None, rel=0.5)), "largest relative error 0.5, above 0.02"),
    ],
)
def test_draft_is_off_where_the_pixels_or_the_answers_move_past_the_bar(measured: Measured, said: str) -> None:
    check = decide(measured, fidelity.DEFAULT_BAR)
    assert not check.on
    assert check.reason is DraftReason.DIFFERS
    assert said in check.detail


def test_the_manifest_s_bar_is_the_one_draft_is_held_to() -> None:
    lowered = dataclasses.replace(fidelity.DEFAULT_BAR, min_top1_agreement=0.8)
    assert decide(Measured(10, 8, 0.2, 4.0, answers(top1=0.875)), lowered).on


def test_draft_is_off_where_no_photo_is_large_enough_to_measure_on() -> None:
    check = decide(Measured(5, 0), fidelity.DEFAULT_BAR)
    assert (check.on, check.reason, check.photos) == (False, DraftReason.NO_LARGE_PHOTOS, 0)
    assert "none of the 5 calibration photos is a JPEG draft decodes reduced" in check.detail


def test_only_a_jpeg_s_header_is_read_for_its_size() -> None:
    photo = Image.new("L", (40, 30))
    assert images.jpeg_size(jpeg(photo)) == (40, 30)
    assert images.jpeg_size(b"\xff\xd8\xff\xe0 not a header") is None
    assert images.jpeg_size(b"\x89PNG\r\n\x1a\n") is None


def digit_photos(folder: Path, side: int, count: int = 6, fmt: str = "jpg") -> Path:
    """sklearn's first digits as grey photos of ``side`` x ``side`` pixels (upscaled, bicubic), JPEG quality 90."""
    folder.mkdir()
    for i, digit in enumerate(load_digits().images[:count]):
        image = Image.fromarray((digit * 255 / 16).astype(np.uint8)).resize((side, side), Image.Resampling.BICUBIC)
        image.save(folder / f"{i}.{fmt}", quality=90)
    return folder


def test_import_turns_draft_on_where_large_photos_keep_the_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photos = digit_photos(tmp_path / "photos", 256)
    assert cli.main([*IMPORT, "--calibration", str(photos), "--store", str(tmp_path / "s")]) == 0
    image = load_manifest(tmp_path / "s" / "photo").image
    assert image is not None
    assert image.draft
    check = image.draft_check
    assert check is not None
    assert (check.reason, check.photos, check.top1_agreement) == (DraftReason.AGREES, 6, 1.0)
    assert check.mean_levels is not None
    assert 0 < check.mean_levels <= draftcheck.MAX_MEAN_LEVELS  # decoded at an eighth of each side: close, not equal
    assert f"JPEG draft {check.detail}" in capsys.readouterr().out


def test_import_leaves_draft_off_with_the_reason_where_every_photo_is_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photos = digit_photos(tmp_path / "photos", 24, count=3)  # under 32x32: decoded whole, draft or not
    Image.new("L", (256, 256), 40).save(photos / "large.png")  # PNG has no reduced decoding
    assert cli.main([*IMPORT, "--calibration", str(photos), "--store", str(tmp_path / "s")]) == 0
    image = load_manifest(tmp_path / "s" / "photo").image
    assert image is not None
    assert image.draft_check is not None
    assert (image.draft, image.draft_check.reason, image.draft_check.photos) == (False, DraftReason.NO_LARGE_PHOTOS, 0)
    assert "JPEG draft off: none of the 4 calibration photos is a JPEG draft decodes reduced" in capsys.readouterr().out


def test_import_without_calibration_photos_leaves_draft_off_and_says_so(tmp_path: Path) -> None:
    assert cli.main([*IMPORT, "--samples", "4", "--store", str(tmp_path)]) == 0
    image = load_manifest(tmp_path / "photo").image
    assert image is not None
    assert image.draft_check is not None
    assert (image.draft, image.draft_check.reason) == (False, DraftReason.NO_PHOTOS)


@pytest.mark.parametrize("given", ["on", "off"])
def test_image_draft_on_or_off_is_kept_unmeasured(tmp_path: Path, given: str) -> None:
    photos = digit_photos(tmp_path / "photos", 24, count=2)
    store = tmp_path / "s"
    assert cli.main([*IMPORT, "--image-draft", given, "--calibration", str(photos), "--store", str(store)]) == 0
    image = load_manifest(store / "photo").image
    assert image is not None
    assert (image.draft, image.draft_check) == (given == "on", None)


def test_an_unknown_image_draft_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*IMPORT, "--image-draft", "yes", "--store", str(tmp_path)]) == 2
    assert "--image-draft 'yes': expected auto" in capsys.readouterr().err
    assert not (tmp_path / "photo").exists()
