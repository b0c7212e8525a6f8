"""Batches of records: a model with several named inputs or outputs, or variable-length ones.

Such a batch travels as one numpy record array (:func:`halfserve.packing.input_records`); here it becomes one device
tensor per input, trimmed to the batch's longest length and padded with rows up to its bucket, with each mask input
built from the lengths, and the model's named outputs come back as host records
(:func:`halfserve.packing.output_records`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from halfserve import packing
from halfserve import precision as prec
from halfserve.instance import torch_dtype
from halfserve.manifest import Manifest, Precision


class OutputError(RuntimeError):
    """The model returned something other than the outputs its manifest declares, one row per input row."""


def first_output(y: object, names: list[str]) -> torch.Tensor:
    """The output of a model with one (a tensor, most often, as it is), from what its forward returned."""
    return y if isinstance(y, torch.Tensor) else named_outputs(y, names)[names[0]]


def named_outputs(y: object, names: list[str]) -> dict[str, torch.Tensor]:
    """The model's outputs by name, from what its forward returned: a tensor (one output), a tuple or list (in the
    manifest's order), or a mapping such as a Hugging Face ``ModelOutput`` (by name)."""
    if isinstance(y, torch.Tensor):
        if len(names) > 1:
            raise OutputError(f"model returned one tensor; the manifest declares {len(names)} outputs {names}")
        return {names[0]: y}
    if isinstance(y, Mapping):
        missing = [n for n in names if n not in y]
        if missing:
            raise OutputError(f"model returned no output named {missing[0]!r} (it returned {list(y)})")
        outs = {n: y[n] for n in names}
    elif isinstance(y, tuple | list):
        if len(y) < len(names):
            raise OutputError(f"model returned {len(y)} values; the manifest declares {len(names)} outputs {names}")
        outs = dict(zip(names, y, strict=False))
    else:
        raise OutputError(f"model returned {type(y).__name__}, expected a tensor, a tuple or a mapping")
    for name, t in outs.items():
        if not isinstance(t, torch.Tensor):
            raise OutputError(f"model's output {name!r} is {type(t).__name__}, not a tensor")
    return outs


@dataclass(frozen=True)
class Padding:
    """Values of a batch's first variable input: those requests sent, and those that were padding (up to the batch's
    length, and whole rows up to its bucket)."""

    real: int = 0
    padded: int = 0


def run(
    manifest: Manifest,
    model: nn.Module,
    batch: np.ndarray,
    size: int,
    device: torch.device,
    precision: Precision,
    positional: bool,
) -> tuple[dict[str, torch.Tensor], Padding]:
    """Run a batch of records (padded to ``size`` rows) through ``model``: each input copied to ``device`` and, when
    floating, cast to ``precision``'s dtype (integer and bool inputs keep theirs). ``positional``: the forward takes
    the inputs in the manifest's order rather than by name."""
    rows = len(batch)
    tensors: dict[str, torch.Tensor] = {}
    lengths: dict[str, torch.Tensor] = {}
    padding = Padding()
    for spec in manifest.inputs:
        if spec.mask_for is not None:
            continue
        a = batch[spec.name]
        if spec.variable:
            lens = batch[spec.name + packing.LENGTH]
            length = packing.padded_length(manifest, spec, int(lens.max()))
            a = a[:, :length]  # beyond each row's own length it holds the input's pad value (packing.pack)
            lengths[spec.name] = torch.from_numpy(lens.astype(np.int64)).to(device)
            if len(lengths) == 1:
                real = int(lens.sum())
                padding = Padding(real, size * length - real)
        # A copy: a record field is a strided view, which torch takes only with whole-element strides.
        t = torch.from_numpy(a.copy()).to(device, non_blocking=True)
        if size > rows:  # padding rows made from the batch's own tensor: its dtype and device
            t = torch.cat([t, t.new_full((size - rows, *t.shape[1:]), spec.pad)])
            if spec.name in lengths:
                lens_t = lengths[spec.name]
                lengths[spec.name] = torch.cat([lens_t, lens_t.new_zeros(size - rows)])
        tensors[spec.name] = t
    for spec in manifest.inputs:
        if spec.mask_for is not None:
            # 1 where the input has a value, 0 where it was padded, in the mask's own datatype.
            target = tensors[spec.mask_for]
            positions = torch.arange(target.shape[1], device=target.device)
            mask = positions.unsqueeze(0) < lengths[spec.mask_for].unsqueeze(1)
            tensors[spec.name] = mask.to(torch_dtype(spec.datatype.numpy))
    names = [t.name for t in manifest.inputs]
    args = [prec.cast_input(tensors[name], precision) for name in names]
    with prec.inference(precision, device):
        y = model(*args) if positional else model(**dict(zip(names, args, strict=True)))
    outs = named_outputs(y, [t.name for t in manifest.outputs])
    for name, t in outs.items():
        if t.ndim == 0 or t.shape[0] != size:
            got = "a scalar" if t.ndim == 0 else f"{t.shape[0]} rows"
            raise OutputError(f"batch size mismatch: output {name!r} has {got} for {size} inputs")
    return outs, padding


def to_host(outs: dict[str, torch.Tensor], rows: int, dtype: np.dtype[np.void]) -> np.ndarray:
    """The first ``rows`` rows of named device outputs as host records of ``dtype`` (floating outputs as float32; a
    variable output's length, the batch's, written from the start of its field)."""
    records = np.empty(rows, dtype=dtype)
    for name, t in outs.items():
        t = t[:rows]
        host = (t.float() if t.is_floating_point() else t).cpu().numpy()
        field = records[name]
        if host.shape == field.shape:
            field[...] = host
            continue
        if host.ndim != field.ndim or host.shape[2:] != field.shape[2:] or host.shape[1] > field.shape[1]:
            raise OutputError(f"output {name!r} has rows of shape {list(host.shape[1:])}, not {list(field.shape[1:])}")
        field[:, : host.shape[1]] = host
        field[:, host.shape[1] :] = 0
    return records
