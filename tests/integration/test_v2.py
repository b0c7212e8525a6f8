"""The KServe V2 endpoints in-process: metadata, JSON and binary inference, Triton's extensions, management."""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from halfserve import __version__
from halfserve.api.dataplane import plan
from halfserve.api.dataplane.decode import to_input_dtype
from halfserve.errors import InvalidInputError
from halfserve.manifest import DataType, TensorSpec
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.conftest import serving

HEADER = "Inference-Header-Content-Length"
INFER = "/v2/models/tiny/infer"
TOKEN = "s3cret-token-for-v2-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NUMPY = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def samples(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values that bf16 holds exactly (the test picks them so) as their bf16 bit patterns."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def json_request(x: np.ndarray, datatype: str = "FP32", **fields: Any) -> dict[str, Any]:
    tensor = {"name": "features", "shape": list(x.shape), "datatype": datatype, "data": x.ravel().tolist()}
    return {"inputs": [tensor], **fields}


def binary_request(raw: bytes, shape: list[int], datatype: str = "FP32", **fields: Any) -> tuple[bytes, dict[str, str]]:
    """A body in the binary tensor extension: JSON header, then ``raw``."""
    tensor = {"name": "features", "shape": shape, "datatype": datatype, "parameters": {"binary_data_size": len(raw)}}
    header = orjson.dumps({"inputs": [tensor], **fields})
    return header + raw, {HEADER: str(len(header)), "Content-Type": "application/octet-stream"}


def read_response(r: httpx.Response) -> tuple[dict[str, Any], np.ndarray]:
    """The response's JSON and its one output as an array, whether the output came as JSON or binary."""
    assert r.status_code == 200, r.text
    if HEADER not in r.headers:
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        out = body["outputs"][0]
        return body, np.asarray(out["data"], dtype=NUMPY[out["datatype"]]).reshape(out["shape"])
    assert r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers[HEADER])
    body = orjson.loads(r.content[:n])
    out = body["outputs"][0]
    size = out["parameters"]["binary_data_size"]
    assert len(r.content) == n + size
    return body, np.frombuffer(r.content[n:], dtype=NUMPY[out["datatype"]]).reshape(out["shape"])


async def predict(client: httpx.AsyncClient, x: np.ndarray) -> np.ndarray:
    return await predict_model(client, None, x)


async def predict_model(client: httpx.AsyncClient, model: str | None, x: np.ndarray) -> np.ndarray:
    r = await client.post("/predict", json={"model": model, "inputs": x.tolist()})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["outputs"], dtype=np.float32)


async def test_server_metadata_and_health(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        meta = (await client.get("/v2")).json()
        live = await client.get("/v2/health/live")
        ready = await client.get("/v2/health/ready")
    assert meta["name"] == "halfserve"
    assert meta["version"] == __version__
    assert set(meta["extensions"]) >= {"binary_tensor_data", "model_configuration", "statistics", "model_repository"}
    assert live.status_code == 200
    assert ready.status_code == 200


async def test_model_metadata_config_and_readiness(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=3)) as client:
        meta = (await client.get("/v2/models/tiny")).json()
        versioned = (await client.get("/v2/models/tiny/versions/1")).json()
        config = (await client.get("/v2/models/tiny/config")).json()
        ready = await client.get("/v2/models/tiny/ready")
        ready_v1 = await client.get("/v2/models/tiny/versions/1/ready")
        missing = {
            url: await client.get(url)
            for url in [
                "/v2/models/nope",
                "/v2/models/nope/ready",
                "/v2/models/nope/config",
                "/v2/models/nope/stats",
                "/v2/models/tiny/versions/2",
                "/v2/models/tiny/versions/2/ready",
                "/v2/models/tiny/versions/2/config",
                "/v2/models/tiny/versions/2/stats",
            ]
        }
        missing["infer nope"] = await client.post("/v2/models/nope/infer", json=json_request(samples(1)))
        missing["infer v2"] = await client.post("/v2/models/tiny/versions/2/infer", json=json_request(samples(1)))
    assert (
        meta
        == versioned
        == {
            "name": "tiny",
            "versions": ["1"],
            "platform": "pytorch_libtorch",
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 16]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 4]}],
            "parameters": {"precision": "fp32", "precision_record": ""},  # fp32 is not measured: no record
        }
    )
    assert config["name"] == "tiny"
    assert (config["platform"], config["backend"]) == ("pytorch_libtorch", "pytorch")
    assert config["max_batch_size"] == 8
    # As Triton's JSON config: every input's format, FORMAT_NONE for one that is not an image.
    assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [16], "format": "FORMAT_NONE"}]
    assert config["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [4]}]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 3000}
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["parameters"]["precision"] == {"string_value": "fp32"}
    assert ready.status_code == ready_v1.status_code == 200
    for what, r in missing.items():
        assert r.status_code == 404, (what, r.text)
        assert "error" in r.json()
    # Triton's words, which its clients test for (an unknown model's error starts with them), then what is served.
    assert missing["/v2/models/nope"].json()["error"] == "Request for unknown model: 'nope' is not found (served: tiny)"
    assert missing["infer nope"].json()["error"].startswith("Request for unknown model: 'nope' is not found")
    for what in ("/v2/models/tiny/versions/2", "/v2/models/tiny/versions/2/config", "infer v2"):
        error = missing[what].json()["error"]
        assert error == "Request for unknown model: 'tiny' version 2 is not found (it serves version 1)", what


async def test_json_and_binary_inference_equal_predict(tiny_store: Path) -> None:
    x = samples(3, seed=1)
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        want = await predict(client, x)
        flat = await client.post(INFER, json=json_request(x, id="req-1"))
        nested_body = json_request(x)
        nested_body["inputs"][0]["data"] = x.tolist()
        nested = await client.post("/v2/models/tiny/versions/1/infer", json=nested_body)
        content, headers = binary_request(x.tobytes(), [3, 16])
        binary_in = await client.post(INFER, content=content, headers=headers)
        content, headers = binary_request(x.tobytes(), [3, 16], parameters={"binary_data_output": True})
        binary_both = await client.post(INFER, content=content, headers=headers)
        per_output = await client.post(
            INFER, json=json_request(x, outputs=[{"name": "logits", "parameters": {"binary_data": True}}])
        )
        override = await client.post(
            INFER,
            json=json_request(
                x,
                parameters={"binary_data_output": True},
                outputs=[{"name": "logits", "parameters": {"binary_data": False}}],
            ),
        )
        fp64 = await client.post(INFER, json=json_request(x.astype(np.float64), "FP64"))
    body, got = read_response(flat)
    assert body["model_name"] == "tiny"
    assert body["model_version"] == "1"
    assert body["id"] == "req-1"
    assert body["parameters"] == {"precision": "fp32"}
    assert body["outputs"][0]["name"] == "logits"
    assert body["outputs"][0]["datatype"] == "FP32"
    assert body["outputs"][0]["shape"] == [3, 4]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for r, binary_out in [
        (nested, False),
        (binary_in, False),
        (binary_both, True),
        (per_output, True),
        (override, False),
        (fp64, False),
    ]:
        assert (HEADER in r.headers) is binary_out, r.headers
        _, got = read_response(r)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert "id" not in read_response(nested)[0]


async def test_gzip_and_deflate_bodies_are_decompressed(tiny_store: Path) -> None:
    """Triton's request compression (tritonclient's ``request_compression_algorithm``): the whole body, JSON header
    and binary data alike, compressed; ``Inference-Header-Content-Length`` counts the uncompressed header."""
    x = samples(3, seed=11)

    def raw_deflate(b: bytes) -> bytes:  # without zlib's header
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return c.compress(b) + c.flush()

    codecs = {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "DEFLATE": raw_deflate,
    }
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        want = await predict(client, x)
        for encoding, compress in codecs.items():
            as_json = orjson.dumps(json_request(x))
            r = await client.post(INFER, content=compress(as_json), headers={"Content-Encoding": encoding})
            np.testing.assert_allclose(read_response(r)[1], want, rtol=1e-6, err_msg=encoding)
            content, headers = binary_request(x.tobytes(), [3, 16])
            r = await client.post(INFER, content=compress(content), headers={**headers, "Content-Encoding": encoding})
            np.testing.assert_allclose(read_response(r)[1], want, rtol=1e-6, err_msg=encoding)
        body = gzip.compress(orjson.dumps({"inputs": x.tolist()}))
        r = await client.post("/predict", content=body, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"], want, rtol=1e-6)
        # Several gzip members one after another are one body (RFC 1952 section 2.2; `cat a.gz b.gz`): each request
        # below was a 400 "has bytes after its compressed stream".
        content, headers = binary_request(x.tobytes(), [3, 16])
        members = b"".join(gzip.compress(content[i : i + 50]) for i in range(0, len(content), 50))
        r = await client.post(INFER, content=members, headers={**headers, "Content-Encoding": "gzip"})
        np.testing.assert_allclose(read_response(r)[1], want, rtol=1e-6)
        as_json = orjson.dumps({"inputs": x.tolist()})
        members = gzip.compress(as_json[:10]) + gzip.compress(b"") + gzip.compress(as_json[10:])
        r = await client.post("/predict", content=members, headers={"Content-Encoding": "x-gzip"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"], want, rtol=1e-6)


async def test_fp16_and_bf16_binary_inputs(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    x16 = samples(4, seed=2).astype(np.float16)
    xb = (bf16_bits(samples(4, seed=3)).astype(np.uint32) << 16).view(np.float32)  # exactly bf16 values
    async with serving(Settings(store=tmp_path, precision="fp16")) as client:
        want = await predict(client, x16.astype(np.float32))
        content, headers = binary_request(x16.tobytes(), [4, 16], "FP16")
        body, got = read_response(await client.post(INFER, content=content, headers=headers))
        content, headers = binary_request(bf16_bits(xb).tobytes(), [4, 16], "BF16")
        _, got_bf16 = read_response(await client.post(INFER, content=content, headers=headers))
        want_bf16 = await predict(client, xb)
    assert body["parameters"] == {"precision": "fp16"}
    # The fp16 model casts /predict's float32 to the same fp16 values: one forward, one answer.
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_bf16, want_bf16)


async def test_half_output_datatypes_travel_only_as_binary(tmp_path: Path) -> None:
    for name, datatype in [("half", DataType.FP16), ("bhalf", DataType.BF16)]:
        save_tiny_mlp(tmp_path, name, outputs=[TensorSpec(name="logits", datatype=datatype, shape=[4])])
    x = samples(3, seed=8)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        want = await predict_model(client, "half", x)
        binary = json_request(x, parameters={"binary_data_output": True})
        half = await client.post("/v2/models/half/infer", json=binary)
        bhalf = await client.post("/v2/models/bhalf/infer", json=binary)
        as_json = await client.post("/v2/models/half/infer", json=json_request(x))
    body, got = read_response(half)
    assert body["outputs"][0]["datatype"] == "FP16"
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    n = int(bhalf.headers[HEADER])
    out = orjson.loads(bhalf.content[:n])["outputs"][0]
    assert out["datatype"] == "BF16"
    bits = np.frombuffer(bhalf.content[n:], np.uint16).reshape(out["shape"])
    np.testing.assert_allclose((bits.astype(np.uint32) << 16).view(np.float32), want, rtol=1e-2, atol=1e-2)
    assert as_json.status_code == 400
    assert "JSON has no 16-bit floats" in as_json.json()["error"]


def classes_requested(x: np.ndarray, count: int, binary: bool) -> dict[str, Any]:
    params = {"classification": count, "binary_data": binary}
    return json_request(x, outputs=[{"name": "logits", "parameters": params}])


def read_classes(r: httpx.Response) -> tuple[dict[str, Any], list[list[str]]]:
    """The one output of a classification answer, as rows of strings, whether it came as JSON or binary BYTES."""
    assert r.status_code == 200, r.text
    if HEADER not in r.headers:
        out = r.json()["outputs"][0]
        items = out["data"]
    else:
        n = int(r.headers[HEADER])
        out = orjson.loads(r.content[:n])["outputs"][0]
        data, items = r.content[n:], []
        assert len(data) == out["parameters"]["binary_data_size"]
        while data:  # each element: its length (4 bytes, little-endian), then its bytes
            size = int.from_bytes(data[:4], "little")
            items.append(data[4 : 4 + size].decode())
            data = data[4 + size :]
    assert out["datatype"] == "BYTES"
    rows, count = out["shape"]
    assert len(items) == rows * count
    return out, [items[i * count : (i + 1) * count] for i in range(rows)]


async def test_classification_extension_returns_top_classes(tmp_path: Path) -> None:
    """Triton's classification extension: ``"<value>:<index>:<label>"`` for the top classes of each row, highest
    first, as JSON or binary BYTES; no label where the manifest has none; a count past the classes gives them all."""
    save_tiny_mlp(tmp_path)
    save_tiny_mlp(tmp_path, "unlabelled", labels=None)
    save_tiny_mlp(tmp_path, "half", outputs=[TensorSpec(name="logits", datatype=DataType.FP16, shape=[4])])
    x = samples(3, seed=9)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        want = await predict_model(client, "tiny", x)
        as_json = await client.post(INFER, json=classes_requested(x, 2, binary=False))
        as_binary = await client.post(INFER, json=classes_requested(x, 2, binary=True))
        unlabelled = await client.post("/v2/models/unlabelled/infer", json=classes_requested(x, 1, binary=False))
        every = await client.post(INFER, json=classes_requested(x, 9, binary=False))
        half = await client.post("/v2/models/half/infer", json=classes_requested(x, 4, binary=False))
        meta = (await client.get("/v2")).json()
    assert "classification" in meta["extensions"]
    order = np.argsort(-want, axis=1, kind="stable")
    labels = ["a", "b", "c", "d"]
    out, rows = read_classes(as_json)
    assert out["shape"] == [3, 2]
    assert read_classes(as_binary)[1] == rows
    for row, best, values in zip(rows, order, want, strict=True):
        assert [t.split(":")[1:] for t in row] == [[str(i), labels[i]] for i in best[:2]]
        np.testing.assert_allclose([float(t.split(":")[0]) for t in row], values[best[:2]], rtol=1e-5, atol=1e-5)
    assert [row[0].split(":")[1:] for row in read_classes(unlabelled)[1]] == [[str(best[0])] for best in order]
    assert read_classes(every)[0]["shape"] == [3, 4]
    # An FP16 output (which JSON cannot carry as numbers) is classified by its fp16 values, written as C's "%f" (as
    # Triton does: six decimals), and sent as strings.
    for row, values in zip(read_classes(half)[1], want.astype(np.float16), strict=True):
        assert [t.split(":")[0] for t in row] == [f"{v:f}" for v in sorted(values.astype(float), reverse=True)]


async def test_fp16_input_reaches_an_fp16_model_as_float16(tiny_store: Path) -> None:
    """Shown by the batcher: float16 rows and /predict's float32 rows never share a batch on an fp16 model, while on
    an fp32 model FP16 input is widened and shares one."""
    x = samples(1, seed=4).astype(np.float16)
    content, headers = binary_request(x.tobytes(), [1, 16], "FP16")
    histograms = {}
    for mode in ("fp16", "fp32"):
        async with serving(Settings(store=tiny_store, precision=mode, max_delay_ms=300)) as client:
            r1, r2 = await asyncio.gather(
                client.post("/predict", json={"inputs": x.astype(np.float32).tolist()}),
                client.post(INFER, content=content, headers=headers),
            )
            assert r1.status_code == r2.status_code == 200, (r1.text, r2.text)
            histograms[mode] = (await client.get("/models/tiny/stats")).json()["batch_size_histogram"]
    assert histograms == {"fp16": {"1": 2}, "fp32": {"2": 1}}


def kept_headers() -> list[bytes]:
    return [key[2] for key in plan._plans]


async def test_a_header_sent_again_is_answered_from_its_plan_with_the_data_still_checked(tiny_store: Path) -> None:
    """A client's next request of the same shape sends the same JSON header: the route keeps what the header decided
    and answers the next one from it; each request's data is still read and checked, and the response's header
    follows the precision the answer ran in."""
    x1, x2 = samples(2, seed=11), samples(2, seed=12)
    fields = {"parameters": {"binary_data_output": True}}
    first, headers = binary_request(x1.tobytes(), [2, 16], **fields)
    second, _ = binary_request(x2.tobytes(), [2, 16], **fields)
    header = first[: int(headers[HEADER])]
    bad = x2.copy()
    bad[1, 3] = np.nan
    nan_body, _ = binary_request(bad.tobytes(), [2, 16], **fields)
    settings = Settings(store=tiny_store, precision="fp32", admin_token=TOKEN)
    async with serving(settings) as client:
        want1, want2 = await predict(client, x1), await predict(client, x2)
        r1 = await client.post(INFER, content=first, headers=headers)
        assert header in kept_headers()
        r2 = await client.post(INFER, content=second, headers=headers)
        nan = await client.post(INFER, content=nan_body, headers=headers)
        short = await client.post(INFER, content=second[:-4], headers=headers)
        switched = await client.post("/models/tiny/precision", json={"precision": "fp16"}, headers=AUTH)
        assert switched.status_code == 200, switched.text
        r3 = await client.post(INFER, content=second, headers=headers)
        r4 = await client.post(INFER, content=second, headers=headers)
    body1, got1 = read_response(r1)
    body2, got2 = read_response(r2)
    np.testing.assert_allclose(got1, want1, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got2, want2, rtol=1e-6, atol=1e-6)
    assert (
        body1
        == body2
        == {
            "model_name": "tiny",
            "model_version": "1",
            "parameters": {"precision": "fp32"},
            "outputs": [
                {"name": "logits", "datatype": "FP32", "shape": [2, 4], "parameters": {"binary_data_size": 32}}
            ],
        }
    )
    assert nan.status_code == 400, nan.text
    assert "inputs[0] (binary data): row 1 holds a NaN" in nan.json()["error"]
    assert short.status_code == 400, short.text
    assert "binary_data_size" in short.json()["error"]
    for r in (r3, r4):
        body, got = read_response(r)
        assert body["parameters"] == {"precision": "fp16"}
        np.testing.assert_allclose(got, want2, rtol=2e-2, atol=2e-2)


async def test_kept_headers_are_bounded_and_long_ones_are_not_kept(
    tiny_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers that differ every time replace the oldest kept; a header longer than PLAN_HEADER_BYTES, or with an
    ``id`` (new with each request, where clients send one), is never kept. Every request is answered either way."""
    monkeypatch.setattr(plan, "_plans", {})
    monkeypatch.setattr(plan, "PLANS", 8)
    x = samples(1, seed=13)
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        want = await predict(client, x)
        sent = []
        for i in range(20):
            content, headers = binary_request(x.tobytes(), [1, 16], parameters={"timeout": 10**7 + i})
            sent.append(content[: int(headers[HEADER])])
            np.testing.assert_allclose(
                read_response(await client.post(INFER, content=content, headers=headers))[1], want
            )
        assert kept_headers() == sent[-8:]
        long = {"timeout": 10**7, "note": "x" * plan.PLAN_HEADER_BYTES}
        for fields in ({"parameters": long}, {"id": "request-1"}):
            content, headers = binary_request(x.tobytes(), [1, 16], **fields)
            for _ in range(2):
                body, got = read_response(await client.post(INFER, content=content, headers=headers))
                assert body.get("id") == fields.get("id")
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert kept_headers() == sent[-8:]


def test_input_dtype_rules() -> None:
    spec = TensorSpec(name="features", shape=[2])
    half = np.ones((1, 2), np.float16)
    assert to_input_dtype(half, DataType.FP16, spec, fp16_weights=True, field="x", model="m").dtype == np.float16
    assert to_input_dtype(half, DataType.FP16, spec, fp16_weights=False, field="x", model="m").dtype == np.float32
    for wire, arr in [(DataType.INT64, np.ones((1, 2), np.int64)), (DataType.FP64, np.ones((1, 2)))]:
        assert to_input_dtype(arr, wire, spec, fp16_weights=False, field="x", model="m").dtype == np.float32
    readonly = np.frombuffer(np.ones(2, np.float32).tobytes(), np.float32).reshape(1, 2)
    # No copy of a body's rows already in the target dtype: ServedModel.submit copies them for the engine.
    assert to_input_dtype(readonly, DataType.FP32, spec, fp16_weights=False, field="x", model="m") is readonly
    ids = TensorSpec(name="ids", datatype=DataType.INT32, shape=[2])
    assert to_input_dtype(np.ones((1, 2), np.int64), DataType.INT64, ids, False, "x", "m").dtype == np.int32
    wrong = "x: inference input 'ids' data-type is 'FP32', but model 'm' expects 'INT32'"
    with pytest.raises(InvalidInputError, match=wrong):
        to_input_dtype(np.ones((1, 2), np.float32), DataType.FP32, ids, False, "x", "m")
    with pytest.raises(InvalidInputError, match="do not fit int32"):
        to_input_dtype(np.full((1, 2), 2**40, np.int64), DataType.INT64, ids, False, "x", "m")
    with pytest.raises(
        InvalidInputError, match="data-type is 'BOOL', but model 'm' expects 'FP32' .it takes floating or integer"
    ):
        to_input_dtype(np.ones((1, 2), np.bool_), DataType.BOOL, spec, False, "x", "m")


async def test_raw_binary_body(tiny_store: Path) -> None:
    x = samples(3, seed=5)
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        want = await predict(client, x)
        r = await client.post(INFER, content=x.tobytes(), headers={HEADER: "0"})
        one = await client.post(INFER, content=x[:1].tobytes(), headers={HEADER: "0"})
        partial = await client.post(INFER, content=x.tobytes()[:-4], headers={HEADER: "0"})
        empty = await client.post(INFER, content=b"", headers={HEADER: "0"})
    _, got = read_response(r)  # raw requests get binary outputs
    assert HEADER in r.headers
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(read_response(one)[1], want[:1], rtol=1e-6, atol=1e-6)
    for bad in (partial, empty):
        assert bad.status_code == 400
        assert "whole samples of 'features' (FP32 [16]: 64 bytes each)" in bad.json()["error"]


def _with_header(header: dict[str, Any], tail: bytes, length_delta: int = 0) -> tuple[bytes, dict[str, str]]:
    h = orjson.dumps(header)
    return h + tail, {HEADER: str(len(h) + length_delta)}


def _input(**fields: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "features", "shape": [1, 16], "datatype": "FP32", **fields}]}


ROW = np.zeros(16, np.float32).tobytes()
JSON_ROW = [0.0] * 16
_HEADER = orjson.dumps(_input(parameters={"binary_data_size": 64}))
CLASSES_2 = {"parameters": {"classification": 2}}
_NEGATIVE_ROW = np.full(16, -1.0, np.float32).tobytes()  # 00 00 80 bf: its third byte is no UTF-8 start
BAD_REQUESTS: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("truncated binary", *_with_header(_input(parameters={"binary_data_size": 64}), ROW[:32]), 400, "declare 64 bytes"),
    ("extra binary", *_with_header(_input(parameters={"binary_data_size": 64}), ROW + b"xx"), 400, "66 bytes follow"),
    ("header past body", *_with_header(_input(data=JSON_ROW), b"", 10), 400, "exceeds the body"),
    ("header not a number", orjson.dumps(_input(data=JSON_ROW)), {HEADER: "ten"}, 400, "non-negative integer"),
    ("header negative", orjson.dumps(_input(data=JSON_ROW)), {HEADER: "-1"}, 400, "non-negative integer"),
    (
        "size disagrees with shape",
        *_with_header(_input(parameters={"binary_data_size": 32}), ROW[:32]),
        400,
        "32 bytes of binary data, but shape [1, 16] of FP32 takes 64 bytes",
    ),
    ("size without header", orjson.dumps(_input(parameters={"binary_data_size": 64})), {}, 400, "needs an"),
    ("binary and data", *_with_header(_input(data=JSON_ROW, parameters={"binary_data_size": 64}), ROW), 400, "either"),
    ("unknown datatype", orjson.dumps(_input(datatype="FP8", data=JSON_ROW)), {}, 400, "unknown datatype 'FP8'"),
    ("string tensor", orjson.dumps(_input(datatype="BYTES", data=["a"] * 16)), {}, 400, "takes FP32, not BYTES"),
    ("data shorter than shape", orjson.dumps(_input(data=JSON_ROW[:8])), {}, 400, "8 values, but shape [1, 16]"),
    ("nested unlike shape", orjson.dumps(_input(data=[JSON_ROW[:8], JSON_ROW[8:]])), {}, 400, "nested as [2, 8]"),
    (
        "per-sample shape",
        orjson.dumps(_input(shape=[1, 15], data=JSON_ROW[:15])),
        {},
        400,
        "inputs[0].shape: unexpected shape for input 'features' for model 'tiny'. Expected [-1,16], got [1,15]",
    ),
    ("no batch dimension", orjson.dumps(_input(shape=[16], data=JSON_ROW)), {}, 400, "Expected [-1,16], got [16]"),
    ("zero rows", orjson.dumps(_input(shape=[0, 16], data=[])), {}, 400, "at least 1"),
    (
        "empty shape",
        orjson.dumps(_input(shape=[], data=JSON_ROW)),
        {},
        400,
        "Expected [-1,16], got []: send [N, 16] (batch first)",
    ),
    ("shape of floats", orjson.dumps(_input(shape=[1.0, 16], data=JSON_ROW)), {}, 400, "a list of integers"),
    ("no inputs", orjson.dumps({"inputs": []}), {}, 400, "takes input 'features'"),
    (
        "two inputs",
        orjson.dumps({"inputs": _input(data=JSON_ROW)["inputs"] * 2}),
        {},
        400,
        "expected 1 inputs but got 2 inputs for model 'tiny'",
    ),
    (
        "BOOL input",
        orjson.dumps(_input(datatype="BOOL", data=[True] * 16)),
        {},
        400,
        "data-type is 'BOOL', but model 'tiny' expects 'FP32'",
    ),
    ("inputs missing", orjson.dumps({"id": "x"}), {}, 400, "inputs: expected a non-empty list"),
    (
        "wrong input name",
        orjson.dumps(_input(name="pixels", data=JSON_ROW)),
        {},
        400,
        "unexpected inference input 'pixels' for model 'tiny'",
    ),
    ("no data", orjson.dumps(_input()), {}, 400, "no tensor data"),
    ("JSON FP16", orjson.dumps(_input(datatype="FP16", data=JSON_ROW)), {}, 400, "FP16 data cannot travel as JSON"),
    ("JSON BF16", orjson.dumps(_input(datatype="BF16", data=JSON_ROW)), {}, 400, "BF16 data cannot travel as JSON"),
    ("strings", orjson.dumps(_input(data=["a"] * 16)), {}, 400, "must be numbers, got strings"),
    ("float data, INT64", orjson.dumps(_input(datatype="INT64", data=[0.5] * 16)), {}, 400, "must be integers"),
    ("unknown output", orjson.dumps({**_input(data=JSON_ROW), "outputs": [{"name": "probs"}]}), {}, 400, "'probs'"),
    (
        "output twice",  # the last had won: its classes answered, the first's plain logits dropped
        orjson.dumps({**_input(data=JSON_ROW), "outputs": [{"name": "logits"}, {"name": "logits", **CLASSES_2}]}),
        {},
        400,
        "outputs[1].name: output 'logits' is requested twice",
    ),
    ("id not a string", orjson.dumps({**_input(data=JSON_ROW), "id": 7}), {}, 400, "id: expected a string"),
    ("bad flag", orjson.dumps({**_input(data=JSON_ROW), "parameters": {"binary_data_output": 1}}), {}, 400, "true or"),
    (
        "class count not a number",
        orjson.dumps({**_input(data=JSON_ROW), "outputs": [{"name": "logits", "parameters": {"classification": "3"}}]}),
        {},
        400,
        "outputs[0].parameters.classification: expected a class count, got '3'",
    ),
    (
        "negative class count",
        orjson.dumps({**_input(data=JSON_ROW), "outputs": [{"name": "logits", "parameters": {"classification": -1}}]}),
        {},
        400,
        "expected a class count, got -1",
    ),
    ("malformed JSON", b'{"inputs": [', {}, 400, "malformed JSON"),
    (
        "header length 5 bytes too long",  # the JSON takes 5 bytes of binary data: named by offset, not column 1
        _HEADER + _NEGATIVE_ROW,
        {"Inference-Header-Content-Length": str(len(_HEADER) + 5)},
        400,
        f"body: not valid UTF-8 JSON (byte {len(_HEADER) + 2} of its {len(_HEADER) + 5} is not UTF-8); "
        f"check Inference-Header-Content-Length ({len(_HEADER) + 5}): the bytes of JSON before the binary data",
    ),
    ("not an object", b"[1, 2]", {}, 400, "expected a JSON object"),
    ("brotli", orjson.dumps(_input(data=JSON_ROW)), {"Content-Encoding": "br"}, 415, "'br' is not supported; send"),
    ("not gzip", orjson.dumps(_input(data=JSON_ROW)), {"Content-Encoding": "gzip"}, 400, "not valid gzip data"),
    ("cut gzip", gzip.compress(orjson.dumps(_input(data=JSON_ROW)))[:-12], {"Content-Encoding": "gzip"}, 400, "ends"),
    (
        "bytes after gzip",
        gzip.compress(orjson.dumps(_input(data=JSON_ROW))) + b"tail",
        {"Content-Encoding": "gzip"},
        400,
        "body: has bytes after its compressed stream (Content-Encoding: gzip)",
    ),
    (
        "a cut second gzip member",
        gzip.compress(orjson.dumps(_input(data=JSON_ROW))) + gzip.compress(b" ")[:-3],
        {"Content-Encoding": "gzip"},
        400,
        "body: ends before its compressed stream does (Content-Encoding: gzip)",
    ),
    (
        "two zlib streams as deflate",
        zlib.compress(orjson.dumps(_input(data=JSON_ROW))) + zlib.compress(b" "),
        {"Content-Encoding": "deflate"},
        400,
        "body: has bytes after its compressed stream (Content-Encoding: deflate)",
    ),
    (
        "more gzip members than a body may hold",
        gzip.compress(orjson.dumps(_input(data=JSON_ROW))) + gzip.compress(b"") * 4096,
        {"Content-Encoding": "gzip"},
        400,
        "body: more than 4096 gzip members (Content-Encoding: gzip)",
    ),
    (
        "bytes after two gzip members",
        gzip.compress(orjson.dumps(_input(data=JSON_ROW))) + gzip.compress(b" ") + b"tail",
        {"Content-Encoding": "gzip"},
        400,
        "body: has bytes after its compressed stream (Content-Encoding: gzip)",
    ),
]


async def test_malformed_requests_get_4xx_naming_the_problem_and_serving_goes_on(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        for what, content, headers, status, message in BAD_REQUESTS:
            r = await client.post(INFER, content=content, headers=headers)
            assert r.status_code == status, (what, r.text)
            assert message in r.json()["error"], (what, r.text)
            ok = await client.post(INFER, json=json_request(samples(1)))
            assert ok.status_code == 200, (what, ok.text)


async def test_v2_and_predict_share_a_batch(tiny_store: Path) -> None:
    x = samples(2, seed=6)
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=300)) as client:
        via_predict, via_v2 = await asyncio.gather(
            client.post("/predict", json={"inputs": x[:1].tolist()}),
            client.post(INFER, json=json_request(x[1:])),
        )
        histogram = (await client.get("/models/tiny/stats")).json()["batch_size_histogram"]
        stats = (await client.get("/v2/models/tiny/stats")).json()["model_stats"][0]
    assert via_predict.status_code == 200, via_predict.text
    _, got = read_response(via_v2)
    assert histogram == {"2": 1}  # one batch holding the /predict row and the V2 row
    assert (stats["inference_count"], stats["execution_count"]) == (2, 1)
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(2, 1)]
    assert stats["inference_stats"]["success"]["count"] == 2


async def test_statistics_add_up(tiny_store: Path) -> None:
    rows = [1, 3, 2, 5, 1, 12]  # 12 spans two batches of at most 8
    before = time.time()
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=0, max_request_rows=12)) as client:
        for i, n in enumerate(rows):
            assert (await client.post(INFER, json=json_request(samples(n, seed=i)))).status_code == 200
        await client.post(INFER, json={"inputs": []})  # a 400 never reaches the batcher
        everything = (await client.get("/v2/models/stats")).json()
        one = (await client.get("/v2/models/tiny/stats")).json()
        versioned = (await client.get("/v2/models/tiny/versions/1/stats")).json()
        legacy = (await client.get("/models/tiny/stats")).json()
    assert everything == one == versioned
    s = one["model_stats"][0]
    assert (s["name"], s["version"]) == ("tiny", "1")
    assert s["inference_count"] == sum(rows) == legacy["rows"]
    assert s["execution_count"] == legacy["batches"] == sum(b["compute_infer"]["count"] for b in s["batch_stats"])
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in s["batch_stats"]) == sum(rows)
    assert s["inference_count"] / s["execution_count"] == pytest.approx(legacy["mean_batch_size"])
    inf = s["inference_stats"]
    assert inf["success"]["count"] == len(rows)
    assert inf["fail"]["count"] == 0
    assert inf["queue"]["count"] == len(rows) + 1  # the 12-row request waited once per chunk
    assert inf["compute_infer"]["count"] == s["execution_count"]
    assert inf["success"]["ns"] >= inf["compute_infer"]["ns"] > 0
    assert before * 1000 <= s["last_inference"] <= time.time() * 1000


async def test_timeout_parameter_expires_a_queued_request(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, max_delay_ms=200)) as client:
        r = await client.post(INFER, json=json_request(samples(1), parameters={"timeout": 1000}))
        stats = (await client.get("/v2/models/tiny/stats")).json()["model_stats"][0]
    assert r.status_code == 504, r.text
    assert stats["inference_stats"]["fail"]["count"] == 1


MANAGEMENT = [
    ("/v2/repository/index", None),
    ("/v2/repository/models/tiny/unload", {"parameters": {"unload_dependents": False}}),
    ("/v2/repository/models/tiny/load", {}),
]


async def test_management_calls_are_off_without_an_admin_token(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        for url, body in MANAGEMENT:
            r = await client.post(url, json=body, headers=AUTH)
            assert r.status_code == 403, (url, r.text)
            assert r.json() == {"error": "management API is disabled; set HALFSERVE_ADMIN_TOKEN"}
        assert (await client.get("/v2/models/tiny/ready")).status_code == 200


async def test_management_calls_need_the_admin_token(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, admin_token=TOKEN)) as client:
        for url, body in MANAGEMENT:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
                r = await client.post(url, json=body, headers=headers)
                assert r.status_code == 401, (url, headers, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
            r = await client.post(url, json=body, headers=AUTH)
            assert r.status_code == 200, (url, r.text)


async def test_unload_and_load_round_trip(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    save_tiny_mlp(tmp_path, "spare", seed=1)
    x = samples(2, seed=7)
    settings = Settings(store=tmp_path, models=["tiny"], precision="fp32", admin_token=TOKEN)
    async with serving(settings) as client:
        want = read_response(await client.post(INFER, json=json_request(x)))[1]
        index = (await client.post("/v2/repository/index", headers=AUTH)).json()
        assert index == [
            {"name": "spare", "state": "UNAVAILABLE", "reason": "not loaded"},
            {"name": "tiny", "version": "1", "state": "READY", "reason": ""},
        ]
        r = await client.post("/v2/repository/models/tiny/unload", headers=AUTH)
        assert r.status_code == 200, r.text
        index = (await client.post("/v2/repository/index", headers=AUTH, json={})).json()
        assert {"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index
        assert (await client.post("/v2/repository/index", headers=AUTH, json={"ready": True})).json() == []
        assert (await client.get("/v2/models/tiny/ready")).status_code == 400
        assert (await client.get("/v2/health/ready")).status_code == 400
        unversioned = await client.post(INFER, json=json_request(x))
        versioned = await client.post("/v2/models/tiny/versions/1/infer", json=json_request(x))
        assert unversioned.status_code == 404, unversioned.text  # as Triton: no available versions
        assert unversioned.json()["error"] == "Request for unknown model: 'tiny' has no available versions (unloaded)"
        assert versioned.status_code == 503, versioned.text  # as Triton: that version is not ready
        assert (
            versioned.json()["error"] == "Request for unknown model: 'tiny' version 1 is not at ready state (unloaded)"
        )
        assert (await client.get("/v2/models/tiny/stats")).status_code == 404
        assert (await client.get("/v2/models/stats")).json() == {"model_stats": []}

        r = await client.post("/v2/repository/models/tiny/load", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "READY"
        assert (await client.get("/v2/models/tiny/ready")).status_code == 200
        np.testing.assert_array_equal(read_response(await client.post(INFER, json=json_request(x)))[1], want)
        assert (await client.get("/v2/models/tiny/stats")).json()["model_stats"][0]["inference_count"] == 2

        r = await client.post("/v2/repository/models/spare/load", headers=AUTH)
        assert r.status_code == 200, r.text
        assert (await client.get("/v2/models/spare/ready")).status_code == 200
        assert [e["state"] for e in (await client.post("/v2/repository/index", headers=AUTH)).json()] == ["READY"] * 2

        assert (await client.post("/v2/repository/models/nope/load", headers=AUTH)).status_code == 404
        assert (await client.post("/v2/repository/models/nope/unload", headers=AUTH)).status_code == 404
        assert (await client.post("/v2/repository/models/..%2Fetc/load", headers=AUTH)).status_code in (400, 404)
        override = await client.post(
            "/v2/repository/models/tiny/load", headers=AUTH, json={"parameters": {"config": "{}"}}
        )
        assert override.status_code == 400
        assert "not supported" in override.json()["error"]
        # Not load parameters: each was ignored, and the store's served version loaded as if asked for.
        for parameters, named in [({"version": "1"}, "'version'"), ({"verison": 1, "b": 2}, "'b', 'verison'")]:
            r = await client.post("/v2/repository/models/tiny/load", headers=AUTH, json={"parameters": parameters})
            assert r.status_code == 400
            assert r.json()["error"].startswith(f"parameters: {named}: not a parameter a load takes;")
        for parameters in [[], "", 0, False]:  # were taken as no parameters
            r = await client.post("/v2/repository/models/tiny/load", headers=AUTH, json={"parameters": parameters})
            assert r.status_code == 400
            assert r.json()["error"].startswith("parameters: expected an object, got ")
        r = await client.post("/v2/repository/models/tiny/load", headers=AUTH, json={"parameters": None})
        assert r.status_code == 200


async def test_openapi_documents_the_v2_endpoints(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        schema = (await client.get("/openapi.json")).json()
    paths = schema["paths"]
    for path in [
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{model_name}",
        "/v2/models/{model_name}/ready",
        "/v2/models/{model_name}/config",
        "/v2/models/{model_name}/stats",
        "/v2/models/stats",
        "/v2/repository/index",
        "/v2/repository/models/{model_name}/load",
        "/v2/repository/models/{model_name}/unload",
        "/v2/models/{model_name}/versions/{model_version}/infer",
    ]:
        assert path in paths, path
    infer = paths["/v2/models/{model_name}/infer"]["post"]
    assert set(infer["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
    assert any(p["name"] == HEADER for p in infer["parameters"])


async def test_a_long_unknown_name_or_version_is_quoted_cut(tiny_store: Path) -> None:
    name = "n" * 5000
    async with serving(Settings(store=tiny_store)) as client:
        by_url = await client.get(f"/v2/models/{name}")
        by_body = await client.post("/predict", json={"model": "m" * 10_000, "inputs": [[0.0] * 16]})
        version = await client.post("/predict", json={"version": "9" * 10_000, "inputs": [[0.0] * 16]})
        short = await client.post("/predict", json={"version": "1.0", "inputs": [[0.0] * 16]})
    assert by_url.status_code == by_body.status_code == version.status_code == short.status_code == 404
    cut = "Request for unknown model: '" + "n" * 200 + "'... (5000 characters) is not found (served: tiny)"
    assert by_url.json()["error"] == cut
    assert by_body.json()["error"].endswith("'... (10000 characters) is not found (served: tiny)")
    assert len(by_body.json()["error"]) < 300
    assert version.json()["error"] == (
        "Request for unknown model: 'tiny' version '" + "9" * 200 + "'... (10000 characters) is not found "
        "(it serves version 1)"
    )
    assert short.json()["error"] == "Request for unknown model: 'tiny' version '1.0' is not found (it serves version 1)"
