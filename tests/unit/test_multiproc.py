"""The multi-process package's pieces on their own: the backplane's frames and slots, a front-end's client of the
engine process over a recording transport, and its model table; no process is spawned."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from halfserve.manifest import Batching, Manifest, TensorSpec
from halfserve.multiproc import wire
from halfserve.multiproc.client import BackplaneClient, RemoteModel, RemoteService
from halfserve.multiproc.wire import FrameReader, Segment, frame
from halfserve.precision import Precision
from halfserve.serving import DeadlineExceededError, InternalError, ModelNotReadyError, ModelState, error_to_wire
from halfserve.settings import Settings
from tests.unit.test_transport import RecordingTransport


def joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def test_frames_cut_anywhere_in_the_stream_come_out_whole_and_in_order() -> None:
    stream = joined(frame({"id": 1}, b"abc", b"", b"de")) + joined(frame({"op": "table"})) + joined(frame({"id": 3}))
    for cut in (1, 3, 8, len(stream)):
        reader, got = FrameReader(), []
        for start in range(0, len(stream), cut):
            got += reader.feed(stream[start : start + cut])
        assert [(h, bytes(p)) for h, p in got] == [({"id": 1}, b"abcde"), ({"op": "table"}, b""), ({"id": 3}, b"")]
    assert FrameReader().feed(stream[:-1])[-1] == ({"op": "table"}, bytearray())  # the last, cut short, waits


TENSORS = {
    "image": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "mask": np.array([[True, False], [False, True]]),
    "ids": np.array([[7, 8, 9]], dtype=np.int64),
}


def test_tensors_put_in_a_slot_come_back_as_views_of_it() -> None:
    segment = Segment(mmap.mmap(-1, 4 * 4096), 4096)
    assert wire.nbytes(TENSORS) == 96 + 4 + 24
    places = segment.put(2, TENSORS)
    assert [p[:2] for p in places] == [["image", "<f4"], ["mask", "|b1"], ["ids", "<i8"]]
    took = segment.take(2, [[n, d, list(s), o] for n, d, s, o in places])  # as a header brings them: lists
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(took[name], a)
        assert took[name].dtype == a.dtype
    segment.put(2, {"image": np.zeros((2, 3, 4), np.float32)})
    assert not took["image"].any()  # views of the slot, not copies
    assert segment.take(1, [["image", "<f4", [2, 3, 4], 0]])["image"].sum() == 0  # other slots untouched


def test_tensors_inline_in_a_payload_come_back_whole() -> None:
    places, parts = wire.inline({**TENSORS, "strided": np.arange(10, dtype=np.int32)[::2]})
    ((header, payload),) = FrameReader().feed(joined(frame({"outputs": places}, *parts)))
    got = wire.from_payload(payload, header["outputs"])
    for name, a in TENSORS.items():
        np.testing.assert_array_equal(got[name], a)
    np.testing.assert_array_equal(got["strided"], [0, 2, 4, 6, 8])


Connected = tuple[BackplaneClient, RecordingTransport, list[list[dict[str, Any]]]]


@pytest.fixture
def connected() -> Iterator[Connected]:
    """A front-end's client as connected to the engine process: what it sends is recorded, the tables it is pushed
    kept."""
    tables: list[list[dict[str, Any]]] = []
    client = BackplaneClient(tables.append, lambda regions: None)
    transport = RecordingTransport()
    client.connection_made(transport)
    yield client, transport, tables
    client.segment.memory.close()
    os.close(client._fd)


def sent(transport: RecordingTransport) -> list[tuple[dict[str, Any], bytearray]]:
    return FrameReader().feed(b"".join(e for e in transport.events if isinstance(e, bytes)))


async def test_a_request_goes_through_a_slot_and_its_slot_is_free_once_answered(connected: Connected) -> None:
    client, transport, _ = connected
    remote = remote_model("tiny", 3)
    x = {"features": np.ones((2, 16), np.float32)}
    free = len(client.free)
    future = client.send(remote, x, 0.5)
    await asyncio.sleep(0)  # coalesced writes go out at the end of the iteration
    ((head, payload),) = sent(transport)
    assert (head["op"], head["model"], head["version"], head["timeout"]) == ("infer", "tiny", 3, 0.5)
    assert payload == b""
    assert head["slot"] >= 0
    assert len(client.free) == free - 1
    np.testing.assert_array_equal(client.segment.take(head["slot"], head["inputs"])["features"], x["features"])
    # The engine process answers into the same slot.
    places = client.segment.put(head["slot"], {"logits": np.full((2, 4), 2.0, np.float32)})
    client.data_received(
        joined(frame({"id": head["id"], "precision": "fp16", "slot": head["slot"], "outputs": places}))
    )
    prediction = await future
    assert prediction.precision == "fp16"
    np.testing.assert_array_equal(prediction.outputs["logits"], np.full((2, 4), 2.0, np.float32))
    client.segment.put(head["slot"], {"logits": np.zeros((2, 4), np.float32)})
    assert prediction.outputs["logits"].all()  # copied out of the slot, which the next request reuses
    assert len(client.free) == free


async def test_inputs_larger_than_a_slot_travel_inline_and_errors_come_back_as_raised(connected: Connected) -> None:
    client, transport, _ = connected
    remote = remote_model("big", 1)
    rows = wire.SLOT_BYTES // (16 * 4) + 1
    x = {"features": np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)}
    future = client.send(remote, x, None)
    await asyncio.sleep(0)
    ((head, payload),) = sent(transport)
    assert head["slot"] == -1
    np.testing.assert_array_equal(wire.from_payload(payload, head["inputs"])["features"], x["features"])
    client.data_received(joined(frame({"id": head["id"], "error": error_to_wire(DeadlineExceededError("late"))})))
    with pytest.raises(DeadlineExceededError, match="late"):
        await future
    other = client.send(remote, {"features": x["features"][:1]}, None)
    await asyncio.sleep(0)
    rid = sent(transport)[-1][0]["id"]
    client.data_received(joined(frame({"id": rid, "error": error_to_wire(KeyError("x"))})))
    with pytest.raises(InternalError, match="KeyError"):
        await other


async def test_a_cancelled_request_keeps_its_slot_until_the_engine_process_answers(connected: Connected) -> None:
    client, transport, _ = connected
    remote = remote_model("tiny", 1)
    free = len(client.free)
    future = client.send(remote, {"features": np.ones((1, 16), np.float32)}, None)
    future.cancel()
    await asyncio.sleep(0)
    ((head, _),) = sent(transport)
    assert len(client.free) == free - 1  # the engine process may still write into it
    client.data_received(joined(frame({"id": head["id"], "precision": "fp32", "slot": head["slot"], "outputs": []})))
    assert len(client.free) == free


async def test_a_lost_connection_fails_what_is_pending_and_refuses_what_comes_next(connected: Connected) -> None:
    client, _, tables = connected
    remote = remote_model("tiny", 1)
    future = client.send(remote, {"features": np.ones((1, 16), np.float32)}, None)
    client.data_received(joined(frame({"models": [{"name": "x"}], "regions": []})))  # a pushed table
    assert tables == [[{"name": "x"}]]
    assert client.table_seen.is_set()
    client.connection_lost(None)
    with pytest.raises(ModelNotReadyError, match="gone"):
        await future
    with pytest.raises(ModelNotReadyError, match="not connected"):
        client.send(remote, {"features": np.ones((1, 16), np.float32)}, None)


def entry(name: str, version: int = 1, state: str = "ready", precision: str | None = "fp32") -> dict[str, Any]:
    manifest = Manifest.model_validate(
        {
            "name": name,
            "architecture": "mlp",
            "inputs": [TensorSpec(name="features", shape=[16])],
            "outputs": [TensorSpec(name="logits", shape=[4])],
        }
    )
    return {
        "name": name,
        "version": version,
        "state": state,
        "error": None,
        "precision": precision,
        "manifest": manifest.model_dump(mode="json"),
        "batching": Batching().model_dump(mode="json"),
    }


def remote_model(name: str, version: int) -> RemoteModel:
    """A model as a front-end's table holds it."""
    service = RemoteService(Settings())
    service.update([entry(name, version)])
    return service.get(name)


def test_the_model_table_keeps_decoded_manifests_until_a_version_or_precision_changes() -> None:
    service = RemoteService(Settings())
    assert not service.ready  # no table yet
    service.update([entry("a"), entry("b", state="loading")])
    a, b = service.get("a"), service.get("b")
    assert (a.version, a.precision, a.manifest.inputs[0].name) == (1, Precision.FP32, "features")
    assert not service.ready  # b is loading
    service.update([entry("a"), entry("b")])
    assert service.ready
    assert service.get("a") is a
    assert service.get("b") is b
    assert b.state is ModelState.READY
    service.update([entry("a", precision="bf16"), entry("b", version=2), entry("c", state="unloaded")])
    assert service.get("a") is not a
    assert service.get("a").precision is Precision.BF16
    assert service.get("b").version == 2
    assert service.ready  # an unloaded model does not hold readiness back
    service.update([entry("a")])
    assert set(service.models) == {"a"}  # gone from the table, gone here
