"""The manifest's ``image`` section: encoded images (JPEG, PNG, WebP) clients may send instead of an image tensor, and
the transforms that turn each into the tensor's pixels (decoded by :mod:`halfserve.images`).

The transforms are torchvision's, as its classification recipes and TorchServe's ``image_classifier`` handler chain
them on a Pillow image: convert the mode, ``Resize``, ``CenterCrop``, ``ToTensor`` (a scale), ``Normalize``, with
torchvision's own size and offset arithmetic. Torch-free, Pillow-free: the manifest imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from halfserve.declared import DeclaredTensor
from halfserve.imagedraft import DraftCheck


class ImageFormat(str, Enum):
    """The encodings the server decodes: what photos come in. Every other (GIF, TIFF, BMP, SVG, HEIF, ...) is refused
    by name before Pillow reads it, so a rarely used decoder is never reached from a request."""

    JPEG = "JPEG"
    PNG = "PNG"
    WEBP = "WEBP"


class ColorMode(str, Enum):
    """The colour mode an image is converted to (Pillow's names), which sets the channels."""

    RGB = "RGB"
    """Three channels (an image with alpha loses it, a grey one is repeated), as ``Image.convert("RGB")``."""
    L = "L"
    """One channel of luminance, as ``Image.convert("L")``."""

    @property
    def channels(self) -> int:
        return 3 if self is ColorMode.RGB else 1


class Interpolation(str, Enum):
    """How a resize computes its pixels: Pillow's filters, as torchvision's ``Resize`` passes them (Pillow
    antialiases when it shrinks)."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


class Layout(str, Enum):
    """Where the channels go in the tensor's per-sample shape."""

    CHW = "CHW"
    """Channels first, as torchvision's ``ToTensor`` (PyTorch's convolutions take it)."""
    HWC = "HWC"
    """Channels last, as the image's own pixels."""


IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class ImageInput(BaseModel):
    """Encoded images clients may send instead of an image tensor's values, one image per row."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
    """The name clients send images under (not a tensor input's name)."""
    feeds: str
    """The floating input of fixed shape the pixels go to: the model's only input."""
    mode: ColorMode = ColorMode.RGB
    resize: int | list[int] | None = None
    """An integer: the shorter side becomes this many pixels and the longer keeps the aspect ratio (torchvision's
    ``Resize(256)``); ``[height, width]``: exactly that size. Unset: no resize."""
    interpolation: Interpolation = Interpolation.BILINEAR
    crop: int | list[int] | None = None
    """The centre ``[height, width]`` kept (an integer: a square), after the resize, as torchvision's
    ``CenterCrop``: an image smaller than it is padded with zeros."""
    scale: float = Field(default=1 / 255, gt=0.0)
    """What each pixel value (0..255) is multiplied by before ``mean`` and ``std``: ``ToTensor``'s 1/255."""
    mean: list[float] | None = None
    """One per channel, subtracted after the scale."""
    std: list[float] | None = None
    """One per channel, divided by after the mean."""
    layout: Layout = Layout.CHW
    draft: bool = False
    """Decode a JPEG larger than the resize needs at a reduced size (libjpeg's DCT scaling by 1/2, 1/4 or 1/8, Pillow's
    ``draft``), never below :data:`DRAFT_MARGIN` times the resized size, then resize it as declared: a phone photo's
    decoding costs a fraction, its pixels within about a level. Off: every pixel is decoded, as torchvision does.
    ``halfserve import`` chooses it on the calibration photos unless told (``draft_check``); a section written by
    hand is off unless it says on."""
    draft_check: DraftCheck | None = None
    """Why ``draft`` is on or off where ``halfserve import`` chose it (:mod:`halfserve.draftcheck`); None: the
    section named it."""

    @field_validator("resize", "crop")
    @classmethod
    def _size(cls, size: int | list[int] | None) -> int | list[int] | None:
        values = [size] if isinstance(size, int) else size or []
        if isinstance(size, list) and len(size) != 2:
            raise ValueError(f"expected a size (an integer) or [height, width], got {size}")
        if any(v < 1 or v > MAX_SIDE for v in values):
            raise ValueError(f"sizes are 1 to {MAX_SIDE} pixels, got {size}")
        return size

    @field_validator("std")
    @classmethod
    def _positive_std(cls, std: list[float] | None) -> list[float] | None:
        if std is not None and any(v <= 0 for v in std):
            raise ValueError(f"every std must be positive, got {std}")
        return std

    @model_validator(mode="after")
    def _consistent(self) -> ImageInput:
        if self.size is None:
            raise ValueError(
                "photos come in every size: give crop, or resize as [height, width], so every image has the input's "
                "shape"
            )
        if self.draft and self.resize is None:
            raise ValueError("image.draft: a JPEG is decoded reduced toward the resize's size; give resize too")
        for field, values in (("mean", self.mean), ("std", self.std)):
            if values is not None and len(values) != self.mode.channels:
                channels = self.mode.channels
                raise ValueError(f"{field} has {len(values)} values but mode {self.mode.value} has {channels}")
        return self

    @property
    def size(self) -> tuple[int, int] | None:
        """The ``(height, width)`` every image ends at; None when it depends on the image."""
        if self.crop is not None:
            return (self.crop, self.crop) if isinstance(self.crop, int) else (self.crop[0], self.crop[1])
        if isinstance(self.resize, list):
            return self.resize[0], self.resize[1]
        return None

    @property
    def shape(self) -> list[int]:
        """The per-sample shape of the pixels (the input's shape must be this)."""
        assert self.size is not None  # checked at construction
        height, width = self.size
        channels = self.mode.channels
        return [channels, height, width] if self.layout is Layout.CHW else [height, width, channels]

    def check(self, inputs: Sequence[DeclaredTensor]) -> None:
        """Raise ``ValueError`` naming the field unless the images can feed ``inputs``: their only input, floating, of
        the transforms' shape."""
        if any(t.name == self.input for t in inputs):
            raise ValueError(f"image.input: {self.input!r} is also the name of a tensor input")
        target = next((t for t in inputs if t.name == self.feeds), None)
        if target is None:
            raise ValueError(f"image.feeds: {self.feeds!r} names no input")
        if len(inputs) > 1:
            raise ValueError("image: images feed a model with one input")
        if target.datatype.numpy.kind != "f":
            raise ValueError(f"image.feeds: {self.feeds!r} is {target.datatype.value}; images feed a floating input")
        if target.shape != self.shape:
            raise ValueError(
                f"image: the transforms give {self.mode.value} pixels of shape {self.shape} ({self.layout.value}) but "
                f"input {self.feeds!r} has shape {target.shape}"
            )


DRAFT_MARGIN = 2
"""A drafted JPEG keeps at least this many times the resized size on each side, so the resize still averages over
several decoded pixels per output pixel (its antialiasing), as it does from the full image."""

MAX_SIDE = 16384
"""Largest resize or crop side: past it no tensor is an image a model takes, and a typo should not allocate it."""


class ImagePreset(str, Enum):
    """A named set of transforms (``halfserve import --image-preset``); flags given beside it override its values."""

    TORCHSERVE = "torchserve"
    """TorchServe's ``image_classifier`` handler's: RGB, ``Resize(256)``, ``CenterCrop(224)``, ``ToTensor()``,
    ``Normalize`` with ImageNet's mean and std, channels first."""

    @property
    def transforms(self) -> dict[str, object]:
        return {
            "mode": ColorMode.RGB,
            "resize": 256,
            "interpolation": Interpolation.BILINEAR,
            "crop": 224,
            "scale": 1 / 255,
            "mean": IMAGENET_MEAN,
            "std": IMAGENET_STD,
            "layout": Layout.CHW,
        }
