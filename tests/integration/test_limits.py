"""Input limits in-process: body size, rows and values per request, NaN and infinite inputs; each a 4xx naming the
field and the setting."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from halfserve import models, store
from halfserve.manifest import DataType, Manifest, TensorSpec
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving

HEADER = "Inference-Header-Content-Length"
INFER = "/v2/models/tiny/infer"
ROW = [0.25] * 16


def binary_body(x: np.ndarray, datatype: str = "FP32") -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    params = {"binary_data_size": len(raw)}
    tensor = {"name": "features", "shape": list(x.shape), "datatype": datatype, "parameters": params}
    header = orjson.dumps({"inputs": [tensor]})
    return header + raw, {HEADER: str(len(header))}


async def test_a_body_over_max_body_bytes_is_a_413_naming_the_setting(tiny_store: Path) -> None:
    big = orjson.dumps({"inputs": [ROW] * 200})
    assert len(big) > 4096

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async with serving(Settings(store=tiny_store, max_body_bytes=4096)) as client:
        declared = await client.post("/predict", content=big, headers={"content-type": "application/json"})
        streamed = await client.post("/predict", content=chunked(), headers={"content-type": "application/json"})
        v2 = await client.post(INFER, content=big)
        ok = await client.post("/predict", json={"inputs": [ROW]})
    assert declared.status_code == streamed.status_code == v2.status_code == 413
    assert declared.json()["error"] == f"body: {len(big)} bytes exceed the limit of 4096 bytes (max_body_bytes)"
    assert streamed.json()["error"] == "body: more than 4096 bytes (max_body_bytes)"
    assert "max_body_bytes" in v2.json()["error"]
    assert ok.status_code == 200


async def test_a_body_in_several_parts_is_read_whole(tiny_store: Path) -> None:
    """A chunked body (no Content-Length) arrives as several messages; JSON and V2 binary are joined before parsing."""
    x = np.linspace(-1, 1, 3 * 16, dtype=np.float32).reshape(3, 16)
    body = orjson.dumps({"inputs": x.tolist()})
    raw, headers = binary_body(x)

    def parts(data: bytes) -> AsyncIterator[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 7):
                yield data[i : i + 7]

        return gen()

    async with serving(Settings(store=tiny_store)) as client:
        whole = await client.post("/predict", content=body, headers={"content-type": "application/json"})
        split = await client.post("/predict", content=parts(body), headers={"content-type": "application/json"})
        v2 = await client.post(INFER, content=parts(raw), headers=headers)
    assert whole.status_code == split.status_code == v2.status_code == 200
    assert split.json()["outputs"] == whole.json()["outputs"]
    assert len(v2.json()["outputs"][0]["data"]) == len(whole.json()["outputs"]) * len(whole.json()["outputs"][0])


async def test_a_compressed_body_is_held_to_max_body_bytes_as_it_inflates(tiny_store: Path) -> None:
    """A 65 KB gzip body that would inflate to 64 MB is refused after the first 100 KB + 1 of output, not inflated."""
    bomb = gzip.compress(b"[" + b" " * (64 << 20) + b"]", compresslevel=9)
    small = gzip.compress(orjson.dumps({"inputs": [ROW]}))
    assert len(bomb) < 100_000
    gz = {"content-type": "application/json", "content-encoding": "gzip"}
    async with serving(Settings(store=tiny_store, max_body_bytes=100_000)) as client:
        predict = await client.post("/predict", content=bomb, headers=gz)
        v2 = await client.post(INFER, content=bomb, headers=gz)
        ok = await client.post("/predict", content=small, headers=gz)
    assert predict.status_code == v2.status_code == 413
    assert (
        predict.json()["error"] == v2.json()["error"] == "body: decompresses to more than 100000 bytes (max_body_bytes)"
    )
    assert ok.status_code == 200, ok.text


async def test_gzip_members_are_held_to_max_body_bytes_together(tiny_store: Path) -> None:
    """Many gzip members, each far under the limit, inflate past it together: refused as one member would be, and
    after the first 100 KB + 1 of output."""
    member = gzip.compress(b" " * 30_000, compresslevel=9)
    body = gzip.compress(b"[") + member * 500 + gzip.compress(b"]")
    assert len(body) < 100_000
    gz = {"content-type": "application/json", "content-encoding": "gzip"}
    async with serving(Settings(store=tiny_store, max_body_bytes=100_000, max_compression_ratio=1_000)) as client:
        predict = await client.post("/predict", content=body, headers=gz)
        v2 = await client.post(INFER, content=body, headers=gz)
    assert predict.status_code == v2.status_code == 413
    assert (
        predict.json()["error"] == v2.json()["error"] == "body: decompresses to more than 100000 bytes (max_body_bytes)"
    )


async def test_rows_and_values_over_their_limits_are_413s_naming_field_and_setting(tiny_store: Path) -> None:
    x = np.zeros((5, 16), np.float32)
    content, headers = binary_body(x)
    async with serving(Settings(store=tiny_store, max_request_rows=4)) as client:
        predict = await client.post("/predict", json={"inputs": x.tolist()})
        v2 = await client.post(INFER, content=content, headers=headers)
        raw = await client.post(INFER, content=x.tobytes(), headers={HEADER: "0"})
        four = await client.post("/predict", json={"inputs": x[:4].tolist()})
    assert predict.status_code == v2.status_code == raw.status_code == 413
    assert predict.json()["error"] == "inputs: 5 rows exceed the limit of 4 per request (max_request_rows)"
    assert v2.json()["error"] == "inputs[0].shape: 5 rows exceed the limit of 4 per request (max_request_rows)"
    assert raw.json()["error"].startswith("body: 5 rows exceed")
    assert four.status_code == 200
    async with serving(Settings(store=tiny_store, max_request_elements=40)) as client:
        too_many = await client.post("/predict", json={"inputs": x[:3].tolist()})
        fine = await client.post("/predict", json={"inputs": x[:2].tolist()})
    assert too_many.status_code == 413
    assert too_many.json()["error"] == (
        "inputs: 48 input values exceed the limit of 40 per request (max_request_elements)"
    )
    assert fine.status_code == 200


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
async def test_non_finite_binary_inputs_are_refused_by_default(tiny_store: Path, bad: float) -> None:
    x = np.zeros((3, 16), np.float32)
    x[2, 5] = bad
    content, headers = binary_body(x)
    async with serving(Settings(store=tiny_store)) as client:
        v2 = await client.post(INFER, content=content, headers=headers)
        raw = await client.post(INFER, content=x.tobytes(), headers={HEADER: "0"})
        half_content, half_headers = binary_body(x.astype(np.float16), "FP16")
        half = await client.post(INFER, content=half_content, headers=half_headers)
    assert v2.status_code == raw.status_code == 400
    assert v2.json()["error"].startswith("inputs[0] (binary data): row 2 holds a NaN or infinite value")
    assert "allow_nonfinite_inputs" in v2.json()["error"]
    assert raw.json()["error"].startswith("body: row 2 holds a NaN")
    assert half.status_code == 400
    assert half.json()["error"].startswith("inputs[0] (binary data): row 2 holds a NaN or infinite value")


async def test_json_numbers_beyond_the_inputs_range_are_refused(tiny_store: Path) -> None:
    row = [0.0] * 15 + [1e39]
    async with serving(Settings(store=tiny_store)) as client:
        predict = await client.post("/predict", json={"inputs": [row]})
        fp32 = await client.post(
            INFER, json={"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", "data": row}]}
        )
        fp64 = await client.post(
            INFER, json={"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP64", "data": row}]}
        )
    assert predict.status_code == fp32.status_code == fp64.status_code == 400
    assert predict.json()["error"] == "inputs: values beyond the range of float32"
    assert fp32.json()["error"] == "inputs[0].data: values beyond the range of FP32"
    # FP64 holds it; the conversion to the model's float32 makes it infinite, which the model does not accept.
    assert fp64.json()["error"].startswith("inputs[0].data: row 0 holds a NaN or infinite value (or one beyond")


@models.register("test_mlp_of_integers")
class MlpOfIntegers(nn.Module):
    """A linear model of 16 integer features, cast to floats first (a model that takes counts or codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float())


def save_integer_mlp(root: Path, datatype: DataType) -> Path:
    torch.manual_seed(0)
    manifest = Manifest(
        name="tiny",
        architecture="test_mlp_of_integers",
        inputs=[TensorSpec(name="features", datatype=datatype, shape=[16])],
        outputs=[TensorSpec(name="logits", shape=[4])],
    )
    return store.save(root, manifest, models.build("test_mlp_of_integers"))


async def test_json_numbers_beyond_an_integer_inputs_range_are_refused(tmp_path: Path) -> None:
    save_integer_mlp(tmp_path, DataType.INT32)
    async with serving(Settings(store=tmp_path)) as client:
        r = await client.post("/predict", json={"inputs": [[0] * 15 + [1e20]]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "inputs: values beyond the range of int32"  # not wrapped around


# Past int64, the JSON parser hands numpy a float: 2^63 was cast, wrapped, and reported as -9223372036854775808;
# V2 called all three "data must be integers". Integers that uint64 holds, mixed with small ones, are read exactly
# (numpy made them floats, rounding 2^63 + 1 to 2^63), and named as integers.
@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (2**63, "values in [0, 9223372036854775808] do not fit int64"),
        (2**63 + 1, "values in [0, 9223372036854775809] do not fit int64"),
        (-(2**63) - 1, "values beyond the range of {}"),
        (2**64 + 1, "values beyond the range of {}"),
    ],
)
async def test_json_integers_past_int64_are_refused_as_out_of_range_alike(
    tmp_path: Path, value: int, refusal: str
) -> None:
    save_integer_mlp(tmp_path, DataType.INT64)
    row = b"[" + b"0, " * 15 + str(value).encode() + b"]"
    v2 = b'{"inputs": [{"name": "features", "shape": [1, 16], "datatype": "INT64", "data": %s}]}' % row
    async with serving(Settings(store=tmp_path)) as client:
        predict = await client.post("/predict", content=b'{"inputs": [%s]}' % row)
        infer = await client.post(INFER, content=v2)
    assert predict.status_code == infer.status_code == 400
    assert predict.json()["error"] == "inputs: " + refusal.format("int64")
    assert infer.json()["error"] == "inputs[0].data: " + refusal.format("INT64")


async def test_a_model_may_accept_non_finite_inputs(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, allow_nonfinite_inputs=True)
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = np.nan
    content, headers = binary_body(x)
    async with serving(Settings(store=tmp_path)) as client:
        r = await client.post(INFER, content=content, headers=headers)
        listing = (await client.get("/models")).json()["models"][0]
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [None] * 4  # NaN out, written as null
    assert listing["allow_nonfinite_inputs"] is True
