"""Integer inputs that index an embedding table (token ids): the range each may take, found once at load, and the check
that refuses an id outside it before the request is queued.

An id past a table's end is an ``IndexError`` in the forward on a CPU (a 500 for the whole batch's bisection to sort
out) and, on a GPU, a device-side assert that leaves the CUDA context unusable for every model on that device. The
check runs on the host, in numpy, where the request's rows are checked against the model's signature
(:meth:`halfserve.served.ServedModel.submit`), so it covers every route and transport alike.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from halfserve.engine.inputs import takes_positionally
from halfserve.errors import IdOutOfRangeError
from halfserve.instance import torch_dtype
from halfserve.manifest import Manifest
from halfserve.serving import Tensors

log = logging.getLogger(__name__)


def index_limits(module: nn.Module, manifest: Manifest) -> dict[str, int]:
    """Each integer input that reaches an ``nn.Embedding`` (or ``nn.EmbeddingBag``) as it was given, mapped to the row
    count of the smallest table it indexes; ids must lie in ``0 .. count - 1``.

    Found by one forward of a single row of zeros (variable inputs one long, as warm-up sends) through ``module`` (the
    fp32 host model) with hooks on its tables, noting which input tensor each table receives. An input the model
    changes before its lookup (``ids.long()`` of an ``INT32`` input, ``ids + offset``) is not followed; neither is a
    model whose forward fails here (warm-up then names the failure)."""
    integer = [t.name for t in manifest.inputs if t.mask_for is None and t.datatype.numpy.kind in "iu"]
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)]
    if not integer or not tables:
        return {}
    tensors: dict[str, torch.Tensor] = {}
    for spec in manifest.inputs:
        dtype = torch_dtype(spec.datatype.numpy)
        shape = (1, *spec.bounded(1))
        tensors[spec.name] = (
            torch.ones(shape, dtype=dtype) if spec.mask_for is not None else torch.zeros(shape, dtype=dtype)
        )
    seen: list[tuple[int, object]] = []
    hooks = [
        t.register_forward_pre_hook(lambda table, args: seen.append((table.num_embeddings, args[0]))) for t in tables
    ]
    names = [t.name for t in manifest.inputs]
    try:
        positional = len(names) == 1 or takes_positionally(module, names)
        with torch.inference_mode():
            if positional:
                module(*(tensors[n] for n in names))
            else:
                module(**tensors)
    except Exception as e:  # the model's own code: its failure is warm-up's to report
        log.info("model %s: token id ranges not found (its forward failed on a row of zeros: %s)", manifest.name, e)
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    limits: dict[str, int] = {}
    for name in integer:
        given = tensors[name]
        for rows, arg in seen:
            if arg is given or (
                isinstance(arg, torch.Tensor) and arg.data_ptr() == given.data_ptr() and arg.shape == given.shape
            ):
                limits[name] = min(limits.get(name, rows), rows)
    return limits


def check_indices(limits: Mapping[str, int], manifest: Manifest, inputs: Tensors) -> None:
    """An :class:`~halfserve.errors.IdOutOfRangeError` (a 400) naming the input, its first bad row and value and the
    valid range when an input of ``limits`` holds an id outside it. Values a variable input's ``truncate`` cuts off are
    not looked at."""
    for name, rows in limits.items():
        a = inputs.get(name)
        if a is None or a.size == 0 or a.dtype.kind not in "iu":
            continue  # missing or misshapen inputs are the packing's to name
        spec = next(t for t in manifest.inputs if t.name == name)
        if spec.variable and spec.max_length is not None and a.ndim > 1:
            a = a[:, : spec.max_length]
        if a.min() >= 0 and a.max() < rows:
            continue
        bad = (a < 0) | (a >= rows)
        row = int(np.flatnonzero(bad.reshape(len(a), -1).any(axis=1))[0])
        value = int(a[row][bad[row]].flat[0])
        raise IdOutOfRangeError(name, row, value, rows)
