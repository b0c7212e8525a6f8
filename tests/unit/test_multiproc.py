"""The multi-process package's pieces on their own: a front-end's client of the engine process over a recording
transport, and its model table; no process is spawned (the frames and slots themselves: tests/unit/test_ipc.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from halfserve.ipc.frames import FrameReader, frame
from halfserve.ipc.tensors import from_payload
from halfserve.manifest import Batching, Manifest, TensorSpec
from halfserve.multiproc.client import SLOT_BYTES, BackplaneClient, RemoteModel, RemoteService
from halfserve.precision import Precision
from halfserve.serving import DeadlineExceededError, InternalError, ModelNotReadyError, ModelState, error_to_wire
from halfserve.settings import Settings
from tests.unit.test_transport import RecordingTransport


def joined(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


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
    client.slots.memory.close()
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
    np.testing.assert_array_equal(client.slots.take(head["slot"], head["inputs"])["features"], x["features"])
    # The engine process answers into the same slot.
    places = client.slots.put(head["slot"], {"logits": np.full((2, 4), 2.0, np.float32)})
    client.data_received(
        joined(frame({"id": head["id"], "precision": "fp16", "slot": head["slot"], "outputs": places}))
    )
    prediction = await future
    assert prediction.precision == "fp16"
    np.testing.assert_array_equal(prediction.outputs["logits"], np.full((2, 4), 2.0, np.float32))
    client.slots.put(head["slot"], {"logits": np.zeros((2, 4), np.float32)})
    assert prediction.outputs["logits"].all()  # copied out of the slot, which the next request reuses
    assert len(client.free) == free


async def test_inputs_larger_than_a_slot_travel_inline_and_errors_come_back_as_raised(connected: Connected) -> None:
    client, transport, _ = connected
    remote = remote_model("big", 1)
    rows = SLOT_BYTES // (16 * 4) + 1
    x = {"features": np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)}
    future = client.send(remote, x, None)
    await asyncio.sleep(0)
    ((head, payload),) = sent(transport)
    assert head["slot"] == -1
    np.testing.assert_array_equal(from_payload(payload, head["inputs"])["features"], x["features"])
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
