"""Outputs of one value per row (shape ``[]``: a regression's ``[B]``, a class index), as one output and beside
others: served as Triton serves a model output of ``[B]`` (``dims: [1]`` with ``reshape: {shape: []}``), V2
responses and metadata of ``[B, 1]`` over HTTP and gRPC alike, and a number per row on ``/predict``, KServe V1 and
TorchServe's ``/predictions``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import numpy as np
import orjson
import torch
import tritonclient.grpc.model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from halfserve import models, store
from halfserve.imageinput import ColorMode, ImageInput
from halfserve.manifest import DataType, Manifest, TensorSpec
from halfserve.settings import Settings
from tests.conftest import free_port
from tests.integration.conftest import serving
from tests.integration.test_photo_protocols import call, png

X = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)


@models.register("test_regression_heads")
class RegressionHeads(torch.nn.Module):
    """``value`` alone (``heads=False``), or class scores with their class index and the value beside them."""

    def __init__(self, heads: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.scores = torch.nn.Linear(4, 3)
        self.value = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        value = self.value(x).squeeze(-1)
        if not self.heads:
            return value
        scores = self.scores(x)
        return {"scores": scores, "cls": scores.argmax(-1), "value": value}


@models.register("test_photo_brightness")
class PhotoBrightness(torch.nn.Module):
    """A photo's mean pixel, one value per photo."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((1, 2, 3))


VALUE = TensorSpec(name="value", shape=[])
HEADS = [TensorSpec(name="scores", shape=[3]), TensorSpec(name="cls", datatype=DataType.INT64, shape=[]), VALUE]


def save(root: Path) -> RegressionHeads:
    """``reg`` (the value alone) and ``heads`` (scores, class and value) with the same weights, saved through the real
    store code, in fp32 so their answers are the module's; the module, to compare them with."""
    torch.manual_seed(0)
    module = RegressionHeads(heads=True).eval()
    for name, outputs in (("reg", [VALUE]), ("heads", HEADS)):
        fields = {"name": name, "architecture": "test_regression_heads", "precision": "fp32"}
        manifest = Manifest.model_validate(
            {**fields, "arch_kwargs": {"heads": name == "heads"}, "inputs": [TensorSpec(name="x", shape=[4])]}
            | {"outputs": outputs}
        )
        store.save(root, manifest, module)
    return module


def v2_body(outputs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": X.ravel().tolist()}]}
    return body | ({"outputs": outputs} if outputs is not None else {})


def grpc_infer(model: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    request.raw_input_contents.append(X.tobytes())
    return request


async def test_a_value_per_row_is_a_column_over_v2_and_a_number_per_row_elsewhere(tmp_path: Path) -> None:
    module = save(tmp_path)
    with torch.inference_mode():
        want = {k: v.numpy() for k, v in module(torch.from_numpy(X)).items()}
    port = free_port()
    settings = Settings(store=tmp_path, grpc=True, grpc_port=port, host="127.0.0.1")
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        alone = await client.post("/v2/models/reg/infer", json=v2_body())
        binary = await client.post(
            "/v2/models/reg/infer", json=v2_body([{"name": "value", "parameters": {"binary_data": True}}])
        )
        heads = await client.post("/v2/models/heads/infer", json=v2_body([{"name": "cls"}, {"name": "value"}]))
        meta = (await client.get("/v2/models/heads")).json()
        config = (await client.get("/v2/models/heads/config")).json()
        predict = await client.post("/predict", json={"model": "reg", "inputs": X.tolist()})
        predict_heads = await client.post("/predict", json={"model": "heads", "inputs": X.tolist()})
        v1 = await client.post("/v1/models/heads:predict", json={"instances": X.tolist()})
        grpc_alone = await call(channel, "ModelInfer", grpc_infer("reg"), service_pb2.ModelInferResponse)
        grpc_heads = await call(channel, "ModelInfer", grpc_infer("heads"), service_pb2.ModelInferResponse)
        named = service_pb2.ModelMetadataRequest(name="heads")
        grpc_meta = await call(channel, "ModelMetadata", named, service_pb2.ModelMetadataResponse)
        asked = service_pb2.ModelConfigRequest(name="heads")
        grpc_config = (await call(channel, "ModelConfig", asked, service_pb2.ModelConfigResponse)).config
    # The import had refused such a model; declared by hand, each answer is a column of B rows, as Triton's.
    for r in (alone, binary, heads, predict, predict_heads, v1):
        assert r.status_code == 200, r.text
    (out,) = alone.json()["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("value", "FP32", [3, 1])
    np.testing.assert_allclose(out["data"], want["value"], rtol=1e-6)
    length = int(binary.headers["inference-header-content-length"])
    (out,) = orjson.loads(binary.content[:length])["outputs"]
    assert (out["shape"], out["parameters"]["binary_data_size"]) == ([3, 1], 12)
    np.testing.assert_allclose(np.frombuffer(binary.content[length:], np.float32), want["value"], rtol=1e-6)
    cls, value = heads.json()["outputs"]
    assert (cls["name"], cls["datatype"], cls["shape"], cls["data"]) == ("cls", "INT64", [3, 1], want["cls"].tolist())
    assert value["shape"] == [3, 1]
    # Metadata and model configuration say so: [-1, 1], and Triton's dims [1] with an empty reshape.
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [
        ("scores", "FP32", [-1, 3]),
        ("cls", "INT64", [-1, 1]),
        ("value", "FP32", [-1, 1]),
    ]
    assert config["output"][1:] == [
        {"name": "cls", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},
        {"name": "value", "data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}},
    ]
    assert "reshape" not in config["output"][0]
    # gRPC answers as V2 over HTTP does.
    (out,) = grpc_alone.outputs
    assert (out.name, list(out.shape)) == ("value", [3, 1])
    np.testing.assert_allclose(np.frombuffer(grpc_alone.raw_output_contents[0], np.float32), want["value"], rtol=1e-6)
    assert [(o.name, list(o.shape)) for o in grpc_heads.outputs] == [
        ("scores", [3, 3]),
        ("cls", [3, 1]),
        ("value", [3, 1]),
    ]
    np.testing.assert_array_equal(np.frombuffer(grpc_heads.raw_output_contents[1], np.int64), want["cls"])
    assert [(t.name, list(t.shape)) for t in grpc_meta.outputs] == [(t["name"], t["shape"]) for t in meta["outputs"]]
    assert [(t.name, list(t.dims), t.HasField("reshape"), list(t.reshape.shape)) for t in grpc_config.output] == [
        ("scores", [3], False, []),
        ("cls", [1], True, []),
        ("value", [1], True, []),
    ]
    assert mc.DataType.Name(grpc_config.output[1].data_type) == "TYPE_INT64"
    # /predict and V1: a number per row (per prediction), not a list of one.
    np.testing.assert_allclose(predict.json()["outputs"], want["value"], rtol=1e-6)
    outputs = predict_heads.json()["outputs"]
    assert outputs["cls"] == want["cls"].tolist()
    np.testing.assert_allclose(outputs["value"], want["value"], rtol=1e-6)
    predictions = v1.json()["predictions"]
    assert [p["cls"] for p in predictions] == want["cls"].tolist()
    assert all(isinstance(p["value"], float) for p in predictions)


async def test_a_photo_model_s_value_per_row_is_a_number_per_photo_on_predictions(tmp_path: Path) -> None:
    manifest = Manifest(
        name="bright",
        architecture="test_photo_brightness",
        inputs=[TensorSpec(name="pixels", shape=[1, 8, 8])],
        outputs=[TensorSpec(name="brightness", shape=[])],
        image=ImageInput(input="photo", feeds="pixels", mode=ColorMode.L, resize=[8, 8], scale=1.0),
        precision="fp32",
    )
    store.save(tmp_path, manifest, PhotoBrightness())
    async with serving(Settings(store=tmp_path)) as client:
        one = await client.post("/predictions/bright", content=png(100))
        two = await client.post("/predictions/bright", files=[("data", png(100)), ("data", png(200))])
    assert one.status_code == 200, one.text
    assert one.json() == 100.0, "a number, not a list of one"
    assert two.status_code == 200, two.text
    assert two.json() == [100.0, 200.0]
