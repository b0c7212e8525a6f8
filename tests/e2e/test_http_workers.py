"""``halfserve serve --http-workers 2``: front-end processes feeding one engine process, as real processes on 127.0.0.1.

What must hold: answers equal the single-process server's (same model, same rows), requests from both front-ends are
batched together, bad input is a 4xx naming the field while the rest are answered, the routes relayed to the engine
process (listings, metrics, management) behave as without front-ends, an unloaded model is refused as without them, a
killed front-end is replaced, SIGTERM drains every front-end's requests before the engine process exits, and a killed
engine process takes its front-ends (and so the port) with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from halfserve.cli import listen
from halfserve.ipc.frames import FrameReader, frame
from halfserve.multiproc.client import SLOT_BYTES
from tests.conftest import SHIPPED_STORE, ServerProcess, free_port, start_server
from tests.e2e.test_server import fp32_reference, samples
from tests.e2e.test_startup_failures import running
from tests.listening import listening_ports
from tests.waiting import DEADLINE_S, until, wait_until

MODEL = "digits_mlp"
TOKEN = "workers-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def frontends(server: ServerProcess) -> list[int]:
    """The front-end processes: the engine process's children that serve HTTP (not multiprocessing's tracker)."""
    found = []
    for pid in children(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            found.append(pid)
    return found


async def post_many(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    """Each body on its own connection, all at once (connections spread over the front-ends)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        return await asyncio.gather(*(client.post("/predict", json=b) for b in bodies))


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def management_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def workers_server(server_factory: StartServer, grpc_port: int, management_port: int) -> ServerProcess:
    return server_factory(
        SHIPPED_STORE,
        "--models",
        f"{MODEL},digits_cnn",
        "--http-workers",
        "2",
        "--precision",
        "fp32",
        "--max-delay-ms",
        "20",
        "--max-request-rows",  # one request larger than a backplane slot
        "4096",
        "--admin-token",
        TOKEN,
        "--grpc",
        "--grpc-port",
        str(grpc_port),
        "--torchserve-management-port",
        str(management_port),
    )


def test_two_front_ends_answer_like_one_process_and_batch_together(workers_server: ServerProcess) -> None:
    assert len(frontends(workers_server)) == 2
    x = samples(64)
    before = httpx.get(f"{workers_server.url}/models/{MODEL}/stats").json()
    responses = asyncio.run(post_many(workers_server.url, [{"model": MODEL, "inputs": [row.tolist()]} for row in x]))
    after = httpx.get(f"{workers_server.url}/models/{MODEL}/stats").json()
    assert [r.status_code for r in responses] == [200] * 64
    got = np.array([r.json()["outputs"][0] for r in responses])
    np.testing.assert_allclose(got, fp32_reference(x), rtol=1e-4, atol=1e-4)
    assert {r.json()["precision"] for r in responses} == {"fp32"}
    rows, batches = after["rows"] - before["rows"], after["batches"] - before["batches"]
    assert rows == 64
    assert batches < 32, f"64 concurrent requests ran as {batches} batches: not batched"
    log = workers_server.log.read_text()
    assert "front-end 0 (pid" in log
    assert "front-end 1 (pid" in log
    # The address, which the front-ends' servers do not log (a port 0 had been known only to ss).
    assert f"HTTP on {workers_server.url.removeprefix('http://')}, answered by 2 front-end processes" in log


def test_v2_binary_through_a_front_end_including_a_request_larger_than_a_slot(workers_server: ServerProcess) -> None:
    client = triton.InferenceServerClient(workers_server.url.removeprefix("http://"))
    rows = SLOT_BYTES // (256 * 4) + 500  # its input travels inline on the backplane, not through shared memory
    for n in (3, rows):
        x = samples(n, seed=n)
        tensor = triton.InferInput("pixels", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        result = client.infer(MODEL, [tensor], outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
        np.testing.assert_allclose(result.as_numpy("logits"), fp32_reference(x), rtol=1e-4, atol=1e-4)


def test_kserve_v1_is_answered_by_the_front_ends_including_a_body_past_the_relay_cap(
    workers_server: ServerProcess,
) -> None:
    """V1's predict had been relayed to the engine process as a listing is, its body held to 64 KiB: 40 rows of the
    MLP were a 413 ("exceed a management call's limit") that /predict served."""
    x = samples(40)
    body = {"instances": x.tolist()}
    assert len(json.dumps(body)) > 64 * 1024
    r = httpx.post(f"{workers_server.url}/v1/models/{MODEL}:predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["predictions"]), fp32_reference(x), rtol=1e-4, atol=1e-4)
    ready = httpx.get(f"{workers_server.url}/v1/models/{MODEL}", timeout=30)
    assert (ready.status_code, ready.json()) == (200, {"name": MODEL, "ready": True})


def _region_found(url: str, x: np.ndarray, connections: int = 8) -> list[bool]:
    """Whether each of ``connections`` new connections (spread over both front-ends) finds region 'images'."""
    found = []
    for _ in range(connections):
        client = triton.InferenceServerClient(url)
        tensor = triton.InferInput("pixels", list(x.shape), "FP32")
        tensor.set_shared_memory("images", x.nbytes)
        try:
            client.infer(MODEL, [tensor], headers=AUTH)
            found.append(True)
        except InferenceServerException as e:
            if "no shared memory region 'images'" not in str(e):
                raise
            found.append(False)
        finally:
            client.close()
    return found


def test_shared_memory_regions_reach_every_front_end(workers_server: ServerProcess) -> None:
    """A region registered through one front-end is mapped by both (each decodes and encodes its own requests) by the
    time the registration is answered; once an unregistration is answered, neither takes it."""
    url = workers_server.url.removeprefix("http://")
    key = f"/halfserve-workers-{os.getpid()}"
    x = samples(4, seed=5)
    handle = shm.create_shared_memory_region("images", key, 2 * x.nbytes)
    admin = triton.InferenceServerClient(url)
    try:
        shm.set_shared_memory_region(handle, [x])
        # Each change is answered only once both front-ends have it: the next request finds it, whichever takes it.
        for _ in range(3):
            admin.register_system_shared_memory("images", key, 2 * x.nbytes, headers=AUTH)
            assert _region_found(url, x) == [True] * 8
            admin.unregister_system_shared_memory("images", headers=AUTH)
            assert _region_found(url, x) == [False] * 8
        admin.register_system_shared_memory("images", key, 2 * x.nbytes, headers=AUTH)
        for _ in range(8):  # a new connection each time: both front-ends answer some
            client = triton.InferenceServerClient(url)
            tensor = triton.InferInput("pixels", list(x.shape), "FP32")
            tensor.set_shared_memory("images", x.nbytes)
            out = triton.InferRequestedOutput("logits", binary_data=True)
            out.set_shared_memory("images", 4 * 10 * 4, offset=x.nbytes)
            result = client.infer(MODEL, [tensor], outputs=[out], headers=AUTH)
            assert result.get_output("logits")["shape"] == [4, 10]
            got = shm.get_contents_as_numpy(handle, np.float32, [4, 10], offset=x.nbytes)
            np.testing.assert_allclose(got, fp32_reference(x), rtol=1e-4, atol=1e-4)
            shm.set_shared_memory_region(handle, [np.zeros((4, 10), np.float32)], offset=x.nbytes)
            client.close()
        admin.unregister_system_shared_memory(headers=AUTH)  # every region
        assert _region_found(url, x) == [False] * 8
    finally:
        admin.close()
        shm.destroy_shared_memory_region(handle)


def test_a_region_registered_over_grpc_reaches_every_front_end(workers_server: ServerProcess, grpc_port: int) -> None:
    """gRPC is served by the engine process: its registrations too are answered once both front-ends have them."""
    url = workers_server.url.removeprefix("http://")
    key = f"/halfserve-workers-grpc-{os.getpid()}"
    x = samples(2, seed=6)
    handle = shm.create_shared_memory_region("images", key, x.nbytes)
    admin = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    metadata = {"authorization": AUTH["Authorization"]}  # gRPC metadata keys are lower case
    try:
        shm.set_shared_memory_region(handle, [x])
        for _ in range(3):
            admin.register_system_shared_memory("images", key, x.nbytes, headers=metadata)
            assert _region_found(url, x) == [True] * 8
            admin.unregister_system_shared_memory("images", headers=metadata)
            assert _region_found(url, x) == [False] * 8
    finally:
        admin.close()
        shm.destroy_shared_memory_region(handle)


def test_bad_requests_get_4xx_naming_the_problem_while_good_ones_are_answered(workers_server: ServerProcess) -> None:
    good = [{"model": MODEL, "inputs": [row.tolist()]} for row in samples(24)]
    bad: list[dict[str, object]] = [
        {"model": MODEL, "inputs": [[1.0, 2.0]]},
        {"model": "no_such_model", "inputs": [[0.0] * 256]},
        {"model": MODEL},
    ]
    responses = asyncio.run(post_many(workers_server.url, good + bad))
    assert [r.status_code for r in responses[:24]] == [200] * 24
    statuses = [(r.status_code, r.json()["error"]) for r in responses[24:]]
    assert statuses[0][0] == 400
    assert "shape [256]" in statuses[0][1]
    assert statuses[1][0] == 404
    assert "no_such_model" in statuses[1][1]
    assert statuses[2][0] == 400
    assert statuses[2][1].startswith("inputs:")
    # One model's entry, relayed to the engine process as the listing is.
    one = httpx.get(f"{workers_server.url}/models/{MODEL}", timeout=30)
    assert one.status_code == 200, one.text
    assert (one.json()["name"], one.json()["execution"]["instances"]) == (MODEL, 1)
    unknown = httpx.get(f"{workers_server.url}/models/no_such_model", timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"].startswith("Request for unknown model: 'no_such_model' is not found")
    for method, path in (("PUT", f"/predictions/{MODEL}/"), ("GET", f"/models/{MODEL}/"), ("POST", "/v2/health/")):
        slash = httpx.request(method, f"{workers_server.url}{path}", headers={"Host": "10.9.9.9:1"}, timeout=30)
        assert (slash.status_code, slash.headers.get("location")) == (404, None), path  # not redirected


def test_metrics_count_the_front_ends_requests(workers_server: ServerProcess) -> None:
    def answered() -> float:
        text = httpx.get(f"{workers_server.url}/metrics").text
        prefix = f'halfserve_requests_total{{model="{MODEL}",precision="fp32",protocol="predict",status="200"}}'
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    start = answered()
    deadline = time.monotonic() + DEADLINE_S
    while True:  # earlier tests' counts may still be on their way: wait until three flush intervals add none
        assert time.monotonic() < deadline, "the front-ends' request counts never stopped growing"
        time.sleep(0.3)
        now = answered()
        if now == start:
            break
        start = now
    asyncio.run(post_many(workers_server.url, [{"model": MODEL, "inputs": [row.tolist()]} for row in samples(20)]))
    wait_until(lambda: answered() >= start + 20, "the front-ends' counts of 20 requests")  # sent every 0.1 s
    assert answered() == start + 20


def test_torchserve_management_is_the_engine_process_s(workers_server: ServerProcess, management_port: int) -> None:
    described = httpx.get(f"http://127.0.0.1:{management_port}/models/{MODEL}").json()
    assert [d["modelName"] for d in described] == [MODEL]
    assert all(w["status"] == "READY" for w in described[0]["workers"])
    assert management_port in listening_ports(workers_server.proc.pid)
    for pid in frontends(workers_server):
        assert management_port not in listening_ports(pid)


def test_a_precision_switch_relayed_through_a_front_end_reaches_every_front_end(workers_server: ServerProcess) -> None:
    url = workers_server.url
    x = samples(1)
    body = {"model": MODEL, "inputs": x.tolist()}
    r = httpx.post(f"{url}/models/{MODEL}/precision", json={"precision": "bf16"}, headers=AUTH)
    assert r.status_code == 200, r.text
    try:
        # The other front-end's table is pushed within 0.05 s on a quiet host: 16 new connections reach both.
        wait_until(
            lambda: {resp.json()["precision"] for resp in asyncio.run(post_many(url, [body] * 16))} == {"bf16"},
            "bf16 answers through every front-end",
        )
        unauthorised = httpx.post(f"{url}/models/{MODEL}/precision", json={"precision": "fp32"})
        assert unauthorised.status_code == 401
    finally:
        r = httpx.post(f"{url}/models/{MODEL}/precision", json={"precision": "fp32"}, headers=AUTH)
        assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/predict", json=body).json()["precision"] == "fp32"


def test_a_killed_front_end_is_replaced(workers_server: ServerProcess) -> None:
    victim = frontends(workers_server)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = frontends(workers_server)
        if len(alive) == 2 and victim not in alive:
            break
        time.sleep(0.2)
    assert victim not in frontends(workers_server)
    assert len(frontends(workers_server)) == 2
    responses = asyncio.run(post_many(workers_server.url, [{"model": MODEL, "inputs": [[0.5] * 256]}] * 16))
    assert [r.status_code for r in responses] == [200] * 16
    assert "exited with -9; restarting it" in workers_server.log.read_text()


def test_sigterm_answers_every_front_ends_requests_then_exits(tmp_path: Path) -> None:
    # 24 rows never fill a batch of 64: they wait out the 1 s delay in the queue, in flight when the signal comes.
    args = ("--models", MODEL, "--http-workers", "2", "--max-delay-ms", "1000", "--max-batch-size", "64")
    scratch = tmp_path / "tmp"  # where the server makes its front-ends' socket directory
    scratch.mkdir()
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", *args, env={"TMPDIR": str(scratch)})
    workers = frontends(server)
    assert [p.name.startswith("halfserve-") for p in scratch.iterdir()] == [True]
    bodies = [{"model": MODEL, "inputs": samples(1, seed=i).tolist()} for i in range(24)]

    def accepted() -> int:
        return int(httpx.get(f"{server.url}/models/{MODEL}/stats", timeout=10).json()["requests"])

    async def load_then_stop() -> list[httpx.Response]:
        requests = asyncio.ensure_future(post_many(server.url, bodies))
        # Every request in flight, through both front-ends, before the signal: one sent after it is refused (the
        # port closes), as it should be.
        await until(lambda: accepted() == len(bodies), "every request accepted", every=0.05)
        server.proc.send_signal(signal.SIGTERM)
        return await requests

    try:
        responses = asyncio.run(load_then_stop())
        assert server.proc.wait(timeout=60) == 0  # a drained shutdown exits 0 (uvicorn would re-raise the signal)
    finally:
        server.stop()
    assert list(scratch.iterdir()) == [], "the front-ends' socket directory is left behind"
    assert [r.status_code for r in responses] == [200] * len(bodies)
    assert all(not Path(f"/proc/{pid}").exists() for pid in workers)
    assert "24 requests accepted, 24 answered with outputs" in server.log.read_text()


def test_keep_alive_clients_sending_through_sigterm_lose_no_request(tmp_path: Path) -> None:
    """Clients sending without a pause on keep-alive connections get answers through a SIGTERM, then a refused
    connection once the port is closed: never a request written and left unanswered (a ReadError or a
    RemoteProtocolError). The engine process held the listening socket until its front-ends had drained, so a client
    whose connection the drain closed connected again into a backlog nobody accepted from, and lost its request to a
    reset; and the drain closed a connection between two requests at once, losing the one its client had written."""
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", "--models", MODEL, "--http-workers", "2")
    clients, body = 8, {"model": MODEL, "inputs": samples(1).tolist()}
    answered = [0] * clients
    statuses: Counter[int] = Counter()
    lost: list[str] = []

    async def send_until_refused(http: httpx.AsyncClient, i: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                r = await http.post("/predict", json=body)
            except httpx.ConnectError:
                return  # the port is closed
            except httpx.TransportError as e:
                lost.append(f"{type(e).__name__}: {e}")
                continue
            statuses[r.status_code] += 1
            answered[i] += 1
        lost.append(f"client {i}: never refused")

    async def send_through_sigterm() -> None:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=DEADLINE_S) as http:
            sending = asyncio.gather(*(send_until_refused(http, i) for i in range(clients)))
            await until(lambda: min(answered) >= 3, "every client answered on a kept connection")
            server.proc.send_signal(signal.SIGTERM)
            await sending

    try:
        asyncio.run(send_through_sigterm())
        assert server.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        server.stop()
    assert lost == []
    assert set(statuses) == {200}


def unloaded_answers(url: str, model: str, tries: int) -> set[tuple[str, int, str]]:
    """Each inference route's answers (route, status, error) for ``model`` once it is unloaded, each asked ``tries``
    times on a new connection (front-ends take them in turn)."""
    v2 = {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}]}
    requests = {
        "/predict": {"model": model, "inputs": [[[[0.5] * 8] * 8]]},
        f"/v2/models/{model}/versions/1/infer": v2,
        f"/v2/models/{model}/infer": v2,
        f"/v1/models/{model}:predict": {"instances": [[[[0.5] * 8] * 8]]},
    }
    return {
        (route, r.status_code, r.json()["error"])
        for route, body in requests.items()
        for r in (httpx.post(url + route, json=body, timeout=30) for _ in range(tries))
    }


def test_an_unloaded_model_is_refused_as_without_front_ends(
    workers_server: ServerProcess, server_factory: StartServer
) -> None:
    """The routes refuse an unloaded model with the single process's status and words (`/predict` 503 "is unloaded",
    V2 503 with a version in the path, 404 without one), whichever process takes the request."""
    model = "digits_cnn"
    single = server_factory(SHIPPED_STORE, "--models", model, "--admin-token", TOKEN)
    for server in (single, workers_server):
        r = httpx.post(f"{server.url}/models/{model}/unload", headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    try:
        expected = unloaded_answers(single.url, model, 1)
        assert {(route, status) for route, status, _ in expected} == {
            ("/predict", 503),
            (f"/v2/models/{model}/versions/1/infer", 503),
            (f"/v2/models/{model}/infer", 404),
            (f"/v1/models/{model}:predict", 503),
        }
        assert unloaded_answers(workers_server.url, model, 4) == expected
    finally:
        r = httpx.post(f"{workers_server.url}/models/{model}/load", headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text


def can_listen(port: int) -> bool:
    try:
        listen("127.0.0.1", port).close()  # as the server binds it
    except OSError:
        return False
    return True


def test_a_killed_engine_process_takes_its_front_ends_and_the_port_with_it(tmp_path: Path) -> None:
    """SIGKILL of the engine process (the OOM killer's) leaves no front-end behind holding the port and answering 503:
    each exits, saying why, and a server can listen on the port again."""
    server = start_server(SHIPPED_STORE, tmp_path / "server.log", "--models", MODEL, "--http-workers", "2")
    workers = frontends(server)
    port = int(server.url.rsplit(":", 1)[1])
    assert len(workers) == 2
    try:
        server.proc.kill()
        server.proc.wait(timeout=DEADLINE_S)
        wait_until(lambda: not any(running(pid) for pid in workers), "the front-ends' exit")
        wait_until(lambda: can_listen(port), f"port {port} free to listen on")
    finally:
        for pid in workers:  # left behind: not this test's to leave running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = server.log.read_text()
    for pid in workers:
        assert f"(pid {pid}): the engine process (pid {server.proc.pid}) is gone; exiting" in log
    # The engine process's temporary folder (its sockets), which it could not remove, had been left in /tmp.
    (folder,) = set(re.findall(r"unix socket (/\S+)/api\.sock", log))
    wait_until(lambda: not Path(folder).exists(), f"{folder} removed")


def test_frames_split_anywhere_are_reassembled() -> None:
    stream = b"".join(bytes(p) for p in frame({"op": "infer", "id": 1}, b"\x01\x02\x03") + frame({"id": 2}))
    reader = FrameReader()
    got = []
    for i in range(len(stream)):  # one byte at a time
        got += reader.feed(stream[i : i + 1])
    assert [(h, bytes(p)) for h, p in got] == [({"op": "infer", "id": 1}, b"\x01\x02\x03"), ({"id": 2}, b"")]
