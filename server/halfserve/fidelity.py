"""Fidelity at load: how far a model's half-precision outputs are from its fp32 outputs, and the bar they must meet.

Every model served in a half precision (fp16, bf16 or autocast, whether chosen by ``auto`` or named) runs a set of
samples through the served engine and through its fp32 host weights at load, before it takes requests. The samples
come from :func:`samples`: the version's calibration samples where it has them (``<version>/calibration.safetensors``:
one tensor per input, rows first; ``halfserve import`` writes it), else :data:`RANDOM_SAMPLES` random samples of the
declared input shapes, drawn the same way on every load.

Each output is measured by what its kind of answer needs:

* class scores (the first output when the manifest has labels, else the first floating output of one dimension of 2
  or more): ``top1_agreement``, the share of samples whose highest score is at the same index in both; a sample with
  a NaN in one precision where the other has a number, or a top score infinite in one and finite in the other, does
  not agree (:func:`top1_agrees`). A labelled output is a classifier's by the manifest's word, and a user sees a
  classifier change only where its top class does, however its scores move: top-1 agreement alone. An unlabelled one
  is class scores by its shape only (it may as well be a box, probabilities or a regression head of several values,
  read value by value), so it is held to ``min_cosine`` too: a top index that holds by luck does not pass a ruined
  vector;
* other outputs with several values per row (embeddings, per-token outputs, hidden states): ``min_cosine``, the lowest
  cosine similarity of a sample's half-precision row with its fp32 row; what such outputs are used for (nearest
  neighbours, a downstream head) depends on their direction far more than on each value;
* outputs of one value per row (regression): ``max_rel_error``, the largest difference relative to the output's
  largest fp32 magnitude on the samples (a scale-free figure that a value near zero cannot blow up);
* integer and boolean outputs (an argmax, a class id, a mask), which a half precision computes from values it
  rounded: counted in ``top1_agreement``, a sample agreeing only where every such value is fp32's too (a model whose
  only output is its argmax had passed unmeasured).

``max_abs_error`` (the largest absolute difference over every floating output) is reported too. The default bar
(:data:`DEFAULT_BAR`) holds each figure to what rounding alone gives a healthy model and keeps what a user would
notice out: a model below it is served in fp32, with the reason in ``/models``, a WARNING in the log and the
``halfserve_model_fp32_fallback`` gauge at 1. The manifest's ``fidelity`` section lowers a bar or turns the check off
for one model, and ``--fidelity-bar off`` for the whole server.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from halfserve import calibration, store
from halfserve.engine.core import Engine
from halfserve.execution import Compile
from halfserve.manifest import FidelityBar, Manifest, Precision
from halfserve.storage import ReportedError, StoreError

CALIBRATION = calibration.CALIBRATION
RANDOM_SAMPLES = calibration.RANDOM_SAMPLES
"""Random samples run at load for a version without calibration samples: one flipped answer in 64 shows, and a
ResNet-18 runs them both ways in a few seconds on two CPU cores (docs/model-store.md)."""


@dataclass(frozen=True)
class Bar:
    """What a half-precision model must meet at load; see the module."""

    check: bool
    min_top1_agreement: float
    min_cosine: float
    max_rel_error: float
    given: frozenset[str] = frozenset()
    """The fields the manifest set (``min_agreement`` for the older spelling); the rest are the default's."""

    def as_dict(self) -> dict[str, object]:
        return {
            "check": self.check,
            "min_top1_agreement": self.min_top1_agreement,
            "min_cosine": self.min_cosine,
            "max_rel_error": self.max_rel_error,
        }

    def describe(self) -> str:
        return (
            f"top-1 agreement >= {self.min_top1_agreement}, cosine >= {self.min_cosine}, "
            f"relative error <= {self.max_rel_error}"
        )

    def origin(self, name: str) -> str:
        if name == "min_top1_agreement" and "min_agreement" in self.given:
            return "the manifest's min_agreement"
        return f"the manifest's fidelity.{name}" if name in self.given else f"the default {name}"


DEFAULT_BAR = Bar(check=True, min_top1_agreement=0.98, min_cosine=0.999, max_rel_error=0.02)
"""0.98 top-1 agreement: at most one sample in 50 may change its class (one in 64 random samples). Random samples sit
nearer a classifier's boundaries than its real inputs, so a healthy model flips a near-tie there now and then (the
shipped digits classifiers: up to 9 in 1,024 random samples in bf16, none of their 360 test digits), while a model
whose scores differ by less than bf16 resolves flips most. 0.999 cosine: about 4.5% root-mean-square error per row,
where rounding alone leaves a healthy model near 0.9999. 0.02 relative error: about five steps of bf16's 8-bit
mantissa at the output's largest magnitude."""


def bar(manifest: Manifest) -> Bar:
    """The bar ``manifest`` is held to: its ``fidelity`` section (or older ``min_agreement``) over the default."""
    section = manifest.fidelity or FidelityBar()
    given = set(section.model_dump(exclude_none=True, exclude={"check"}))
    top1 = section.min_top1_agreement
    if manifest.min_agreement is not None:
        top1 = manifest.min_agreement
        given.add("min_agreement")
    return Bar(
        check=section.check,
        min_top1_agreement=DEFAULT_BAR.min_top1_agreement if top1 is None else top1,
        min_cosine=DEFAULT_BAR.min_cosine if section.min_cosine is None else section.min_cosine,
        max_rel_error=DEFAULT_BAR.max_rel_error if section.max_rel_error is None else section.max_rel_error,
        given=frozenset(given),
    )


class Source(str, Enum):
    """Where a fidelity measurement's samples came from."""

    CALIBRATION = "calibration"
    """Samples the operator gave (the version's calibration file)."""
    RANDOM = "random"
    """Random samples of the declared input shapes: a model's real inputs may sit elsewhere."""
    LIVE = "live"
    """Rows of real requests, sampled as they were answered (:mod:`halfserve.livefidelity`)."""


@dataclass(frozen=True)
class Samples:
    """The rows a fidelity measurement runs, as the engine takes them, and where they came from."""

    rows: np.ndarray
    source: Source


@dataclass(frozen=True)
class Fidelity:
    """What the samples showed, half precision against fp32."""

    samples: int
    precision: str
    top1_agreement: float | None
    """None when the model has no class scores output."""
    max_abs_error: float
    max_rel_error: float | None
    """Over the outputs of one value per row; None when there are none."""
    min_cosine: float | None = None
    """Over the outputs of several values per row but a labelled class scores one; None when there are none."""
    source: str = Source.CALIBRATION.value
    seconds: float = 0.0
    """How long the measurement took (both forwards of every sample): what it added to the model's load."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def samples(loaded: store.LoadedModel) -> Samples:
    """The samples a version's fidelity is measured on (:func:`halfserve.calibration.at_load`: its calibration samples,
    else :data:`RANDOM_SAMPLES` random ones), as the engine takes rows. Raises
    :class:`~halfserve.calibration.CalibrationError` naming the file for calibration samples that do not fit."""
    found = calibration.at_load(loaded, RANDOM_SAMPLES)
    return Samples(found.rows(loaded.manifest), Source.RANDOM if found.random else Source.CALIBRATION)


def read_samples(version_dir: Path, manifest: Manifest) -> np.ndarray | None:
    """A version's stored calibration samples as the engine takes rows, or ``None`` when it has none."""
    found = calibration.stored(version_dir, manifest)
    return None if found is None else found.rows(manifest)


class Computes(Protocol):
    """An engine whose outputs can be asked for directly (:meth:`halfserve.engine.core.Engine.compute`, or an engine
    whose instances are processes)."""

    @property
    def precision(self) -> Precision: ...

    def compute(self, x: np.ndarray) -> np.ndarray: ...


def _run(engine: Computes, x: np.ndarray, batch: int) -> np.ndarray:
    """``engine``'s outputs for every row of ``x``, a batch at a time on its first instance's thread."""
    return np.concatenate([engine.compute(x[i : i + batch]) for i in range(0, len(x), batch)])


def scores_output(manifest: Manifest) -> str | None:
    """The output holding class scores, measured by top-1 agreement: the first output when the manifest has labels,
    else the first floating output of one dimension of 2 or more (held to cosine similarity too, see the module);
    ``None`` when there is none."""
    first = manifest.outputs[0]
    if manifest.answer is not None:  # boxes, detection scores or pixels' classes: no one top class to agree on
        return None
    if manifest.labels is not None and first.datatype.numpy.kind == "f":
        return first.name
    return next(
        (t.name for t in manifest.outputs if t.datatype.numpy.kind == "f" and len(t.shape) == 1 and t.shape[0] >= 2),
        None,
    )


def _floating(out: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """The floating outputs of an engine's rows by name, each as float64 rows."""
    fields = {names[0]: out} if out.dtype.names is None else {n: out[n] for n in names}
    return {n: f.reshape(len(f), -1).astype(np.float64) for n, f in fields.items() if f.dtype.kind == "f"}


def _exact(out: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    """The integer and boolean outputs of an engine's rows by name (an argmax, a class id, a mask), each as rows."""
    fields = {names[0]: out} if out.dtype.names is None else {n: out[n] for n in names}
    return {n: f.reshape(len(f), -1) for n, f in fields.items() if f.dtype.kind in "iub"}


def top1_agrees(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per row of class scores, whether ``got``'s top class is ``want``'s. NaN's argmax is its first NaN's index, so
    a row with a NaN agrees only where the other has its NaNs at the same places, and a top score finite in one and
    not in the other does not agree; an infinity elsewhere does (a mask's -1e9 is -inf in fp16, its class last in
    both)."""
    wi, gi = want.argmax(1), got.argmax(1)
    rows = np.arange(len(want))
    same_nans = (np.isnan(want) == np.isnan(got)).all(1)
    top_alike = np.isfinite(want[rows, wi]) == np.isfinite(got[rows, gi])
    return np.asarray((wi == gi) & same_nans & top_alike)


def _cosines(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Each row's cosine similarity (1 where both rows are zero, 0 where one is; -1 where a value is not finite)."""
    with np.errstate(all="ignore"):
        dot = (w * g).sum(1)
        norms = np.linalg.norm(w, axis=1) * np.linalg.norm(g, axis=1)
        both_zero = ~w.any(1) & ~g.any(1)
        cos = np.where(both_zero, 1.0, np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 0.0))
    return np.where(np.isfinite(g).all(1), cos, -1.0)


@dataclass(frozen=True)
class Rows:
    """Each compared row's part of the figures (:func:`rows`), so that figures over any set of rows (one measurement's,
    or live fidelity's window of the last rows compared) are those :func:`compare` gives for them together."""

    top1: np.ndarray | None
    """Per row, whether its highest class score is at the same index in both (:func:`top1_agrees`; None: no class
    scores output)."""
    cosine: np.ndarray | None
    """Per row, its lowest cosine similarity over the outputs of several values per row but a labelled class scores
    one (None: there are none)."""
    abs_error: np.ndarray
    """Per row, its largest absolute difference over every floating output (inf where one is not finite)."""
    rel_diff: np.ndarray | None
    """Per row and output of one value per row, the absolute difference (None: there are none)."""
    rel_scale: np.ndarray | None
    """Per row and output of one value per row, the fp32 value's magnitude."""

    def __len__(self) -> int:
        return len(self.abs_error)

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        """The rows of ``parts``, in order (``parts`` is not empty)."""

        def joined(arrays: list[np.ndarray | None]) -> np.ndarray | None:
            kept = [a for a in arrays if a is not None]
            return np.concatenate(kept) if kept else None

        return Rows(
            joined([p.top1 for p in parts]),
            joined([p.cosine for p in parts]),
            np.concatenate([p.abs_error for p in parts]),
            joined([p.rel_diff for p in parts]),
            joined([p.rel_scale for p in parts]),
        )


def rows(want: np.ndarray, got: np.ndarray, manifest: Manifest) -> Rows:
    """Each row's figures, ``got`` (a half precision's output rows) against ``want`` (fp32's), by output kind (see
    the module)."""
    names = [t.name for t in manifest.outputs]
    scores = scores_output(manifest)
    top1: np.ndarray | None = None
    cosine: np.ndarray | None = None
    diffs: list[np.ndarray] = []
    scales: list[np.ndarray] = []
    abs_err = np.zeros(len(want))
    got_rows = _floating(got, names)
    for name, w in _floating(want, names).items():
        g = got_rows[name]
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, counted as an infinite error below
            diff = np.abs(w - g)
        abs_err = np.maximum(abs_err, np.where(np.isfinite(diff).all(1), diff.max(1, initial=0.0), math.inf))
        if name == scores:
            top1 = top1_agrees(w, g)
        if w.shape[1] > 1 and not (name == scores and manifest.labels is not None):  # unlabelled scores too
            cos = _cosines(w, g)
            cosine = cos if cosine is None else np.minimum(cosine, cos)
        elif name != scores:
            diffs.append(np.where(np.isfinite(diff[:, 0]), diff[:, 0], math.inf))
            scales.append(np.abs(w[:, 0]))
    exact = _exact(got, names)
    for name, w in _exact(want, names).items():  # a class id computed from scores: the same answer or not
        same = (w == exact[name]).all(1)
        top1 = same if top1 is None else top1 & same
    rel_diff = np.stack(diffs, 1) if diffs else None
    rel_scale = np.stack(scales, 1) if scales else None
    return Rows(top1, cosine, abs_err, rel_diff, rel_scale)


def summarize(
    measured: Rows, precision: Precision, source: Source = Source.CALIBRATION, seconds: float = 0.0
) -> Fidelity:
    """The figures over ``measured``'s rows (not empty)."""
    top1 = None if measured.top1 is None else float(measured.top1.mean())
    cosine = None if measured.cosine is None else float(measured.cosine.min())
    rel_err = None
    if measured.rel_diff is not None and measured.rel_scale is not None:
        for worst, scale in zip(measured.rel_diff.max(0), measured.rel_scale.max(0), strict=True):
            rel = float(worst / scale) if scale > 0 else (0.0 if worst == 0 else math.inf)
            rel_err = rel if rel_err is None else max(rel_err, rel)
    abs_err = float(measured.abs_error.max())
    return Fidelity(len(measured), precision.value, top1, abs_err, rel_err, cosine, Source(source).value, seconds)


def compare(
    want: np.ndarray,
    got: np.ndarray,
    manifest: Manifest,
    precision: Precision,
    source: Source = Source.CALIBRATION,
    seconds: float = 0.0,
) -> Fidelity:
    """How far ``got`` (output rows computed in ``precision``) is from ``want`` (fp32's for the same inputs): the
    measures of the fidelity check at load, and of live fidelity (:mod:`halfserve.livefidelity`)."""
    return summarize(rows(want, got, manifest), precision, source, seconds)


def fp32_reference(loaded: store.LoadedModel) -> Engine:
    """The fp32 engine on the host that half precision is measured against: eager whatever the manifest's execution
    (a compiled forward's kernels would be compiled at every load for a few rows, and an eager fp32 forward is the
    reference a compiled one is held to)."""
    eager = loaded.manifest.execution.model_copy(update={"compile": Compile.NONE})
    return Engine(loaded, Precision.FP32, torch.device("cpu"), execution=eager)


def measure(
    served: Computes, loaded: store.LoadedModel, x: np.ndarray, batch: int, source: Source = Source.CALIBRATION
) -> Fidelity:
    """Run ``x`` through ``served`` (a half-precision engine) and ``loaded``'s fp32 host weights, and compare."""
    started = time.perf_counter()
    reference = fp32_reference(loaded)
    try:
        want = _run(reference, x, batch)
    finally:
        reference.close()
    if (broken := unanswerable(want, loaded.manifest, source)) is not None:
        raise UnanswerableError(f"{loaded.path}: {broken}", broken)
    try:
        got = _run(served, x, batch)
    except Exception as e:  # fp32 answered these samples: the half precision's failure, not the samples'
        raise HalfForwardError(forward_fails(served.precision, e)) from e
    measured = rows(want, got, loaded.manifest)
    return summarize(measured, served.precision, source, round(time.perf_counter() - started, 3))


class HalfForwardError(Exception):
    """A half precision's forward raised where fp32's did not: a fidelity failure (the model is served in fp32)."""


def forward_fails(precision: Precision, error: BaseException) -> str:
    """Why a model whose forward in ``precision`` raised ``error`` is not served in it, in the same words wherever it
    ran (an instance process reports its error's type in its words)."""
    said = str(error) if isinstance(error, ReportedError) else f"{type(error).__name__}: {error}"
    return f"{precision.value} forward fails where fp32's does not: {said}"


class UnanswerableError(StoreError):
    """fp32's own answers on the samples at load are NaN in every row: no answer of the model can be trusted."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """The message without the checkpoint's path."""


def unanswerable(want: np.ndarray, manifest: Manifest, source: Source) -> str | None:
    """Why ``manifest``'s model is not to be served, where ``want`` (fp32's output rows on the samples at load) holds,
    in every row, a NaN or no finite value at all (a NaN running statistic, a forward that always returns NaN); a
    share less than every row is left to the model (a log of a negative input answers NaN for that input alone), and
    an infinity beside finite values may be by design (a mask's -inf)."""
    floating = _floating(want, [t.name for t in manifest.outputs])
    if not floating or not len(want):
        return None
    nan = np.zeros(len(want), dtype=bool)
    finite = np.zeros(len(want), dtype=bool)
    for f in floating.values():
        nan |= np.isnan(f).any(1)
        finite |= np.isfinite(f).any(1)
    if not (nan | ~finite).all():
        return None
    hint = (
        "; if the model takes only some values, give calibration samples of its real inputs"
        if source is Source.RANDOM
        else ""
    )
    return (
        f"in fp32 the model answers NaN or nothing finite for every one of the {len(want)} {source.value} "
        f"samples, so every answer would be NaN: the checkpoint is damaged (a training run that diverged?) or the "
        f"forward is broken{hint}"
    )


def shortfall(fidelity: Fidelity, held_to: Bar) -> str | None:
    """Why a model measured so should be served in fp32 instead (``None``: it meets ``held_to``)."""
    on = f"on {fidelity.samples} {fidelity.source} samples"
    misses = []
    if fidelity.top1_agreement is not None and fidelity.top1_agreement < held_to.min_top1_agreement:
        misses.append(
            f"top-1 agreement with fp32 is {fidelity.top1_agreement:.4f} {on}, below "
            f"{held_to.origin('min_top1_agreement')} {held_to.min_top1_agreement}"
        )
    if fidelity.min_cosine is not None and not fidelity.min_cosine >= held_to.min_cosine:
        misses.append(
            f"lowest cosine similarity with fp32 is {fidelity.min_cosine:.6f} {on}, below "
            f"{held_to.origin('min_cosine')} {held_to.min_cosine}"
        )
    if fidelity.max_rel_error is not None and not fidelity.max_rel_error <= held_to.max_rel_error:
        misses.append(
            f"largest relative error from fp32 is {fidelity.max_rel_error:.4g} {on}, above "
            f"{held_to.origin('max_rel_error')} {held_to.max_rel_error}"
        )
    return f"{fidelity.precision} " + "; ".join(misses) if misses else None


def caveat(measured: Fidelity) -> str | None:
    """What figures measured on random samples leave open, and how to close it (None: the samples were the operator's,
    or live rows). A model whose real inputs sit elsewhere (another scale, an offset) can meet its bar on random
    samples and miss it on every real one."""
    if measured.source != Source.RANDOM.value:
        return None
    return (
        f"measured on {measured.samples} random samples, not your data: import it again with --calibration FILE to "
        "measure it on real inputs"
    )


def how_to_override(precision: str) -> str:
    """What an operator does to serve a model below its bar in ``precision`` anyway."""
    return (
        f'to serve it in {precision} anyway, lower the bar in its manifest\'s "fidelity" section (or set '
        '"check": false there), or serve with --fidelity-bar off'
    )
