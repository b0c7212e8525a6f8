"""The processes' shared package on its own (:mod:`halfserve.ipc`): frames, named tensors, shared memory and a
channel's two ends, in one process over a socket pair; no process is spawned."""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from halfserve.errors import DeadlineExceededError, ModelNotReadyError, error_from_wire, error_to_wire
from halfserve.ipc import exports
from halfserve.ipc.channel import Channel
from halfserve.ipc.frames import FRAME, FrameError, FrameReader, frame
from halfserve.ipc.memory import InstanceMemory, Slots
from halfserve.ipc.tensors import descr, dtype_of, from_payload, inline, nbytes

TENSORS = {
    "image": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "mask": np.array([[True, False], [False, True]]),
    "ids": np.array([[7, 8, 9]], dtype=np.int64),
}


def joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


@pytest.fixture
def ends() -> Iterator[tuple[Channel, Channel]]:
    """A channel's two ends, connected; every receive has a deadline."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    yield Channel(a), Channel(b)
    a.close()
    b.close()


def test_frames_cut_anywhere_in_the_stream_come_out_whole_and_in_order() -> None:
    stream = joined(frame({"id": 1}, b"abc", b"", b"de")) + joined(frame({"op": "table"})) + joined(frame({"id": 3}))
    for cut in (1, 3, 8, len(stream)):
        reader, got = FrameReader(), []
        for start in range(0, len(stream), cut):
            got += reader.feed(stream[start : start + cut])
        assert [(h, bytes(p)) for h, p in got] == [({"id": 1}, b"abcde"), ({"op": "table"}, b""), ({"id": 3}, b"")]
        reader.end()  # ended between frames: nothing is missing
    assert FrameReader().feed(stream[:-1])[-1] == ({"op": "table"}, bytearray())  # the last, cut short, waits


def test_tensors_put_in_a_slot_come_back_as_views_of_it() -> None:
    slots = Slots(mmap.mmap(-1, 4 * 4096), 4096)
    assert nbytes(TENSORS) == 96 + 4 + 24
    places = slots.put(2, TENSORS)
    assert [p[:2] for p in places] == [["image", "<f4"], ["mask", "|b1"], ["ids", "<i8"]]
    took = slots.take(2, [[n, d, list(s), o] for n, d, s, o in places])  # as a header brings them: lists
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(took[name], a)
        assert took[name].dtype == a.dtype
    slots.put(2, {"image": np.zeros((2, 3, 4), np.float32)})
    assert not took["image"].any()  # views of the slot, not copies
    assert slots.take(1, [["image", "<f4", [2, 3, 4], 0]])["image"].sum() == 0  # other slots untouched


def test_tensors_inline_in_a_payload_come_back_whole() -> None:
    places, parts = inline({**TENSORS, "strided": np.arange(10, dtype=np.int32)[::2]})
    ((header, payload),) = FrameReader().feed(joined(frame({"outputs": places}, *parts)))
    got = from_payload(payload, header["outputs"])
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(got[name], a)
    np.testing.assert_array_equal(got["strided"], [0, 2, 4, 6, 8])


def test_a_record_dtype_survives_the_json_round_trip() -> None:
    dtype = np.dtype([("ids", "<i8", (4,)), ("length", "<i4"), ("pixels", [("r", "u1"), ("g", "u1")])], align=True)
    assert dtype_of(orjson.loads(orjson.dumps(descr(dtype)))) == dtype
    assert dtype_of(orjson.loads(orjson.dumps(descr(np.dtype(np.float16))))) == np.float16


def test_a_channel_carries_named_tensors_and_errors_both_ways(ends: tuple[Channel, Channel]) -> None:
    near, far = ends
    places, parts = inline(TENSORS)
    near.send({"op": "infer", "id": 1, "inputs": places}, *parts)
    near.send({"id": 2, "error": error_to_wire(DeadlineExceededError("late"))})
    frames = far.frames()
    head, payload = next(frames)
    assert (head["op"], head["id"]) == ("infer", 1)
    got = from_payload(payload, head["inputs"])
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(got[name], a)
        assert got[name].dtype == a.dtype
    head, payload = next(frames)
    assert head["id"] == 2
    assert payload == b""
    with pytest.raises(DeadlineExceededError, match="late"):
        raise error_from_wire(head["error"])
    # And back: the other end answers on the same socket.
    far.send({"id": 1, "error": error_to_wire(ModelNotReadyError("warming up"))})
    head, _ = next(near.frames())
    assert isinstance(error_from_wire(head["error"]), ModelNotReadyError)


def test_a_slot_handed_over_with_its_memfd_is_the_same_memory_at_both_ends(ends: tuple[Channel, Channel]) -> None:
    near, far = ends
    mine, fd = Slots.create("halfserve-test-slots", 4, 4096)
    try:
        socket.send_fds(near.sock, [b"slots"], [fd])  # as a front-end's hello hands its memfd
    finally:
        os.close(fd)
    _, (theirs_fd,), _, _ = socket.recv_fds(far.sock, 16, 1)
    theirs = Slots(mmap.mmap(theirs_fd, 4 * 4096), 4096)
    os.close(theirs_fd)
    near.send({"id": 7, "slot": 3, "inputs": mine.put(3, TENSORS)})
    head, payload = next(far.frames())
    assert payload == b""  # the tensors did not travel in the frame
    took = theirs.take(head["slot"], head["inputs"])
    np.testing.assert_array_equal(took["image"], TENSORS["image"])
    far.send({"id": 7, "slot": 3, "outputs": theirs.put(3, {"logits": np.full((2, 5), 3.0, np.float32)})})
    head, _ = next(near.frames())
    np.testing.assert_array_equal(mine.take(head["slot"], head["outputs"])["logits"], np.full((2, 5), 3.0))
    del took
    theirs.memory.close()
    mine.memory.close()


def test_an_exported_region_is_found_handed_over_and_forgotten() -> None:
    slots, fd = Slots.create("halfserve-test-export", 2, 4096)
    forgotten: list[int] = []
    stop = exports.on_withdraw(forgotten.append)
    withdraw = exports.export(slots.memory, fd)
    os.close(fd)
    side, their_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    their_side.settimeout(5)
    try:
        slots.put(1, {"x": np.arange(6, dtype=np.int32)})
        chunk = slots.take(1, [["x", "<i4", [6], 0]])["x"]
        found = exports.locate(chunk)
        assert found is not None
        region, offset = found
        assert offset == 4096
        assert exports.locate(np.arange(6, dtype=np.int32)) is None  # not in exported memory: copied instead
        exports.hand(side, region)
        imported = exports.ImportedRegions(their_side, pin=None)
        seen = np.frombuffer(imported.get(region.id), np.int32, 6, offset)
        np.testing.assert_array_equal(seen, np.arange(6))
        del seen, chunk
        imported.forget(region.id)
        withdraw()
        assert forgotten == [region.id]
    finally:
        stop()
        side.close()
        their_side.close()
        slots.memory.close()


def test_an_instance_memory_refuses_outputs_past_its_region() -> None:
    memory, other = InstanceMemory.create("halfserve-test-instance", 64, 32)
    os.close(other)
    try:
        np.copyto(memory.inputs(np.dtype(np.float32), 2, (4,)), np.ones((2, 4), np.float32))
        assert memory.inputs(np.dtype(np.float32), 2, (4,)).sum() == 8
        out = memory.output(np.dtype(np.float32), (8,), 0)
        assert out is not None
        assert out.shape == (8,)
        assert memory.output(np.dtype(np.float32), (9,), 0) is None  # travels in the frame instead
        del out
    finally:
        memory.close()


def test_the_op_an_instance_took_is_read_by_the_other_end_and_spares_its_regions() -> None:
    memory, other = InstanceMemory.create("halfserve-test-instance", 64, 32)
    theirs = InstanceMemory(other, 64, 32)  # the instance process's mapping of the same memfd
    try:
        assert memory.taken == 0  # none yet
        out = theirs.output(np.dtype(np.uint8), (32,), 0)
        assert out is not None
        out[:] = 7
        theirs.took(3)
        assert memory.taken == 3
        assert (memory.output(np.dtype(np.uint8), (32,), 0) == 7).all()  # the id lies past the output region
        del out
    finally:
        theirs.close()
        memory.close()


@pytest.mark.parametrize(
    ("header", "error"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'"op"', "a JSON str, not an object"),
    ],
)
def test_a_malformed_header_is_refused_with_a_clear_error(header: bytes, error: str) -> None:
    good = joined(frame({"id": 1}))
    with pytest.raises(FrameError, match=error):
        FrameReader().feed(good + FRAME.pack(len(header), 0) + header)


def test_a_stream_that_ends_inside_a_frame_is_refused_with_a_clear_error(ends: tuple[Channel, Channel]) -> None:
    near, far = ends
    whole = joined(frame({"id": 1}, b"payload"))
    near.sock.sendall(joined(frame({"id": 0})) + whole[:-3])
    near.sock.close()
    frames = far.frames()
    assert next(frames)[0] == {"id": 0}  # the frames before it arrive
    with pytest.raises(FrameError, match=rf"ended inside a frame: {len(whole) - 3} of its {len(whole)} bytes"):
        next(frames)
    reader = FrameReader()
    reader.feed(whole[:3])
    with pytest.raises(FrameError, match="inside a frame's 8-byte prefix"):
        reader.end()
