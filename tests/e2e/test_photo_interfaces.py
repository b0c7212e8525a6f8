"""Photos through every interface of a real server (issue 51): the same PNGs as TorchServe's raw body, as a V2
``BYTES`` input over HTTP (binary data, as ``tritonclient.http`` sends it) and gRPC (``tritonclient.grpc``), and as
``/predict``'s ``{"b64": ...}`` samples, each given the same top label; a GIF and too many photos refused on each with
the right status while the server goes on answering."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, StartServer, free_port
from tests.e2e.test_torchserve_images import LABELS, MODEL, TIMEOUT, photo, pixels, store

pytestmark = pytest.mark.slow
__all__ = ["store"]  # the fixture, imported for the tests below

PHOTOS = 8
INPUT = "image"  # the image section's input: DIGITS_PHOTO's --image


@pytest.fixture(scope="module")
def server(server_factory: StartServer, store: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    process = server_factory(store, "--grpc", "--grpc-port", str(port))
    return process, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pngs() -> list[bytes]:
    return [photo(row, "PNG") for row in pixels()[:PHOTOS]]


@pytest.fixture
def http_client(server: tuple[ServerProcess, str]) -> Iterator[th.InferenceServerClient]:
    client = th.InferenceServerClient(server[0].url.removeprefix("http://"), network_timeout=120.0)
    yield client
    client.close()


@pytest.fixture
def grpc_client(server: tuple[ServerProcess, str]) -> Iterator[tg.InferenceServerClient]:
    client = tg.InferenceServerClient(server[1])
    yield client
    client.close()


def gif() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (32, 32)).save(buf, format="GIF")
    return buf.getvalue()


def labels_of(logits: np.ndarray) -> list[str]:
    return [LABELS[i] for i in logits.argmax(-1).tolist()]


def via_http(client: th.InferenceServerClient, photos: list[bytes]) -> list[str]:
    entry = th.InferInput(INPUT, [len(photos)], "BYTES")
    entry.set_data_from_numpy(np.array(photos, dtype=np.object_), binary_data=True)
    result = client.infer(MODEL, [entry])
    name = result.get_response()["outputs"][0]["name"]
    return labels_of(result.as_numpy(name))


def via_grpc(client: tg.InferenceServerClient, photos: list[bytes]) -> list[str]:
    entry = tg.InferInput(INPUT, [len(photos), 1], "BYTES")
    entry.set_data_from_numpy(np.array(photos, dtype=np.object_).reshape(-1, 1))
    result = client.infer(MODEL, [entry])
    name = result.get_response().outputs[0].name
    return labels_of(result.as_numpy(name))


def via_predict(url: str, photos: list[bytes]) -> httpx.Response:
    samples = [{"b64": base64.b64encode(p).decode()} for p in photos]
    return httpx.post(f"{url}/predict", json={"model": MODEL, "inputs": samples}, timeout=TIMEOUT)


def test_every_interface_gives_each_photo_the_same_label(
    server: tuple[ServerProcess, str],
    pngs: list[bytes],
    http_client: th.InferenceServerClient,
    grpc_client: tg.InferenceServerClient,
) -> None:
    url = server[0].url
    raw = []
    for data in pngs:
        r = httpx.put(f"{url}/predictions/{MODEL}", content=data, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        raw.append(next(iter(r.json())))
    assert set(raw) <= set(LABELS)
    assert via_http(http_client, pngs) == raw
    assert via_grpc(grpc_client, pngs) == raw
    r = via_predict(url, pngs)
    assert r.status_code == 200, r.text
    assert r.json()["labels"] == raw


def test_a_gif_and_too_many_photos_are_refused_on_each_interface(
    server: tuple[ServerProcess, str],
    pngs: list[bytes],
    http_client: th.InferenceServerClient,
    grpc_client: tg.InferenceServerClient,
) -> None:
    url = server[0].url
    many = [pngs[0]] * 17  # past max_request_images (16)
    with pytest.raises(InferenceServerException, match=r"inputs\[0\]\[1\]: a GIF image") as e:
        via_http(http_client, [pngs[0], gif()])
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match=r"17 images, more than the 16") as e:
        via_http(http_client, many)
    assert e.value.status() == "413"
    with pytest.raises(InferenceServerException, match=r"inputs\[0\]\[0\]: a GIF image") as e:
        via_grpc(grpc_client, [gif()])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match=r"17 images, more than the 16") as e:
        via_grpc(grpc_client, many)
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    r = via_predict(url, [gif()])
    assert r.status_code == 400
    assert "inputs[0].b64: a GIF image" in r.text
    r = via_predict(url, many)
    assert r.status_code == 413
    assert "inputs: 17 images, more than the 16" in r.text
    r = httpx.post(f"{url}/predict", json={"model": MODEL, "inputs": [{"b64": "@@"}]}, timeout=TIMEOUT)
    assert r.status_code == 400
    assert "inputs[0].b64: not base64" in r.text
    # Still serving, on every interface.
    assert len(via_http(http_client, pngs[:2])) == 2
    assert len(via_grpc(grpc_client, pngs[:2])) == 2
    assert via_predict(url, pngs[:2]).status_code == 200
