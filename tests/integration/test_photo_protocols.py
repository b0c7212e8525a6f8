"""A photo model as V2 and TorchServe clients see it: its metadata and configuration list the ``BYTES`` input photos
are sent under, over HTTP and gRPC alike; photos in shared memory are read as a tensor there is, behind the same
token; TorchServe's inference API takes its archives' ``1.0`` for version 1, as its management API does, allows both
its methods, and answers ``/explanations`` in TorchServe's shape."""

from __future__ import annotations

import base64
import gc
import io
import struct
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.model_config_pb2 as mc
from PIL import Image
from tritonclient.grpc import service_pb2

from halfserve.images import ImageError
from halfserve.settings import Settings
from tests.conftest import free_port, save_photo_cnn, save_tiny_mlp, shm_key
from tests.integration.conftest import serving
from tests.integration.test_shm import AUTH, TOKEN, register
from tests.waiting import freed

INFER = "/v2/models/photo/infer"
SERVICE = "/inference.GRPCInferenceService/"


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (16, 16), value).save(buf, format="PNG")
    return buf.getvalue()


async def call(channel: grpc.aio.Channel, method: str, request: Any, answer: Any, **options: Any) -> Any:
    """The gRPC service's ``method`` called with ``request``, its answer read as ``answer``."""
    rpc = channel.unary_unary(
        SERVICE + method, request_serializer=type(request).SerializeToString, response_deserializer=answer.FromString
    )
    return await rpc(request, timeout=20, **options)


async def test_metadata_and_config_list_the_photo_input_over_http_and_grpc(tmp_path: Path) -> None:
    save_photo_cnn(tmp_path)
    port = free_port()
    settings = Settings(store=tmp_path, precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        meta = (await client.get("/v2/models/photo")).json()
        config = (await client.get("/v2/models/photo/config")).json()
        named = service_pb2.ModelMetadataRequest(name="photo")
        grpc_meta = await call(channel, "ModelMetadata", named, service_pb2.ModelMetadataResponse)
        asked = service_pb2.ModelConfigRequest(name="photo")
        grpc_config = (await call(channel, "ModelConfig", asked, service_pb2.ModelConfigResponse)).config
    # The photo input had been missing: a client reading them found only the pixels it feeds.
    assert meta["inputs"] == [
        {"name": "pixels", "datatype": "FP32", "shape": [-1, 1, 8, 8]},
        {"name": "photo", "datatype": "BYTES", "shape": [-1, 1]},
    ]
    # Each optional, as a request gives one or the other: a client filling every input not optional gives neither.
    assert [(i["name"], i["data_type"], i["dims"], i["format"], i.get("optional")) for i in config["input"]] == [
        ("pixels", "TYPE_FP32", [1, 8, 8], "FORMAT_NCHW", True),
        ("photo", "TYPE_STRING", [1], "FORMAT_NONE", True),
    ]
    assert [(i.name, i.datatype, list(i.shape)) for i in grpc_meta.inputs] == [
        (i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]
    ]
    assert [(i.name, mc.DataType.Name(i.data_type), list(i.dims), i.optional) for i in grpc_config.input] == [
        (i["name"], i["data_type"], i["dims"], i["optional"]) for i in config["input"]
    ]


def elements(photos: list[bytes]) -> bytes:
    """Photos as ``BYTES`` binary data: each one's 4-byte little-endian length, then the photo."""
    return b"".join(struct.pack("<I", len(p)) + p for p in photos)


def in_memory(region: str, size: int) -> dict[str, Any]:
    params = {"shared_memory_region": region, "shared_memory_byte_size": size}
    return {"inputs": [{"name": "photo", "datatype": "BYTES", "shape": [2], "parameters": params}]}


def grpc_in_memory(size: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="photo")
    photo = request.inputs.add(name="photo", datatype="BYTES", shape=[2])
    photo.parameters["shared_memory_region"].string_param = "r"
    photo.parameters["shared_memory_byte_size"].int64_param = size
    return request


async def test_photos_in_shared_memory_are_read_as_a_tensor_is_behind_the_same_token(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    save_photo_cnn(tmp_path)
    photos = [png(0), png(200)]
    data = elements(photos)
    segment.buf[: len(data)] = data
    as_json = [
        {"name": "photo", "datatype": "BYTES", "shape": [2], "data": [base64.b64encode(p).decode() for p in photos]}
    ]
    port = free_port()
    settings = Settings(
        store=tmp_path, precision="fp32", admin_token=TOKEN, grpc=True, grpc_port=port, host="127.0.0.1"
    )
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        anonymous = await client.post(INFER, json=in_memory("r", len(data)))
        await register(client, "r", {"key": shm_key(segment), "byte_size": 4096})
        unknown = await client.post(INFER, json=in_memory("nope", len(data)), headers=AUTH)
        cut = await client.post(INFER, json=in_memory("r", len(data) - 1), headers=AUTH)
        read = await client.post(INFER, json=in_memory("r", len(data)), headers=AUTH)
        want = await client.post(INFER, json={"inputs": as_json})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(channel, "ModelInfer", grpc_in_memory(len(data)), service_pb2.ModelInferResponse)
        token = (("authorization", AUTH["Authorization"]),)
        answer = await call(
            channel, "ModelInfer", grpc_in_memory(len(data)), service_pb2.ModelInferResponse, metadata=token
        )
    # A tensor input's refusal, which these inputs had not given: they read "expected 2 base64 strings" instead.
    assert anonymous.status_code == 401, anonymous.text
    assert "shared_memory_region: using a shared memory region needs the admin token" in anonymous.json()["error"]
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert unknown.status_code == 400
    assert "inputs[0].parameters.shared_memory_region: no shared memory region 'nope'" in unknown.json()["error"]
    assert cut.status_code == 400
    assert cut.json()["error"].startswith("inputs[0].parameters.shared_memory_byte_size: BYTES element 1 of shape [2]")
    assert read.status_code == 200, read.text
    assert want.status_code == 200, want.text
    assert read.json()["outputs"] == want.json()["outputs"]
    logits = np.frombuffer(answer.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(logits, np.asarray(want.json()["outputs"][0]["data"], np.float32))


async def test_torchserve_s_inference_api_takes_its_version_spelling_methods_and_paths(tmp_path: Path) -> None:
    save_photo_cnn(tmp_path)
    port = free_port()
    settings = Settings(store=tmp_path, precision="fp32", torchserve_management_port=port)
    versions = ["1", "1.0", "01", "1.1", "2.0"]
    async with serving(settings) as client, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as management:
        plain = await client.put("/predictions/photo", content=png(100))
        answered = {v: await client.put(f"/predictions/photo/{v}", content=png(100)) for v in versions}
        described = {v: (await management.get(f"/models/photo/{v}")).status_code for v in versions}
        get = await client.get("/predictions/photo/1")
        nowhere = await client.post("/predictions/photo/1/more", content=png(100))
        bare = [await client.post("/predictions", content=png(100)), await client.get("/explanations")]
        explained = [await client.post(p, content=png(100)) for p in ("/explanations/photo", "/explanations/photo/1")]
        explained_get = await client.get("/explanations/photo")
        still = await client.post("/predictions/photo", content=png(100))
    assert plain.status_code == 200, plain.text
    for v, r in answered.items():
        # 1.0 had been a 404 here while the management API took it.
        assert r.status_code == described[v] == (200 if v in ("1", "1.0") else 404), (v, r.text)
        if r.status_code == 200:
            assert r.json() == plain.json()
        else:
            assert r.json()["type"] == "ModelNotFoundException"
    assert get.status_code == 405
    # Had been this server's {"error": "Method Not Allowed"}: TorchServe's clients read the type.
    assert get.json() == {
        "code": 405,
        "type": "MethodNotAllowedException",
        "message": "Requested method is not allowed, please refer to API document.",
        "error": "Requested method is not allowed, please refer to API document.",
    }
    # POST alone had been named, then "PUT, POST" or "POST, PUT" from one start to the next (a set's order).
    assert get.headers["allow"] == "POST, PUT"
    # docs/torchserve.md: /explanations takes the methods of /predictions, so a GET is refused as one there is.
    assert (explained_get.status_code, explained_get.json()) == (405, get.json())
    assert explained_get.headers["allow"] == "POST, PUT"
    for r in [*explained, nowhere, *bare]:  # had been this server's {"error": "Not Found"}
        assert r.status_code == 404
        body = r.json()
        assert (body["code"], body["type"]) == (404, "ResourceNotFoundException")
        assert body["message"].startswith("Requested resource is not found, please refer to API document.")
        assert body["error"] == body["message"]
    assert still.status_code == 200


async def test_a_photo_given_with_the_pixels_it_feeds_is_refused_in_the_same_words_in_either_order(
    tmp_path: Path,
) -> None:
    """Which came first had chosen the message: pixels then the photo read "give 'photo' or 'pixels', not both", the
    photo then the pixels "input 'pixels' is given twice". Two photo inputs are the one given twice."""
    save_photo_cnn(tmp_path)
    photo = {"name": "photo", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(png(100)).decode()]}
    pixels = {"name": "pixels", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.0] * 64}
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        orders = [await client.post(INFER, json={"inputs": given}) for given in ([pixels, photo], [photo, pixels])]
        twice = await client.post(INFER, json={"inputs": [photo, photo]})
        alone = await client.post(INFER, json={"inputs": [photo]})
    assert [r.status_code for r in orders] == [400, 400]
    assert [r.json()["error"] for r in orders] == ["inputs[1].name: give 'photo' or 'pixels', not both"] * 2
    assert twice.status_code == 400
    assert twice.json()["error"] == "inputs[1].name: input 'photo' is given twice"
    assert alone.status_code == 200, alone.text  # the check is on the pairing, not on the photo


async def test_torchserve_s_inference_api_answers_an_unloaded_model_s_state_before_judging_the_body(
    tmp_path: Path,
) -> None:
    save_photo_cnn(tmp_path)
    save_tiny_mlp(tmp_path)  # takes no images: had answered "model 'tiny' takes no images" once unloaded too
    async with serving(Settings(store=tmp_path, precision="fp32", admin_token=TOKEN)) as client:
        for name in ("photo", "tiny"):
            assert (await client.post(f"/v2/repository/models/{name}/unload", headers=AUTH)).status_code == 200
        answers = {
            (name, len(body)): await client.post(f"/predictions/{name}", content=body)
            for name in ("photo", "tiny")
            for body in (png(0), b"")
        }
    for (name, _), r in answers.items():  # whatever the body, as a photo model's well-formed request is answered
        assert r.status_code == 503, r.text
        assert r.json()["error"] == f"model {name!r} is unloaded"


JUNK_BYTES = 1017
"""The size of the refused photo below, which names its errors apart from any other test's."""


def live_image_errors() -> int:
    """Image errors still reachable or waiting in a cycle: the collector is off, so only reference counts free."""
    return sum(isinstance(o, ImageError) and f"({JUNK_BYTES} bytes)" in str(o) for o in gc.get_objects())


async def test_a_refused_photo_is_freed_with_its_answer_on_every_route(tmp_path: Path) -> None:
    """A refused photo's error held, through its tracebacks, the frames it passed and so the photo's bytes, in a
    cycle with the future that failed with it: only a collection of the collector's older generations freed them, and
    a server refusing 16 photos of 160 KB a request grew by their size each time (2.6 GB after 36 requests of 46 MB).
    The collector is off here, so what a collection would free shows as still alive."""
    save_photo_cnn(tmp_path)
    junk = base64.b64encode(b"\x89PNG not one" + bytes(JUNK_BYTES - 12)).decode()
    port = free_port()
    settings = Settings(store=tmp_path, precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        sends = {
            "/predict": lambda: client.post("/predict", json={"inputs": [{"b64": junk}] * 4}),
            "v1": lambda: client.post("/v1/models/photo:predict", json={"instances": [{"b64": junk}] * 4}),
            "v1 envelope": lambda: client.post("/v1/models/photo:predict", json={"instances": [{"data": junk}] * 4}),
            "/predictions": lambda: client.post("/predictions/photo", content=base64.b64decode(junk)),
        }
        gc.collect()
        gc.disable()
        try:
            for route, send in sends.items():
                for _ in range(3):
                    r = await send()
                    assert r.status_code == 400, (route, r.text)
                await freed(live_image_errors, f"{route}: the refused photos' errors freed")
            request = service_pb2.ModelInferRequest(model_name="photo")
            photo = request.inputs.add(name="photo", datatype="BYTES", shape=[1])
            photo.contents.bytes_contents.append(base64.b64decode(junk))
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(channel, "ModelInfer", request, service_pb2.ModelInferResponse)
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            await freed(live_image_errors, "gRPC: the refused photos' errors freed")
        finally:
            gc.enable()


async def test_kserve_v1_and_predict_answer_an_unloaded_model_s_state_before_decoding_its_photos(
    tmp_path: Path,
) -> None:
    """Photos that do not decode, sent to unloaded models through KServe V1 (TorchServe's envelope, or ``b64``
    instances) and ``/predict``: 503 'unloaded', as ``/predictions`` answers, not the photo's 400."""
    save_photo_cnn(tmp_path)
    save_tiny_mlp(tmp_path)  # takes no images: had answered "takes no images" once unloaded too
    junk = base64.b64encode(b"not a photo").decode()
    async with serving(Settings(store=tmp_path, precision="fp32", admin_token=TOKEN)) as client:
        for name in ("photo", "tiny"):
            assert (await client.post(f"/v2/repository/models/{name}/unload", headers=AUTH)).status_code == 200
        answers = {
            (name, how): await client.post(path, json=body)
            for name in ("photo", "tiny")
            for how, path, body in [
                ("envelope", f"/v1/models/{name}:predict", {"instances": [{"data": junk}]}),
                ("bad base64", f"/v1/models/{name}:predict", {"instances": [{"data": "!!"}]}),
                ("b64", f"/v1/models/{name}:predict", {"instances": [{"b64": junk}]}),
                ("predict", "/predict", {"model": name, "inputs": [{"b64": junk}]}),
            ]
        }
    for (name, _), r in answers.items():
        assert (r.status_code, r.json()) == (503, {"error": f"model {name!r} is unloaded"}), r.text
