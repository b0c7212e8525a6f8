"""Images in: a model whose manifest has an ``image`` section (:class:`~halfserve.imageinput.ImageInput`) takes
encoded photos, decoded with Pillow and transformed into its input's pixels where the request is decoded (the HTTP
process, or each front-end).

What a request may make the server do is bounded before any pixel is decoded: only JPEG, PNG and WebP are opened
(recognised by their first bytes; every other format is refused by name, so Pillow's other decoders are never
reached from a request), an image's width and height are read from its header and refused past ``max_pixels`` (a
PNG of a few hundred bytes may claim 60000x60000), Pillow's own decompression-bomb guard stays on, and a truncated
file is an error rather than grey pixels. Decoding runs off the event loop on the tokenizing threads, in each
client's turn and behind the same bounded queue (:func:`halfserve.text.run_in_turn`).

The transforms are torchvision's on a Pillow image (``Resize`` calls Pillow's ``resize`` with the filter named;
``CenterCrop``'s offsets are ``int(round((h - crop) / 2.0))``), so a model trained with them sees the same pixels
without torchvision installed.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError

from halfserve import text
from halfserve.imageinput import DRAFT_MARGIN, ColorMode, ImageFormat, ImageInput, Interpolation, Layout


class ImageError(ValueError):
    """An image the model cannot take (its format, a broken file); the message names the field."""


class ImageTooLargeError(ImageError):
    """An image over the server's limits (pixels, images per request): a 413."""


class ImageBusyError(ImageError):
    """More requests wait to be decoded than the queue holds: a 503 with ``Retry-After``, as a full batch queue is."""


ACCEPTED = ", ".join(f.value for f in ImageFormat)
MAX_JPEG_SCANS = 100
"""Most scans a JPEG may have (libjpeg-turbo's advice, ``djpeg -maxscans``): a baseline photo has one, a progressive
one about 10. Each scan passes over the whole image's coefficients again, so a file of a few KB declaring thousands
costs a decoding thread minutes within the pixel limit."""
_JPEG_SCAN = b"\xff\xda"
"""The start-of-scan marker: in entropy-coded data 0xFF is always followed by 0x00 or a restart marker, so counting
this counts the scans."""
_AS_FORMAT = {"MPO": ImageFormat.JPEG.value}
"""Pillow's formats that are one of the server's in the checks of :func:`opened`: an MPO (a JPEG with more pictures
after it) is a JPEG."""
_BOMB_SIZE = re.compile(r"Image size \((\d+) pixels\)")
_ADDRESS = re.compile(r"<[^<>]* at 0x[0-9a-f]+>")

_SIGNATURES: list[tuple[bytes, str]] = [
    (b"\xff\xd8\xff", ImageFormat.JPEG.value),
    (b"\x89PNG\r\n\x1a\n", ImageFormat.PNG.value),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"BM", "BMP"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"qoif", "QOI"),
]
"""Leading bytes of the formats the server takes, and of those a client may send by mistake (named in the refusal)."""


def sniff(data: bytes) -> str | None:
    """The format ``data`` starts as (a :class:`ImageFormat` value when it is one the server takes), None when it is
    none known."""
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ImageFormat.WEBP.value
    if data[4:8] == b"ftyp":
        return "AVIF" if data[8:12] in (b"avif", b"avis") else "HEIF"
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml", b"<!doctype svg")):
        return "SVG"
    return None


_FILTERS = {
    Interpolation.NEAREST: Image.Resampling.NEAREST,
    Interpolation.BILINEAR: Image.Resampling.BILINEAR,
    Interpolation.BICUBIC: Image.Resampling.BICUBIC,
}


def resized_size(width: int, height: int, resize: int | list[int]) -> tuple[int, int]:
    """The ``(width, height)`` torchvision's ``Resize(resize)`` gives an image of ``width`` x ``height``: an integer is
    the shorter side, the longer ``int(resize * long / short)``; ``[height, width]`` is exact."""
    if isinstance(resize, list):
        return resize[1], resize[0]
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize


def crop_box(width: int, height: int, crop: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box (left, top, right, bottom) torchvision's ``CenterCrop`` keeps of a ``width`` x ``height`` image: its
    offsets ``int(round((side - crop) / 2.0))``, and where the crop is larger, the image centred in zeros as its
    padding puts it (``(crop - side) // 2`` before it); Pillow's ``crop`` fills what lies outside with zeros."""
    crop_h, crop_w = crop

    def start(side: int, want: int) -> int:
        return -((want - side) // 2) if want > side else int(round((side - want) / 2.0))

    left, top = start(width, crop_w), start(height, crop_h)
    return left, top, left + crop_w, top + crop_h


SIXTEEN_BIT = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})
"""Pillow's modes for a 16-bit grey PNG: its ``convert`` clips these to 255 (every value above is white), where a
photo's 16 bits scale onto 8 (``value >> 8``), as an 8-bit save of the same picture has them."""


def draft_size(resized: tuple[int, int]) -> tuple[int, int]:
    """The smallest ``(width, height)`` a JPEG whose resize gives ``resized`` (:func:`resized_size`) is decoded at
    under ``draft``: the margin (:data:`~halfserve.imageinput.DRAFT_MARGIN`) times it. libjpeg scales by 1/2, 1/4 or
    1/8 only, to no less than this on either side, so an image under twice it is decoded whole."""
    return DRAFT_MARGIN * resized[0], DRAFT_MARGIN * resized[1]


def drafted(width: int, height: int, resized: tuple[int, int]) -> bool:
    """Whether ``draft`` decodes a JPEG of ``width`` x ``height`` whose resize gives ``resized`` reduced: at least
    twice :func:`draft_size` on both sides, the least libjpeg's halving takes."""
    least = draft_size(resized)
    return width >= 2 * least[0] and height >= 2 * least[1]


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The ``(width, height)`` a JPEG's header declares, read without decoding; None for another format or a header
    Pillow does not read."""
    if sniff(data) != ImageFormat.JPEG.value:
        return None
    try:
        with Image.open(io.BytesIO(data), formats=[ImageFormat.JPEG.value]) as image:
            return image.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None


def transform(image: Image.Image, spec: ImageInput, resized: tuple[int, int] | None = None) -> np.ndarray:
    """A decoded image's pixels as ``spec`` declares them: float32 of shape ``spec.shape``. ``resized``: the size the
    resize gives the encoded image (:func:`resized_size`), where it was decoded reduced (``draft``): the resize is the
    one the full image would get; None: the one ``image`` gets."""
    if image.mode in SIXTEEN_BIT:
        image = Image.fromarray(np.right_shift(np.asarray(image).clip(0, 65535).astype(np.uint16), 8).astype(np.uint8))
    if image.mode != spec.mode.value:
        image = image.convert(spec.mode.value)
    if spec.resize is not None:
        size = resized or resized_size(image.width, image.height, spec.resize)
        if size != image.size:  # torchvision returns the image itself at its own size
            image = image.resize(size, _FILTERS[spec.interpolation])
    if spec.crop is not None:
        assert spec.size is not None
        box = crop_box(image.width, image.height, spec.size)
        if box != (0, 0, image.width, image.height):
            image = image.crop(box)
    pixels = np.asarray(image, dtype=np.float32)
    if spec.mode is ColorMode.L:
        pixels = pixels[:, :, None]
    pixels *= np.float32(spec.scale)
    if spec.mean is not None:
        pixels -= np.asarray(spec.mean, dtype=np.float32)
    if spec.std is not None:
        pixels /= np.asarray(spec.std, dtype=np.float32)
    if spec.layout is Layout.CHW:
        pixels = pixels.transpose(2, 0, 1)
    return np.ascontiguousarray(pixels)


def too_large(field: str, image: str, max_pixels: int, setting: str = "max_image_pixels") -> ImageTooLargeError:
    """The refusal of ``image`` (what it is: its size and format) for having more than ``max_pixels`` pixels (the
    ``setting`` named)."""
    return ImageTooLargeError(f"{field}: {image}, more than the {max_pixels} pixels an image may have ({setting})")


@contextlib.contextmanager
def opened(
    data: bytes, kind: str | None, max_pixels: int, field: str, setting: str = "max_image_pixels"
) -> Iterator[Image.Image]:
    """``data`` opened as a ``kind`` image (its header read, no pixel decoded), or :class:`ImageTooLargeError` naming
    ``field``, its size and ``max_pixels`` where it has more pixels than that: Pillow's own guard, which refuses past
    twice ``Image.MAX_IMAGE_PIXELS`` before the size can be read, is reported against ``max_pixels`` too. A file of
    fewer bytes than its pixels take (cut short, or a WebP of next to no image) is an :class:`ImageError`
    (:func:`cut_short`).

    ``setting`` is what sets ``max_pixels``, as a refusal names it. ``kind`` None opens any format Pillow decodes
    itself (:func:`in_process_formats`), as TorchServe's image handlers do, or is Pillow's ``UnidentifiedImageError``
    naming ``field``."""
    try:
        image = Image.open(io.BytesIO(data), formats=[kind] if kind is not None else in_process_formats())
    except UnidentifiedImageError:
        if kind is not None:
            raise
        # Pillow's error, as TorchServe's handlers raise it (a subclass may catch it), naming the field.
        raise UnidentifiedImageError(f"{field}: not an image Pillow reads") from None
    except Image.DecompressionBombError as e:
        size = _BOMB_SIZE.search(str(e))
        guard = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        pixels = int(size.group(1)) if size else guard + 1  # Pillow refuses only past its guard
        said = f"{f'a {kind}' if kind else 'an'} image of {pixels if size else f'over {guard}'} pixels"
        if pixels > max_pixels:
            raise too_large(field, said, max_pixels, setting) from None
        # Only where the caller's limit is above Pillow's guard: the guard is then what refused it, and is named.
        raise ImageTooLargeError(
            f"{field}: {said}, more than Pillow's decompression-bomb guard takes ({guard})"
        ) from None
    kind = kind or _AS_FORMAT.get(str(image.format), str(image.format))
    with image:
        if kind == ImageFormat.JPEG.value and (scans := data.count(_JPEG_SCAN)) > MAX_JPEG_SCANS:
            raise ImageError(
                f"{field}: a JPEG of {scans} scans; a photo has at most about 10 (the server decodes {MAX_JPEG_SCANS})"
            )
        width, height = image.size
        if width * height > max_pixels:
            raise too_large(field, f"a {width}x{height} {kind} image", max_pixels, setting)
        problem = cut_short(data, kind, width, height)
        if problem is not None:
            raise ImageError(f"{field}: {problem}")
        yield image


@functools.cache
def in_process_formats() -> tuple[str, ...]:
    """Every format Pillow opens but EPS, which it reads by running Ghostscript on the file, and ICO, whose opening
    decodes an image its directory may say is 16x16 (up to Pillow's guard, 179 megapixels) before its size can be
    checked."""
    Image.init()
    return tuple(name for name in Image.OPEN if name not in ("EPS", "ICO"))


JPEG_PIXELS_PER_BYTE = 2048
"""A Huffman-coded JPEG codes each 8x8 block of its full-resolution component in one bit at least (the code of its DC
difference), so W x H pixels take W*H/512 bytes at least; this allows four times fewer, for any sampling layout."""
PNG_INFLATION = 1032
"""deflate's most: no zlib stream inflates to more than 1,032 times its size."""
_ARITHMETIC_SOF = re.compile(rb"\xff[\xc9\xca\xcb\xcd\xce\xcf]")
"""The frame headers of arithmetic-coded JPEGs, which can code a block in less than a bit: not held to the bound."""


def cut_short(data: bytes, kind: str, width: int, height: int) -> str | None:
    """Why ``data``, a ``kind`` image whose header says ``width`` x ``height``, holds too few bytes for its pixels to
    be in it, or None. Such a file ends its image data early (or holds none): libjpeg and Pillow's PNG reader fill
    the rest in grey, with no error, so a few hundred bytes would be served as a 24-megapixel grey photo. Checked from
    the header, before anything is decoded.

    libwebp refuses a WebP cut short itself, but the format has no floor: lossless WebP codes a one-colour image of
    any size in a few dozen bytes, and an animation's first frame (what is decoded, onto its whole canvas) may be
    smaller than the canvas. A WebP is held to the PNG's bound, over the whole file: no photo, at any quality, comes
    near it (docs/images.md); a one-colour one may be refused, holding next to none of its image. So is every other
    format TorchServe's ``VisionHandler`` opens (a 562-byte JPEG 2000 of 5000x5000 took 0.6 s to decode; a flat GIF or
    deflated TIFF of as many pixels takes six to forty times the bound)."""
    if kind == ImageFormat.JPEG.value:
        least = width * height // JPEG_PIXELS_PER_BYTE
    else:
        least = height * (1 + (width + 7) // 8) // PNG_INFLATION  # its rows at one bit a pixel, each with its filter
    if len(data) >= least or (kind == ImageFormat.JPEG.value and _ARITHMETIC_SOF.search(data)):
        return None
    said = f"a {width}x{height} {kind} image in {len(data)} bytes"
    if kind not in (ImageFormat.JPEG.value, ImageFormat.PNG.value):
        return f"{said}, fewer than a photo's pixels take ({least} at least): it holds next to none of its image"
    return f"{said}, fewer than its pixels take ({least} at least): its image data is cut short or missing"


def decode(data: bytes, spec: ImageInput, max_pixels: int, field: str) -> np.ndarray:
    """One encoded image's pixels (:func:`transform`): :class:`ImageError` naming ``field`` for a format the server
    does not take or a file it cannot decode, :class:`ImageTooLargeError` for more than ``max_pixels`` pixels (read
    from the header, before decoding)."""
    kind = sniff(data)
    if kind is None:
        raise ImageError(f"{field}: not an image the server reads ({len(data)} bytes); send {ACCEPTED}")
    if kind not in ImageFormat.__members__:
        raise ImageError(f"{field}: a {kind} image; the server takes {ACCEPTED}")
    try:
        with opened(data, kind, max_pixels, field) as image:
            width, height = image.size
            resized = resized_size(width, height, spec.resize) if spec.resize is not None else (width, height)
            if resized[0] * resized[1] > max_pixels:  # 1x65000 resized to a shorter side of 256 is 256x16.6M
                made = f"a {width}x{height} {kind} image, which the model's resize makes {resized[0]}x{resized[1]}"
                raise too_large(field, made, max_pixels)
            if spec.draft and kind == ImageFormat.JPEG.value and spec.resize is not None:
                image.draft(image.mode, draft_size(resized))
            image.load()
            return transform(image, spec, resized)
    except ImageError:
        raise
    except UnidentifiedImageError:  # its header is not one the format's reader takes
        raise ImageError(f"{field}: a broken {kind} image: its header is not a valid {kind} header") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, MemoryError) as e:
        # Pillow's decoders say a broken file in several ways: OSError "image file is truncated", SyntaxError "not a
        # PNG file", ValueError for bad chunk sizes. Its words name the problem; an object's address says nothing.
        detail = _ADDRESS.sub("", str(e)).strip() or type(e).__name__
        raise ImageError(f"{field}: cannot decode the {kind} image, broken or cut short ({detail})") from None


def decode_all(images: Sequence[bytes], spec: ImageInput, max_pixels: int, fields: Sequence[str]) -> np.ndarray:
    """Each image's pixels, one row each, as the dtype-free float32 batch ``(len(images), *spec.shape)``."""
    out = np.empty((len(images), *spec.shape), dtype=np.float32)
    for i, (data, field) in enumerate(zip(images, fields, strict=True)):
        out[i] = decode(data, spec, max_pixels, field)
    return out


async def decode_off_loop(
    images: Sequence[bytes], spec: ImageInput, max_pixels: int, fields: Sequence[str]
) -> np.ndarray:
    """:func:`decode_all`, each image on a tokenizing thread in its client's turn (:func:`halfserve.text.run_in_turn`):
    one image a turn, not one request, so that a request of many large photos delays another client's by one photo
    at most, not by all of its own. Raises what :func:`decode` raises, and :class:`ImageBusyError` when the queue is
    full."""
    out = np.empty((len(images), *spec.shape), dtype=np.float32)
    client = text.CLIENT.get()
    for i, (data, field) in enumerate(zip(images, fields, strict=True)):
        try:
            out[i] = await text.run_in_turn(client, functools.partial(decode, data, spec, max_pixels, field))
        except text.TokenizerBusyError:
            busy = f"{field}: the server is decoding as many requests as it holds; retry shortly"
            raise ImageBusyError(busy) from None
    return out
