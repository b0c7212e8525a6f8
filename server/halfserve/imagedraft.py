"""Why the image section's ``draft`` is on or off where ``halfserve import`` chose it: the record kept in the manifest
(``image.draft_check``), written from the measurement on the calibration photos (:mod:`halfserve.draftcheck`).
Torch-free, Pillow-free: the manifest imports it."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class DraftReason(str, Enum):
    """What the import found, which sets ``draft``: on only for :attr:`AGREES`."""

    AGREES = "agrees"
    """Measured: drafted pixels within a level on average, and the model's answers the exact decode's."""
    DIFFERS = "differs"
    """Measured: the pixels or the model's answers moved past the bar."""
    NO_LARGE_PHOTOS = "no_large_photos"
    """No calibration photo is a JPEG that draft decodes reduced: nothing to measure on."""
    NO_PHOTOS = "no_photos"
    """No folder of calibration photos was given."""
    NO_RESIZE = "no_resize"
    """The section has no resize, which draft decodes toward."""


class DraftCheck(BaseModel):
    """The measurement behind an imported ``draft``: drafted decodes against exact ones of the same calibration
    photos, the pixels in levels of 0..255 after the transforms' resize and crop, the answers in the fidelity check's
    figures (the drafted rows' fp32 outputs against the exact rows')."""

    model_config = ConfigDict(extra="forbid")

    reason: DraftReason
    photos: int = Field(default=0, ge=0)
    """The calibration photos measured: those draft decodes reduced."""
    mean_levels: float | None = None
    max_levels: float | None = None
    top1_agreement: float | None = None
    min_cosine: float | None = None
    max_rel_error: float | None = None
    detail: str
    """The decision in words, as ``halfserve import`` printed it."""

    @property
    def on(self) -> bool:
        return self.reason is DraftReason.AGREES
