"""An instance process's outputs put in its output region (halfserve.isolated.child.place_outputs): each request's
rows read back exactly where its entry says, one request's after another's where they share a dtype and row shape,
a new run aligned, errors passed on, and what does not fit sent in the frame."""

from __future__ import annotations

import os

import numpy as np

from halfserve.ipc.memory import InstanceMemory
from halfserve.ipc.tensors import dtype_of
from halfserve.isolated.child import OUTPUT_ALIGN, place_outputs
from halfserve.manifest import Precision
from halfserve.serving import Output


def read(memory: InstanceMemory, entry: list[object], payload: bytes) -> np.ndarray:
    _, description, shape, offset, _, inline = entry
    dtype, shape = dtype_of(str(description)), tuple(shape)  # type: ignore[call-overload]
    count = int(np.prod(shape))
    if inline:
        return np.frombuffer(payload, dtype, count, int(offset)).reshape(shape)  # type: ignore[call-overload]
    view = memory.output(dtype, shape, int(offset))  # type: ignore[call-overload]
    assert view is not None
    return view


def test_outputs_read_back_where_their_entries_say() -> None:
    memory, other = InstanceMemory.create("placement", 64, 4096)
    os.close(other)
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((5, 10)).astype(np.float32)
    outs = [
        Output(batch[0:1], Precision.FP16),
        Output(batch[1:3], Precision.FP16),
        ValueError("row 3 overflowed"),
        Output(batch[3:5], Precision.FP32),
        Output(np.arange(6, dtype=np.int64).reshape(2, 3), None),  # another dtype: a new, aligned run
        Output(np.float64(2.5).reshape(()), None),  # a scalar
        Output(np.ones((200, 10), np.float32), None),  # 8,000 bytes: past the region, in the frame
    ]
    entries, used, parts = place_outputs(outs, memory)
    payload = b"".join(bytes(p) for p in parts)
    assert entries[2] == ["error", "ValueError", "row 3 overflowed"]
    placed = [e for e in entries if e[0] == "out"]
    assert [e[4] for e in placed] == [Precision.FP16, Precision.FP16, Precision.FP32, None, None, None]
    assert [e[5] for e in placed] == [False, False, False, False, False, True]
    # the float rows back to back, then a run of another dtype at the next aligned offset
    assert [e[3] for e in placed[:3]] == [0, 40, 120]
    assert placed[3][3] == -(-200 // OUTPUT_ALIGN) * OUTPUT_ALIGN
    assert placed[4][3] % OUTPUT_ALIGN == 0
    assert placed[4][3] > placed[3][3]
    assert used == placed[4][3] + 8
    wanted = [o for o in outs if isinstance(o, Output)]
    for entry, want in zip(placed, wanted, strict=True):
        got = read(memory, entry, payload)
        assert got.dtype == want.data.dtype
        assert got.shape == want.data.shape
        assert np.array_equal(got, want.data)
    memory.close()


def test_nothing_placed_uses_no_region() -> None:
    memory, other = InstanceMemory.create("placement", 64, 64)
    os.close(other)
    entries, used, parts = place_outputs([RuntimeError("bad row")], memory)
    assert (entries, used, parts) == ([["error", "RuntimeError", "bad row"]], 0, [])
    memory.close()
