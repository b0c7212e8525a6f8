"""Probe: what each copy of a batch's outputs costs on the way out of an instance process, at the shapes of the H100
runs at concurrency 64 (ResNet-50: 1,000 float32 per row, batches of 16-64 one-row requests).

The copies, in order (each timed on its own, on the same memory):

1. ``fetch``: ``Instance.fetch`` returns a fresh array copied out of its reused page-locked buffer (on CUDA only; on
   a CPU the model's output tensor is returned as it is);
2. the instance process puts each request's rows into the output region of its memfd: ``child``, one ``copyto`` per
   request as it was, against ``child_runs``, the code as it is (``halfserve.isolated.child.place_outputs``: one copy
   per run of outputs of one dtype and row shape);
3. the engine process takes them out of the region (the next batch's) on its event loop: ``parent``, one copy per
   request as it was, against ``parent_once``, as ``InstanceProcess._answer`` does now (one copy of the bytes used,
   each request's output a view of it).

Run from the repository root: ``PYTHONPATH=benchmarks python benchmarks/tools/output_copies.py``. Env: ``OUT``
(writes ``output_copies.json`` there when set), ``ROWS`` (default 16,20,32,49,64), ``WIDTH`` (1000), ``REPS`` (2000).
The source buffer is page-locked where CUDA is available (as fetch's is), plain memory otherwise.
"""

import math
import os
import statistics
import time
from collections.abc import Callable

import common  # this tree's halfserve first on sys.path
import numpy as np
import torch

from halfserve import hostinfo
from halfserve.ipc.memory import InstanceMemory
from halfserve.ipc.tensors import descr, dtype_of
from halfserve.isolated.child import OUTPUT_ALIGN, place_outputs
from halfserve.manifest import Precision
from halfserve.serving import Output

ROWS = [int(r) for r in os.environ.get("ROWS", "16,20,32,49,64").split(",")]
WIDTH = int(os.environ.get("WIDTH", "1000"))
REPS = int(os.environ.get("REPS", "2000"))
ROUNDS = 5


def per_batch_us(step: Callable[[], object]) -> float:
    """The median over ``ROUNDS`` of the mean microseconds of ``REPS`` calls of ``step``."""
    for _ in range(REPS // 10):
        step()
    means = []
    for _ in range(ROUNDS):
        began = time.perf_counter()
        for _ in range(REPS):
            step()
        means.append((time.perf_counter() - began) / REPS * 1e6)
    return statistics.median(means)


def measure(rows: int, memory: InstanceMemory) -> dict[str, object]:
    cuda = torch.cuda.is_available()
    pinned = torch.rand(rows, WIDTH, pin_memory=cuda).numpy()  # fetch's reused output buffer
    outs = [pinned[i : i + 1] for i in range(rows)]  # one view per one-row request (OverflowGuard.outcomes)

    outcomes = [Output(o, Precision.FP16) for o in outs]
    entries, used, _ = place_outputs(outcomes, memory)

    def fetch() -> object:
        return pinned.copy()

    def child() -> object:  # the child's _batch before place_outputs, the region's branch
        entries, offset = [], 0
        for o in outcomes:
            data, tag = o.data, o.precision
            place = memory.output(data.dtype, data.shape, offset)
            assert place is not None
            np.copyto(place, data)
            entries.append(["out", descr(data.dtype), data.shape, offset, tag, False])
            offset += -(-data.nbytes // OUTPUT_ALIGN) * OUTPUT_ALIGN
        return entries

    def child_runs() -> object:
        return place_outputs(outcomes, memory)

    def parent() -> object:  # InstanceProcess._outcome before, the region's branch (offsets as the child laid them)
        got = []
        for _, description, shape, offset, tag, _ in old_entries:
            dtype, shape = dtype_of(description), tuple(shape)
            view = memory.output(dtype, shape, offset)
            assert view is not None
            got.append(Output(view.copy(), Precision(tag)))
        return got

    def parent_once() -> object:  # InstanceProcess._answer and _outcome now
        region = memory.output(np.dtype(np.uint8), (used,), 0).copy()  # type: ignore[union-attr]
        got = []
        for _, description, shape, offset, tag, _ in entries:
            dtype, shape = dtype_of(description), tuple(shape)
            got.append(Output(np.frombuffer(region, dtype, math.prod(shape), offset).reshape(shape), Precision(tag)))
        return got

    old_entries = child()
    assert all(np.array_equal(a.data, b) for a, b in zip(parent(), outs, strict=True))  # type: ignore[attr-defined]
    child_runs()
    assert all(np.array_equal(a.data, b) for a, b in zip(parent_once(), outs, strict=True))  # type: ignore[attr-defined]
    steps = {"fetch": fetch, "child": child, "child_runs": child_runs, "parent": parent, "parent_once": parent_once}
    us = {name: per_batch_us(step) for name, step in steps.items()}
    return {
        "rows": rows,
        "bytes": pinned.nbytes,
        "us_per_batch": {k: round(v, 2) for k, v in us.items()},
        "us_per_request": {k: round(v / rows, 3) for k, v in us.items()},
        "child_runs_over_child": round(us["child_runs"] / us["child"], 3),
        "parent_once_over_parent": round(us["parent_once"] / us["parent"], 3),
    }


def main() -> None:
    row_bytes = -(-WIDTH * 4 // OUTPUT_ALIGN) * OUTPUT_ALIGN
    memory, other = InstanceMemory.create("output-copies", 1 << 20, max(ROWS) * row_bytes)
    os.close(other)
    rows = [measure(r, memory) for r in ROWS]
    memory.close()
    result = {
        "machine": hostinfo.describe(),
        "cuda": torch.cuda.is_available(),
        "width": WIDTH,
        "reps": REPS,
        "rounds": ROUNDS,
        "batches": rows,
    }
    common.emit("output_copies", result)


main()
