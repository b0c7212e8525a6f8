"""The multi-process package's pieces on their own: a front-end's client of the engine process over a recording
transport, and its model table; no process is spawned (the frames and slots themselves: tests/unit/test_ipc.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from halfserve.api.dataplane.metadata import metadata
from halfserve.errors import (
    DeadlineExceededError,
    InternalError,
    ModelNotReadyError,
    ModelUnavailableError,
    error_to_wire,
)
from halfserve.execution import Batching
from halfserve.ipc.frames import FrameReader, frame
from halfserve.ipc.memory import Slots
from halfserve.ipc.tensors import from_payload, inline
from halfserve.manifest import Manifest, Precision, TensorSpec
from halfserve.metrics import Metrics
from halfserve.multiproc import engine_side, frontend
from halfserve.multiproc.client import SLOT_BYTES, BackplaneClient, RemoteModel, RemoteService
from halfserve.multiproc.engine_side import Backplane, _Connection
from halfserve.regions import Regions
from halfserve.repository import ModelRepository
from halfserve.served import ServedModel
from halfserve.serving import ModelState, check_ready
from halfserve.settings import Settings
from tests.unit.test_transport import RecordingTransport
from tests.waiting import DEADLINE_S


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


async def test_a_table_pushed_with_a_number_is_applied_then_acknowledged(connected: Connected) -> None:
    client, transport, tables = connected
    client.data_received(joined(frame({"op": "table", "models": [{"name": "x"}], "regions": []})))
    await asyncio.sleep(0)
    assert sent(transport) == []  # the periodic push asks for no answer
    client.data_received(joined(frame({"op": "table", "ack": 7, "models": [{"name": "y"}], "regions": []})))
    await asyncio.sleep(0)
    assert tables == [[{"name": "x"}], [{"name": "y"}]]
    assert [h for h, _ in sent(transport)] == [{"op": "ack", "ack": 7}]


def backplane_with(
    connections: int, *served: ServedModel
) -> tuple[Backplane, list[tuple[_Connection, RecordingTransport]]]:
    """The engine process's end, serving ``served``, with ``connections`` front-ends connected over recording
    transports."""
    models = {s.name: s for s in served}
    repo = cast(ModelRepository, SimpleNamespace(models=models, get=models.__getitem__))
    backplane = Backplane("/nonexistent", repo, cast(Metrics, None), connections, Regions(most=256), "secret")
    made = []
    for _ in range(connections):
        c = _Connection(backplane, cast(Slots, None))
        backplane.connections.add(c)
        transport = RecordingTransport()
        c.connection_made(transport)
        made.append((c, transport))
    return backplane, made


async def test_a_change_is_published_once_every_front_end_applied_it_or_is_gone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    backplane, [(first, t1), (second, t2), (third, t3)] = backplane_with(3)
    publishing = asyncio.create_task(backplane.publish())
    await asyncio.sleep(0.01)
    pushed = [sent(t)[-1][0] for t in (t1, t2, t3)]
    assert {h["ack"] for h in pushed} == {pushed[0]["ack"]}
    assert [(h["op"], h["models"], h["regions"]) for h in pushed] == [("table", [], [])] * 3
    number = pushed[0]["ack"]
    first.data_received(joined(frame({"op": "ack", "ack": number})))
    second.data_received(joined(frame({"op": "ack", "ack": number + 1})))  # not this table's
    await asyncio.sleep(0.01)
    assert not publishing.done()  # the second and third have not applied it
    second.data_received(joined(frame({"op": "ack", "ack": number})))
    third.connection_lost(None)  # a front-end that is gone holds nothing up
    await asyncio.wait_for(publishing, 1)
    assert all(not c.acks for c in (first, second, third))

    # A front-end that never answers holds the change up for PUBLISH_TIMEOUT_S only, and is logged. (The first is
    # gone before the change, not acknowledging after it: an answer racing the time limit would depend on the host.)
    monkeypatch.setattr(engine_side, "PUBLISH_TIMEOUT_S", 0.05)
    first.connection_lost(None)
    with caplog.at_level(logging.WARNING, logger=engine_side.__name__):
        await asyncio.wait_for(backplane.publish(), 1)
    assert "1 front-end(s) did not apply a new table within 0.05 s" in caplog.text
    assert not second.acks


async def test_a_front_end_that_relays_a_change_is_answered_once_the_change_is_published() -> None:
    backplane, [(relaying, t1), (other, t2)] = backplane_with(2)
    relaying.data_received(joined(frame({"op": "publish", "id": 41})))
    await asyncio.sleep(0.01)
    number = sent(t2)[-1][0]["ack"]
    relaying.data_received(joined(frame({"op": "ack", "ack": number})))
    await asyncio.sleep(0.01)
    assert {"id": 41} not in [h for h, _ in sent(t1)]  # the other front-end has not applied it yet
    other.data_received(joined(frame({"op": "ack", "ack": number})))
    await asyncio.sleep(0.01)
    assert sent(t1)[-1][0] == {"id": 41}


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


def test_a_front_end_s_metadata_carries_the_engine_process_s_precision_record() -> None:
    service = RemoteService(Settings())
    service.update([entry("a", precision="bf16")])
    assert metadata(service.get("a"))["parameters"] == {"precision": "bf16", "precision_record": ""}
    shown = {"check": "trusted", "differs": [], "problem": None, "record": {"precision": "bf16"}}
    service.update([{**entry("a", precision="bf16"), "precision_record": shown}])  # the same version, reloaded
    assert json.loads(metadata(service.get("a"))["parameters"]["precision_record"]) == shown


def test_a_front_end_refuses_an_unloaded_or_failed_model_as_one_process_does_and_leaves_the_rest_to_the_engine() -> (
    None
):
    service = RemoteService(Settings())
    failed = {**entry("broken", state="failed"), "error": "bad checkpoint"}
    service.update([entry("loading", state="loading"), entry("ready"), entry("gone", state="unloaded"), failed])
    check_ready(service.get("loading"), None)  # it may have finished loading since this table was pushed
    check_ready(service.get("ready"), "1")
    with pytest.raises(ModelUnavailableError, match=r"'gone' has no available versions \(unloaded\)"):
        check_ready(service.get("gone"), None)
    with pytest.raises(ModelNotReadyError, match=r"'gone' version 1 is not at ready state \(unloaded\)") as refused:
        check_ready(service.get("gone"), "1")
    assert not refused.value.retry
    with pytest.raises(ModelUnavailableError, match=r"'broken' has no available versions \(bad checkpoint\)"):
        check_ready(service.get("broken"), None)


async def test_the_engine_process_refuses_a_request_for_an_unloaded_model_as_submit_does_in_one_process() -> None:
    manifest = Manifest.model_validate(entry("tiny")["manifest"])
    unloaded = ServedModel("tiny", manifest, 1, Batching(), state=ModelState.UNLOADED)
    _, [(connection, transport)] = backplane_with(1, unloaded)
    places, parts = inline({"features": np.ones((1, 16), np.float32)})
    head = {"op": "infer", "id": 5, "model": "tiny", "version": 1, "timeout": None, "slot": -1, "inputs": places}
    connection.data_received(joined(frame(head, *parts)))
    await asyncio.sleep(0)
    answers = [h for h, _ in sent(transport) if h.get("id") == 5]
    error = {"kind": "ModelNotReadyError", "message": "model 'tiny' is unloaded", "retry": True, "retry_after": 1}
    assert answers == [{"id": 5, "error": error}]


@pytest.mark.parametrize(("orphaned", "said"), [(True, "is gone"), (False, "lost its connection")])
async def test_a_front_end_exits_once_its_engine_connection_is_lost_unless_it_is_stopping(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, orphaned: bool, said: str
) -> None:
    monkeypatch.setattr(frontend, "ORPHANED_WAIT_S", 0.0)
    parent = os.getppid()
    engine = parent + 1 if orphaned else parent  # a parent that is no longer the engine process: it is gone
    app = frontend.FrontendApp(Settings(), "/nonexistent", "/nonexistent", "secret", 0, engine)
    exits: list[None] = []
    app.exit = lambda: exits.append(None)
    with caplog.at_level(logging.ERROR, logger=frontend.__name__):
        app._lost()
        assert app._leaving is not None
        await app._leaving
    assert exits == [None]
    assert app.engine_lost
    assert f"front-end 0 (pid {os.getpid()}): " in caplog.text
    assert said in caplog.text
    assert f"engine process (pid {engine})" in caplog.text

    draining = frontend.FrontendApp(Settings(), "/nonexistent", "/nonexistent", "secret", 1, engine)
    draining.exit = lambda: exits.append(None)
    draining.begin_drain()  # it closes the connection itself as it stops
    draining._lost()
    assert draining._leaving is None
    assert not draining.engine_lost


async def test_a_front_end_whose_engine_process_hangs_up_before_its_table_fails_to_start_at_once(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "backplane.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def hang_up() -> None:  # the engine process, killed once it has read the hello
        conn, _ = await loop.sock_accept(listener)
        await loop.sock_recv(conn, 4096)
        conn.close()

    engine = asyncio.create_task(hang_up())
    lost: list[None] = []
    client = BackplaneClient(lambda models: None, lambda regions: None, lambda: lost.append(None))
    try:
        with pytest.raises(ConnectionError, match="closed the backplane connection before sending its table"):
            await client.connect(path, 0, "secret", timeout=DEADLINE_S)
        await engine
    finally:
        listener.close()
        client.slots.memory.close()
    assert lost == [None]
