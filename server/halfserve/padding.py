"""Padding invariance: a model with a variable dimension must answer a request the same alone and in a batch padded
to a longer one, or the answer a client gets depends on who else was batched with it.

The check runs in fp32 on the host weights, at import and at every load: up to :data:`PROBES` calibration samples
(:func:`halfserve.calibration.at_load`; a sample at its ``max_length`` is cut to half, so padding has room) run one by
one, each at its own length, and then together with a longer row (a sample's own values repeated), padded to that
row's length as the batcher pads. Every output of every probe must agree within :data:`TOLERANCE` of the largest
magnitude of that output over the probes (a variable output at the probe's own length).

A model that fails (imported without ``--mask``, or one that ignores its mask) is refused, naming the cause and the
fix, unless its manifest says ``"padding_invariant": false`` (``halfserve import --accept-padding-variance``): then it
serves, with a warning and the figure in ``/models``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import asdict, dataclass

import numpy as np
import torch

from halfserve import calibration, packing
from halfserve.calibration import Samples
from halfserve.engine.core import Engine
from halfserve.manifest import Manifest, Precision, sent_inputs
from halfserve.packing import LENGTH
from halfserve.storage import StoreError
from halfserve.store import LoadedModel

log = logging.getLogger(__name__)

PROBES = 8
"""Samples run alone and in the padded batch: enough to see a model attend to padding, cheap at load."""
TOLERANCE = 1e-4
"""The largest difference allowed, relative to the output's largest magnitude. fp32 rounding of the same sample in a
batch of another shape (another matmul blocking, padded positions masked to exactly zero weight) differs by about
1e-7 to 1e-6 of it; attending to padding moves answers by percents (the issue's example: 4%)."""


class PaddingVarianceError(StoreError):
    """A model whose answers change with the batch's padding, and whose manifest does not accept that."""


@dataclass(frozen=True)
class PaddingCheck:
    """What running samples alone and padded showed."""

    samples: int
    padded_to: int
    """The length the batch of probes was padded to."""
    max_rel_diff: float
    """The largest difference between a probe's answers, relative to its output's largest magnitude."""
    tolerance: float
    invariant: bool
    accepted: bool
    """The manifest accepts answers that change with padding (``padding_invariant: false``)."""
    calibration: str
    """Where the samples came from."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def check(loaded: LoadedModel, samples: Samples) -> PaddingCheck | None:
    """Run ``samples`` through ``loaded``'s fp32 weights alone and padded (see the module); ``None`` for a model
    without a variable input, or one whose variable input is at most one long (nothing to pad)."""
    manifest = loaded.manifest
    sequence = packing.sequence_input(manifest)
    if sequence is None or (sequence.max_length or 1) < 2:
        return None
    probes = _shortened(samples.rows(manifest)[:PROBES], manifest)
    longer = _longer(probes, manifest)
    # Lengths ungrouped: a probe alone runs at its own length, with no padding at all.
    exact = manifest.model_copy(update={"batching": manifest.batching.model_copy(update={"group_lengths": False})})
    engine = Engine(dataclasses.replace(loaded, manifest=exact), Precision.FP32, torch.device("cpu"))
    try:
        alone = [engine.compute(probes[i : i + 1]) for i in range(len(probes))]
        together = engine.compute(np.concatenate([probes, longer]))[: len(probes)]
    finally:
        engine.close()
    worst = _difference(alone, together, probes, manifest)
    padded_to = int(longer[sequence.name + LENGTH][0])
    invariant = worst <= TOLERANCE
    return PaddingCheck(
        len(probes), padded_to, worst, TOLERANCE, invariant, not manifest.padding_invariant, samples.source
    )


def _shortened(rows: np.ndarray, manifest: Manifest) -> np.ndarray:
    """``rows`` with every variable input at its ``max_length`` cut to half, so a longer row can pad them."""
    rows = rows.copy()
    for spec in sent_inputs(manifest):
        if not spec.variable or spec.max_length is None:
            continue
        lengths = rows[spec.name + LENGTH]
        cut = np.where(lengths >= spec.max_length, np.maximum(1, lengths // 2), lengths).astype(np.int32)
        field = rows[spec.name]
        field[np.arange(field.shape[1])[None, :] >= cut[:, None]] = spec.pad
        rows[spec.name + LENGTH] = cut
    return rows


def _longer(probes: np.ndarray, manifest: Manifest) -> np.ndarray:
    """One row longer than every probe in each variable input: the longest probe's own values repeated to twice its
    length (at least 8 more, at most the input's ``max_length``)."""
    sequence = packing.sequence_input(manifest)
    assert sequence is not None
    source = int(np.argmax(probes[sequence.name + LENGTH]))
    row = probes[source : source + 1].copy()
    for spec in sent_inputs(manifest):
        if not spec.variable:
            continue
        longest = int(probes[spec.name + LENGTH].max())
        target = min(spec.max_length or longest, max(2 * longest, longest + 8))
        own = int(row[spec.name + LENGTH][0])
        values = row[spec.name][0, :own]
        reps = -(-target // own)
        row[spec.name][0, :target] = np.concatenate([values] * reps)[:target]
        row[spec.name + LENGTH] = target
    return row


def _difference(alone: list[np.ndarray], together: np.ndarray, probes: np.ndarray, manifest: Manifest) -> float:
    """The largest difference between each probe's answers alone and in the batch, relative to the largest magnitude
    of its output over the probes (absolute where that is zero); a value finite one way and not the other is inf."""
    sequence = packing.sequence_input(manifest)
    assert sequence is not None
    single = np.concatenate(alone)
    worst = 0.0
    for spec in manifest.outputs:
        a = single if single.dtype.names is None else single[spec.name]
        b = together if together.dtype.names is None else together[spec.name]
        diffs, scale = [], 0.0
        for i in range(len(probes)):
            x, y = a[i].astype(np.float64), b[i].astype(np.float64)
            if spec.variable:
                own = int(probes[i][sequence.name + LENGTH])
                x, y = x[:own], y[:own]
            same_nan = np.isnan(x) & np.isnan(y)
            d = np.where(same_nan, 0.0, np.abs(x - y))
            diffs.append(float(np.nan_to_num(d, nan=np.inf).max()) if d.size else 0.0)
            finite = x[np.isfinite(x)]
            scale = max(scale, float(np.abs(finite).max()) if finite.size else 0.0)
        largest = max(diffs)
        worst = max(worst, largest / scale if scale > 0 else largest)
    return worst


def _mask_argument(loaded: LoadedModel) -> str:
    """The name of the forward's mask argument where it has one (``attention_mask``), else ``attention_mask``."""
    try:
        params = inspect.signature(loaded.module.forward).parameters
    except (TypeError, ValueError):
        return "attention_mask"
    return next((p for p in params if "mask" in p.lower() and "head" not in p.lower()), "attention_mask")


def reason(result: PaddingCheck, loaded: LoadedModel) -> str:
    """Why a model that failed the check is refused: the cause and the fix."""
    manifest = loaded.manifest
    sequence = packing.sequence_input(manifest)
    assert sequence is not None
    found = (
        f"its answers change with padding: a sample alone and in a batch padded to length {result.padded_to} differ "
        f"by {result.max_rel_diff:.3g} of the output's scale (tolerance {result.tolerance:g}, fp32, {result.samples} "
        f"samples: {result.calibration})"
    )
    masks = [t.name for t in manifest.inputs if t.mask_for is not None]
    if not masks:
        name = _mask_argument(loaded)
        cause = (
            f"The model has no attention mask input, so it attends to the padding: import it with --mask {name} (in "
            f'the manifest, an input {{"name": "{name}", "datatype": "INT64", "shape": [-1], "mask_for": '
            f'"{sequence.name}"}})'
        )
    else:
        cause = (
            f"It is given the mask {masks[0]!r}, so the model ignores it (or masks another value than the pad "
            f"value {sequence.pad:g}): fix the model, or pad with the value it masks"
        )
    accept = (
        'To serve it anyway, accept answers that depend on the batch: --accept-padding-variance at import ("padding_'
        'invariant": false in the manifest)'
    )
    return f"{found}. {cause}. {accept}"


def at_load(loaded: LoadedModel) -> PaddingCheck | None:
    """The check as a load runs it, on :func:`halfserve.calibration.at_load`'s samples; raises
    :class:`PaddingVarianceError` for a model that fails it unless its manifest accepts that. Random samples that the
    model cannot take (an id past a vocabulary the server cannot see) leave it unchecked, with a warning."""
    if packing.sequence_input(loaded.manifest) is None:
        return None
    samples = calibration.at_load(loaded, PROBES)
    try:
        result = check(loaded, samples)
    except Exception as e:
        if not samples.random:
            raise
        log.warning(
            "model %s: padding invariance not checked: the model does not take random samples (%s); store real ones "
            "as %s",
            loaded.manifest.name,
            e,
            calibration.CALIBRATION,
        )
        return None
    if result is None or result.invariant:
        return result
    why = reason(result, loaded)
    if not result.accepted:
        raise PaddingVarianceError(f"model {loaded.manifest.name!r}: {why}")
    log.warning("model %s is served although %s", loaded.manifest.name, why.split(". ")[0])
    return result
