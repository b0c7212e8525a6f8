"""TorchServe's management API, its read side, on a real port of its own (``torchserve_management_port``) beside the
app in-process: listing with pagination, describing by name, version and ``all``, TorchServe's errors, the write
calls refused, and no port at all by default."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from halfserve.execution import Execution
from halfserve.settings import Settings
from tests.conftest import PROCESS_ISOLATION, free_port, save_tiny_mlp
from tests.integration.conftest import serving
from tests.listening import listening_ports

NAMES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchserve-management")
    save_tiny_mlp(root, "alpha")
    save_tiny_mlp(root, "beta", execution=Execution(instances=2))
    save_tiny_mlp(root, "gamma")
    return root


@pytest.fixture
async def management(store: Path) -> AsyncIterator[httpx.AsyncClient]:
    port = free_port()
    settings = Settings(store=store, grpc=False, torchserve_management_port=port)
    async with serving(settings), httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        yield client


async def test_lists_the_models_a_page_at_a_time(management: httpx.AsyncClient) -> None:
    everything = (await management.get("/models")).json()
    assert everything == {"models": [{"modelName": n, "modelUrl": f"{n}/1"} for n in NAMES]}
    first = (await management.get("/models", params={"limit": 2})).json()
    assert first["nextPageToken"] == "2"
    assert [m["modelName"] for m in first["models"]] == ["alpha", "beta"]
    rest = (await management.get("/models", params={"limit": 2, "next_page_token": first["nextPageToken"]})).json()
    assert rest == {"models": [{"modelName": "gamma", "modelUrl": "gamma/1"}]}  # the last page has no token
    r = await management.get("/models", params={"limit": "two"})
    assert r.status_code == 400
    assert r.json()["type"] == "BadRequestException"
    assert "limit" in r.json()["message"]


async def test_describes_a_model_by_name_version_and_all(management: httpx.AsyncClient) -> None:
    r = await management.get("/models/beta")
    assert r.status_code == 200, r.text
    [described] = r.json()
    assert described["modelName"] == "beta"
    assert described["modelVersion"] == "1"
    assert described["modelUrl"] == "beta/1"
    assert described["runtime"] == "python"
    assert (described["minWorkers"], described["maxWorkers"]) == (2, 2)
    assert (described["batchSize"], described["maxBatchDelay"]) == (8, 5)
    assert described["loadedAtStartup"] is True
    assert described["jobQueueStatus"] == {"remainingCapacity": 4096, "pendingRequests": 0}
    workers = described["workers"]
    assert [w["id"] for w in workers] == ["0", "1"]
    pids = {w["pid"] for w in workers}
    if PROCESS_ISOLATION:  # the suite's pass with every model's instances in processes of their own
        assert len(pids) == 2
        assert os.getpid() not in pids
        assert all(Path(f"/proc/{pid}").is_dir() for pid in pids)
    else:
        assert pids == {os.getpid()}  # instance threads of this process
    for w in workers:
        assert w["status"] == "READY"
        assert w["gpu"] is False
        assert w["gpuUsage"] == "N/A"
        assert w["startTime"].endswith("Z")
    assert (await management.get("/models/beta/1")).json() == [described]
    assert (await management.get("/models/beta/1.0")).json() == [described]  # as TorchServe's archives spell it
    assert (await management.get("/models/beta/all")).json() == [described]


async def test_unknown_models_and_versions_are_torchserve_s_404s(management: httpx.AsyncClient) -> None:
    r = await management.get("/models/nope")
    assert r.status_code == 404
    assert r.json()["code"] == 404
    assert r.json()["type"] == "ModelNotFoundException"
    assert r.json()["message"] == "Model not found: nope"
    r = await management.get("/models/alpha/7")
    assert r.status_code == 404
    assert r.json()["type"] == "ModelVersionNotFoundException"
    assert "Model version: 7 does not exist for model: alpha" in r.json()["message"]
    r = await management.get("/predictions/alpha")  # the inference API is the main port's
    assert r.status_code == 404
    assert r.json()["type"] == "ResourceNotFoundException"


@pytest.mark.parametrize(
    ("method", "path", "instead", "allow"),
    [
        ("POST", "/models?url=squeezenet.mar", "/models/{name}/load", "GET, HEAD"),
        ("PUT", "/models/alpha?min_worker=3", "/models/alpha/reload", "GET, HEAD"),
        ("DELETE", "/models/alpha/1", "/models/alpha/unload", "GET, HEAD"),
        ("PUT", "/models/alpha/1/set-default", '{"version": N}', ""),
    ],
)
async def test_calls_that_change_something_are_refused_naming_the_call_to_use(
    management: httpx.AsyncClient, method: str, path: str, instead: str, allow: str
) -> None:
    """``Allow`` names what is answered there (RFC 9110 section 15.5.6): HEAD too, as Starlette answers it wherever
    GET is (it named GET alone), and nothing on set-default (it named GET, itself a 405 there)."""
    r = await management.request(method, path)
    assert r.status_code == 405
    assert r.json()["type"] == "MethodNotAllowedException"
    assert instead in r.json()["message"]
    assert r.headers["allow"] == allow
    assert (await management.get("/models/alpha")).status_code == 200  # and it still serves


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PATCH", "/models", "GET, HEAD"),
        ("PATCH", "/models/alpha/1", "GET, HEAD"),
        ("GET", "/models/alpha/1/set-default", ""),
    ],
)
async def test_a_method_no_route_takes_is_a_405_naming_what_is_allowed(
    management: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    """RFC 9110 section 15.5.6: a 405 MUST carry ``Allow`` (it had none)."""
    r = await management.request(method, path)
    assert r.status_code == 405
    assert r.json()["type"] == "MethodNotAllowedException"
    assert r.headers["allow"] == allow
    r = await management.head(path.replace("/set-default", ""))
    assert (r.status_code, r.content) == (200, b"")


async def test_abusive_requests_are_refused_and_it_keeps_serving(management: httpx.AsyncClient) -> None:
    r = await management.get("/models", params={"next_page_token": "9" * 5000})  # past int()'s digit limit
    assert r.json() == {"models": []}  # past every page, not an error that quotes it
    for odd in ("+1", "-1", "1_0", " 1", "\u0661", "\uff11", "1.5", "0x10"):  # int() takes the first six
        for field in ("limit", "next_page_token"):
            r = await management.get("/models", params={field: odd})
            assert r.status_code == 400, (field, odd)
            assert f"{field}: expected an integer (ASCII digits)" in r.json()["message"]
    for token in ("-1", "-3", "-" + "9" * 30):  # TorchServe's own answer is page 0: a poller would loop
        r = await management.get("/models", params={"limit": 2, "next_page_token": token})
        assert (r.status_code, r.json()["type"]) == (400, "BadRequestException"), token
    assert (await management.get("/models", params={"next_page_token": ""})).status_code == 200  # as if absent
    for version in ("1e0", "01", "+1", "1.", "0.99999999999999999", "\u0661", " 1"):  # float() takes them all
        r = await management.get(f"/models/alpha/{version}")
        assert r.json()["type"] == "ModelVersionNotFoundException", version
    r = await management.get("/models/alpha/", headers={"Host": "10.0.0.1"})
    assert r.status_code == 404  # no redirect to a Location built from the Host header
    assert "location" not in r.headers
    r = await management.get("/models/" + "a" * 9000)  # over max_url_bytes: the main port's limits hold here
    assert r.status_code == 414
    r = await management.get("/models", params={"limit": 10**9, "next_page_token": 10**12})
    assert r.json() == {"models": []}
    assert (await management.get("/models/alpha")).status_code == 200


async def test_a_host_the_server_does_not_answer_to_is_refused(management: httpx.AsyncClient) -> None:
    r = await management.get("/models", headers={"Host": "rebound.example"})
    assert r.status_code == 400
    assert "allowed_hosts" in r.json()["error"]


async def test_the_port_is_off_by_default(store: Path) -> None:
    before = listening_ports(os.getpid())
    async with serving(Settings(store=store, grpc=False)) as client:
        assert (await client.get("/models")).status_code == 200
        assert listening_ports(os.getpid()) == before
    port = free_port()
    async with serving(Settings(store=store, grpc=False, torchserve_management_port=port)):
        assert listening_ports(os.getpid()) == before | {port}  # the check would see a port
    assert listening_ports(os.getpid()) == before  # and it is closed with the app


def test_the_port_must_be_its_own() -> None:
    with pytest.raises(ValueError, match="torchserve_management_port"):
        Settings(port=9000, torchserve_management_port=9000)
    with pytest.raises(ValueError, match="grpc_port"):
        Settings(grpc=True, grpc_port=9001, torchserve_management_port=9001)
