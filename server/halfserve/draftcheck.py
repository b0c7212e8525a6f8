"""``halfserve import``'s choice of the image section's ``draft`` (issue 51): on where the calibration photos show
that decoding a large JPEG reduced leaves the model's answers as they are, off with the reason where they do not or
cannot show it.

The photos measured are those draft decodes reduced (JPEGs at least twice
:data:`~halfserve.imageinput.DRAFT_MARGIN` times the resize on each side: :func:`halfserve.images.drafted`). Each is
decoded and transformed both ways, as a request's photo is; the pixels are compared in levels of 0..255 and the
model's fp32 answers to the drafted rows against its answers to the exact rows, with the fidelity check's figures
and bar (:mod:`halfserve.fidelity`: top-1 agreement for class scores, cosine, relative error). :func:`measure` takes
the photos and the model; :func:`decide` is the decision on what it measured, a pure function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from halfserve import calibration, fidelity, images, store
from halfserve.imagedraft import DraftCheck, DraftReason
from halfserve.imageinput import DRAFT_MARGIN, ImageInput, Layout
from halfserve.manifest import Manifest, Precision
from halfserve.settings import MAX_IMAGE_PIXELS

MAX_MEAN_LEVELS = 1.0
"""The largest mean pixel difference draft may make, in levels of 0..255: libjpeg's reduced decoding of a photo is
within about 0.2 (benchmarks/results/jpeg-draft-cpu); past a level the pixels are not those the model was shown."""
MAX_PHOTOS = 64
"""Calibration photos measured at most (the first by name): enough for the default bar's one flipped answer in 50 to
show, while each costs two decodes (a 12 MP photo's exact one about 0.15-0.2 s) and two fp32 forwards."""
BATCH = 64


@dataclass(frozen=True)
class Measured:
    """Drafted against exact decodes of the calibration photos draft reduces (``photos`` of them, of ``given``)."""

    given: int
    """The calibration photos in the folder."""
    photos: int
    mean_levels: float = 0.0
    max_levels: float = 0.0
    answers: fidelity.Fidelity | None = None
    """The drafted rows' fp32 answers against the exact rows'; None when no photo was measured."""


def photos(folder: Path, spec: ImageInput) -> tuple[list[Path], list[Path]]:
    """The folder's calibration photos, and those of them draft decodes reduced (at most :data:`MAX_PHOTOS`)."""
    assert spec.resize is not None
    given = calibration.photo_files(folder)
    reduced = []
    for file in given:
        size = images.jpeg_size(file.read_bytes())
        if size is not None and images.drafted(*size, images.resized_size(*size, spec.resize)):
            reduced.append(file)
            if len(reduced) == MAX_PHOTOS:
                break
    return given, reduced


def _levels(diff: np.ndarray, spec: ImageInput) -> np.ndarray:
    """A difference of transformed pixels (rows first) in levels of 0..255: the normalising undone."""
    std = np.asarray(spec.std or [1.0] * spec.mode.channels, dtype=np.float64)
    per_channel = std.reshape(1, -1, 1, 1) if spec.layout is Layout.CHW else std.reshape(1, 1, 1, -1)
    return np.abs(diff.astype(np.float64)) * per_channel / spec.scale


def measure(loaded: store.LoadedModel, folder: Path, max_pixels: int = MAX_IMAGE_PIXELS) -> Measured:
    """The photos in ``folder`` that draft reduces, decoded both ways through ``loaded``'s image section and run
    through its fp32 weights. Raises :class:`~halfserve.calibration.CalibrationError` naming a photo that does not
    decode, or has more than ``max_pixels`` pixels."""
    manifest = loaded.manifest
    assert manifest.image is not None
    given, reduced = photos(folder, manifest.image)
    if not reduced:
        return Measured(len(given), 0)
    names = [f.name for f in reduced]
    data = [f.read_bytes() for f in reduced]
    both = []
    for on in (False, True):
        spec = manifest.image.model_copy(update={"draft": on})
        try:
            both.append(images.decode_all(data, spec, max_pixels, names))
        except images.ImageTooLargeError as e:
            raise calibration.too_large(f"--calibration {folder}", e) from None
        except images.ImageError as e:
            raise calibration.CalibrationError(f"--calibration {folder}: {e}") from None
    exact, drafted = both
    levels = _levels(drafted - exact, manifest.image)
    feeds = next(t for t in manifest.inputs if t.name == manifest.image.feeds)
    engine = fidelity.fp32_reference(loaded)
    try:
        want, got = (_outputs(engine, x.astype(feeds.datatype.numpy)) for x in (exact, drafted))
    finally:
        engine.close()
    answers = fidelity.compare(want, got, manifest, Precision.FP32)
    return Measured(len(given), len(reduced), float(levels.mean()), float(levels.max()), answers)


def _outputs(engine: fidelity.Computes, x: np.ndarray) -> np.ndarray:
    return np.concatenate([engine.compute(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])


def decide(measured: Measured, held_to: fidelity.Bar) -> DraftCheck:
    """``draft`` on (:attr:`~halfserve.imagedraft.DraftReason.AGREES`) when the drafted photos' pixels are within
    :data:`MAX_MEAN_LEVELS` on average and the model's answers meet ``held_to``, the fidelity bar (its figures,
    whether or not the manifest turns the check off); off, with the reason, otherwise or when nothing was measured."""
    if measured.photos == 0 or measured.answers is None:
        return DraftCheck(
            reason=DraftReason.NO_LARGE_PHOTOS,
            detail=f"off: none of the {measured.given} calibration photos is a JPEG draft decodes reduced (at least "
            f"{2 * DRAFT_MARGIN} times the resized size on each side), so nothing shows the model's answers unchanged",
        )
    a = measured.answers
    misses = []
    if measured.mean_levels > MAX_MEAN_LEVELS:
        misses.append(f"the pixels differ by {measured.mean_levels:.3g} levels on average, more than {MAX_MEAN_LEVELS}")
    if a.top1_agreement is not None and a.top1_agreement < held_to.min_top1_agreement:
        misses.append(f"top-1 agreement {a.top1_agreement:.4f}, below {held_to.min_top1_agreement}")
    if a.min_cosine is not None and not a.min_cosine >= held_to.min_cosine:
        misses.append(f"lowest cosine similarity {a.min_cosine:.6f}, below {held_to.min_cosine}")
    if a.max_rel_error is not None and not a.max_rel_error <= held_to.max_rel_error:
        misses.append(f"largest relative error {a.max_rel_error:.4g}, above {held_to.max_rel_error}")
    shown = [f"top-1 agreement {a.top1_agreement:.4f}"] if a.top1_agreement is not None else []
    if a.min_cosine is not None:
        shown.append(f"lowest cosine {a.min_cosine:.6f}")
    if a.max_rel_error is not None:
        shown.append(f"max rel error {a.max_rel_error:.4g}")
    on = (
        f"the {measured.photos} of {measured.given} calibration photos draft decodes reduced are "
        f"{measured.mean_levels:.3g} levels from the exact decode on average (max {measured.max_levels:.3g})"
    )
    if misses:
        reason, detail = DraftReason.DIFFERS, f"off: {on}, but draft changes too much: {'; '.join(misses)}"
    else:
        answers = (
            f"the model's answers are the exact decode's ({', '.join(shown)})"
            if shown
            else "the model has no floating answers to compare"
        )
        reason, detail = DraftReason.AGREES, f"on: {on}, and {answers}"
    return DraftCheck(
        reason=reason,
        photos=measured.photos,
        mean_levels=round(measured.mean_levels, 4),
        max_levels=round(measured.max_levels, 4),
        top1_agreement=a.top1_agreement,
        min_cosine=a.min_cosine,
        max_rel_error=a.max_rel_error if a.max_rel_error is None or math.isfinite(a.max_rel_error) else None,
        detail=detail,
    )


def chosen(loaded: store.LoadedModel, folder: Path | None, max_pixels: int = MAX_IMAGE_PIXELS) -> Manifest:
    """``loaded``'s manifest with its image section's ``draft`` chosen on the calibration photos in ``folder`` (see the
    module; each held to ``max_pixels``), and the record of why beside it."""
    manifest = loaded.manifest
    assert manifest.image is not None
    if manifest.image.resize is None:
        check = DraftCheck(reason=DraftReason.NO_RESIZE, detail="off: the section has no resize to decode toward")
    elif folder is None or not folder.is_dir():
        check = DraftCheck(
            reason=DraftReason.NO_PHOTOS,
            detail="off: no calibration photos to measure it on; give --calibration a folder of photos as clients "
            "send them (or --image-draft on)",
        )
    else:
        check = decide(measure(loaded, folder, max_pixels), fidelity.bar(manifest))
    image = manifest.image.model_copy(update={"draft": check.on, "draft_check": check})
    return manifest.model_copy(update={"image": image})
