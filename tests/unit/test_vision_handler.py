"""TorchServe's ``VisionHandler`` (halfserve's compatibility copy): any format Pillow decodes itself is taken, as
TorchServe's is, but an image is held to the server's ``--max-image-pixels`` (from the context) and refused cut short,
as the server's own image path refuses them, and EPS (which Pillow reads by running Ghostscript) is not opened."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, UnidentifiedImageError

from halfserve import images, tscompat
from halfserve.tscompat.ts.torch_handler.image_classifier import ImageClassifier
from halfserve.tscompat.ts.torch_handler.vision_handler import MAX_PIXELS, VisionHandler
from tests.unit.test_images import (
    claiming,
    encoded,
    jpeg_without_its_data,
    many_scans,
    png_claiming,
    webp_of_no_image,
)


class Grey(VisionHandler):
    """A handler whose transform is the image's grey pixels, as floats."""

    def image_processing(self, image: Image.Image) -> torch.Tensor:  # type: ignore[override]
        return torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32))


def rows(*data: Any) -> list[dict[str, Any]]:
    return [{"data": d} for d in data]


def test_formats_other_than_the_server_s_three_are_decoded_as_torchserve_decodes_them() -> None:
    pixels = np.arange(64, dtype=np.uint8).reshape(8, 8)
    picture = Image.fromarray(pixels, mode="L")
    batch = Grey().preprocess(rows(encoded(picture, "BMP"), base64.b64encode(encoded(picture, "TIFF")).decode()))
    assert batch.shape == (2, 8, 8)
    assert torch.equal(batch[0], torch.from_numpy(pixels.astype(np.float32)))
    assert torch.equal(batch[1], batch[0])


def test_an_eps_file_is_not_handed_to_ghostscript() -> None:
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    with pytest.raises(UnidentifiedImageError, match="^data: not an image Pillow reads$"):  # Pillow's, as in TorchServe
        Grey().preprocess(rows(eps))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_header_claiming_more_than_the_default_pixels_is_refused_before_decoding(fmt: str) -> None:
    refusal = rf"^data: a 6000x6000 {fmt} image, more than the {MAX_PIXELS} pixels an image may have \(max_image_pixels"
    with pytest.raises(images.ImageTooLargeError, match=refusal):
        Grey().preprocess(rows(claiming(fmt, 6000, 6000)))


def initialized(max_image_pixels: int) -> Grey:
    handler = Grey()
    with tscompat.shadowing():  # the context the server gives a handler's initialize
        handler.initialize(tscompat.context("m", None, 1, max_image_pixels))
    return handler


def test_an_image_is_held_to_the_server_s_setting_the_context_gives() -> None:
    picture = encoded(Image.new("RGB", (300, 200)), "PNG")
    assert initialized(60_000).preprocess(rows(picture)).shape == (1, 200, 300)
    refusal = r"^data: a 300x200 PNG image, more than the 59999 pixels an image may have \(max_image_pixels\)$"
    with pytest.raises(images.ImageTooLargeError, match=refusal):
        initialized(59_999).preprocess(rows(picture))
    big = claiming("PNG", 6000, 6000)
    with pytest.raises(images.ImageTooLargeError, match="^data: a 6000x6000 PNG image"):
        initialized(MAX_PIXELS).preprocess(rows(big))
    with pytest.raises(images.ImageError, match="cut short or missing"):  # past the default, read up to its pixels
        initialized(40_000_000).preprocess(rows(big))


def test_a_claim_past_pillow_s_own_guard_is_refused_as_too_large() -> None:
    with pytest.raises(images.ImageTooLargeError, match="^data: an image of 3600000000 pixels, more than the"):
        Grey().preprocess(rows(png_claiming(60000, 60000)))


def mpo_without_its_data(width: int, height: int) -> bytes:
    """An MPO (a JPEG with another picture after it), cut after its first scan's header: Pillow opens it as MPO."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    data = buf.getvalue()
    scan = data.index(b"\xff\xda")
    cut = data[: scan + 2 + int.from_bytes(data[scan + 2 : scan + 4], "big")] + b"\xff\xd9"
    assert Image.open(io.BytesIO(cut)).format == "MPO"
    return cut


@pytest.mark.parametrize(
    "data",
    [jpeg_without_its_data(4000, 3000), png_claiming(4000, 4000), mpo_without_its_data(2000, 1500)],
    ids=["JPEG", "PNG", "MPO"],
)
def test_a_file_cut_short_is_refused_not_decoded_grey(data: bytes) -> None:
    with pytest.raises(images.ImageError, match="its image data is cut short or missing"):
        Grey().preprocess(rows(data))


def test_a_webp_of_next_to_no_image_is_refused_not_decoded() -> None:
    with pytest.raises(images.ImageError, match=r"^data: a 16383x1525 WEBP image in \d+ bytes, fewer than a photo's"):
        Grey().preprocess(rows(webp_of_no_image(animated=True)))


def test_a_jpeg_of_more_scans_than_a_photo_has_is_refused_before_decoding() -> None:
    with pytest.raises(images.ImageError, match="^data: a JPEG of 2000 scans; a photo has at most about 10"):
        Grey().preprocess(rows(many_scans(2000)))


def test_an_ico_is_not_opened_as_its_opening_decodes_what_it_holds() -> None:
    ico = encoded(Image.new("RGB", (32, 32)), "ICO")
    assert Image.open(io.BytesIO(ico)).format == "ICO"
    with pytest.raises(UnidentifiedImageError, match="^data: not an image Pillow reads$"):
        Grey().preprocess(rows(ico))


def test_an_image_classifier_of_fewer_classes_than_its_top_k_answers_every_class() -> None:
    handler = ImageClassifier()
    handler.mapping = {"0": "cat", "1": "dog", "2": "bird"}
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    answers = handler.postprocess(logits)  # torch.topk of 5 of 3 had raised: every request a 500
    assert [list(a) for a in answers] == [["dog", "bird", "cat"], ["cat", "dog", "bird"]]
    assert sum(answers[0].values()) == pytest.approx(1.0)


def test_a_jpeg_2000_of_next_to_no_image_is_refused_not_decoded() -> None:
    """Held to the PNG's bound, as every format but JPEG is: a 5000x5000 JPEG 2000 of one colour is 562 bytes, and
    took 0.6 s to decode; a GIF of as many flat pixels takes six times the bound, and a photo far more."""
    flat = encoded(Image.new("RGB", (5000, 5000)), "JPEG2000")
    with pytest.raises(images.ImageError, match=r"^data: a 5000x5000 JPEG2000 image in \d+ bytes, fewer than a photo"):
        Grey().preprocess(rows(flat))
    photo = np.random.default_rng(0).integers(0, 256, (48, 64), dtype=np.uint8)
    batch = Grey().preprocess(
        rows(encoded(Image.fromarray(photo), "JPEG2000"), encoded(Image.new("L", (64, 48)), "GIF"))
    )
    assert batch.shape == (2, 48, 64)
