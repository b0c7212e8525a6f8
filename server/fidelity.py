"""Fidelity at load: how far a model's half-precision outputs are from its fp32 outputs, on samples of its own.

A version may hold calibration samples beside its weights (``<version>/calibration.safetensors``: one tensor per
input, rows first; ``halfserve import`` writes them). When it does and the model is served in a half precision, the
samples run through the served engine and through the fp32 host weights at load, before the model takes requests:

* ``top1_agreement``: the share of rows whose highest value in the first floating output with more than one class (its
  last dimension) is at the same index in both;
* ``max_abs_error``: the largest absolute difference over every floating output's values;
* ``max_rel_error``: that difference relative to the largest fp32 magnitude of its output (a scale-free figure that
  a value near zero cannot blow up).

With ``min_agreement`` in the manifest, a model whose top-1 agreement falls short is served in fp32 instead: the
reason shows in ``/models``, the log and the ``halfserve_model_fp32_fallback`` gauge.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from server import calibration, store
from server.engine import Engine
from server.precision import Precision
from server.store import Manifest

CALIBRATION = calibration.CALIBRATION
MAX_SAMPLES = calibration.MAX_SAMPLES


@dataclass(frozen=True)
class Fidelity:
    """What the calibration samples showed, half precision against fp32."""

    samples: int
    precision: str
    top1_agreement: float | None
    """None when no floating output has more than one value per row to rank."""
    max_abs_error: float
    max_rel_error: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def read_samples(version_dir: Path, manifest: Manifest) -> np.ndarray | None:
    """A version's calibration samples as the engine takes rows (the one input's array, or records), or ``None``
    when it has none (:func:`server.calibration.stored`). Raises :class:`StoreError` naming the file for samples that
    do not fit the manifest."""
    samples = calibration.stored(version_dir, manifest)
    return None if samples is None else samples.rows(manifest)


class Computes(Protocol):
    """An engine whose outputs can be asked for directly (:meth:`server.engine.Engine.compute`, or an engine whose
    instances are processes)."""

    @property
    def precision(self) -> Precision: ...

    def compute(self, x: np.ndarray) -> np.ndarray: ...


def _run(engine: Computes, x: np.ndarray, batch: int) -> np.ndarray:
    """``engine``'s outputs for every row of ``x``, a batch at a time on its first instance's thread."""
    return np.concatenate([engine.compute(x[i : i + batch]) for i in range(0, len(x), batch)])


def _floating(out: np.ndarray, names: list[str]) -> list[np.ndarray]:
    """The floating outputs of an engine's rows, in manifest order, each as float64 rows."""
    fields = [out] if out.dtype.names is None else [out[n] for n in names]
    return [f.reshape(len(f), -1).astype(np.float64) for f in fields if f.dtype.kind == "f"]


def measure(served: Computes, loaded: store.LoadedModel, x: np.ndarray, batch: int) -> Fidelity:
    """Run ``x`` through ``served`` (a half-precision engine) and ``loaded``'s fp32 host weights, and compare."""
    reference = Engine(loaded, Precision.FP32, torch.device("cpu"))
    try:
        want = _run(reference, x, batch)
    finally:
        reference.close()
    got = _run(served, x, batch)
    names = [t.name for t in loaded.manifest.outputs]
    top1, abs_err, rel_err = None, 0.0, 0.0
    for w, g in zip(_floating(want, names), _floating(got, names), strict=True):
        diff = np.abs(w - g)
        finite = bool(np.isfinite(diff).all())
        worst = float(diff.max()) if finite else math.inf
        abs_err = max(abs_err, worst)
        scale = float(np.abs(w).max())
        rel_err = max(rel_err, worst / scale if scale > 0 else (0.0 if worst == 0 else math.inf))
        if top1 is None and w.shape[1] > 1:
            top1 = float((w.argmax(1) == g.argmax(1)).mean())
    return Fidelity(len(x), served.precision.value, top1, abs_err, rel_err)


def shortfall(fidelity: Fidelity, minimum: float | None) -> str | None:
    """Why a model measured so should be served in fp32 instead (``None``: it need not be)."""
    if minimum is None:
        return None
    if fidelity.top1_agreement is None:
        return None  # nothing to rank: min_agreement cannot apply (said so at manifest validation)
    if fidelity.top1_agreement < minimum:
        return (
            f"{fidelity.precision} top-1 agreement with fp32 is {fidelity.top1_agreement:.4f} on "
            f"{fidelity.samples} calibration samples, below the manifest's min_agreement {minimum}"
        )
    return None
