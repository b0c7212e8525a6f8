"""Models with several named inputs and outputs: Triton's classic ``simple`` model (INPUT0 and INPUT1, INT32 [16] ->
OUTPUT0 = sum, OUTPUT1 = difference) plus a floating output, served in half precision through V2 and ``/predict``.

The INT32 values are past what fp16 (2048) and bf16 (256) hold exactly: exact sums show integer inputs and outputs are
never cast to the half precision.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from halfserve import models, packing, store
from halfserve.api.dataplane.codec import HEADER_LENGTH
from halfserve.engine.core import Engine
from halfserve.engine.protocol import EngineError
from halfserve.execution import Batching, Execution
from halfserve.manifest import DataType, Manifest, OverflowPolicy, Precision, TensorSpec
from halfserve.settings import Settings
from tests.integration.conftest import serving

INFER = "/v2/models/simple/infer"
BIG = 1_000_003  # odd and past 2**20: neither fp16 nor bf16 holds it exactly


@models.register("test_add_sub")
class AddSub(nn.Module):
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (INT32), SCALED = INPUT0 * weight (floating)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((16,), 0.5))

    def forward(self, INPUT0: torch.Tensor, INPUT1: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: N803
        assert INPUT0.dtype == INPUT1.dtype == torch.int32, "integer inputs reach the model as they were sent"
        return {
            "OUTPUT1": INPUT0 - INPUT1,
            "OUTPUT0": INPUT0 + INPUT1,
            "SCALED": INPUT0.to(self.weight.dtype) * self.weight,
        }


@models.register("test_add_sub_args")
class AddSubArgs(nn.Module):
    """The same sums through ``forward(*args)``: inputs in the manifest's order, outputs as a tuple."""

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = args
        return a + b, a - b


def int32(name: str) -> TensorSpec:
    return TensorSpec(name=name, datatype=DataType.INT32, shape=[16])


def save_simple(root: Path, architecture: str = "test_add_sub", precision: str = "bf16", **fields: object) -> Path:
    scaled = [TensorSpec(name="SCALED", shape=[16])] if architecture == "test_add_sub" else []
    manifest = Manifest.model_validate(
        {
            "name": "simple",
            "architecture": architecture,
            "inputs": [int32("INPUT0"), int32("INPUT1")],
            "outputs": [int32("OUTPUT0"), int32("OUTPUT1"), *scaled],
            "precision": precision,
            "batching": Batching(max_batch_size=8, max_delay_ms=20),
            **fields,
        }
    )
    store.save(root, manifest, models.build(architecture))
    return root


def pair(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(-BIG, BIG, (rows, 16)).astype(np.int32)
    a[:, 0] = BIG
    return a, rng.integers(-1000, 1000, (rows, 16)).astype(np.int32)


def v2_json(a: np.ndarray, b: np.ndarray, outputs: list[dict[str, object]] | None = None) -> dict[str, object]:
    body: dict[str, object] = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": list(a.shape), "data": a.ravel().tolist()},
            {"name": "INPUT1", "datatype": "INT32", "shape": list(b.shape), "data": b.ravel().tolist()},
        ]
    }
    if outputs is not None:
        body["outputs"] = outputs
    return body


def by_name(response: dict[str, object]) -> dict[str, dict[str, object]]:
    return {o["name"]: o for o in response["outputs"]}  # type: ignore[attr-defined,index]


async def test_v2_json_two_inputs_give_exact_integer_sums_in_half_precision(tmp_path: Path) -> None:
    a, b = pair(3)
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post(INFER, json=v2_json(a, b))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["parameters"]["precision"] == "bf16"
        outs = by_name(body)
        assert list(outs) == ["OUTPUT0", "OUTPUT1", "SCALED"]
        for name, want in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
            assert (outs[name]["datatype"], outs[name]["shape"]) == ("INT32", [3, 16])
            np.testing.assert_array_equal(np.array(outs[name]["data"]).reshape(3, 16), want)
        # The floating output went through the bf16 weights: close to, not exactly, half the input.
        scaled = np.array(outs["SCALED"]["data"], dtype=np.float64).reshape(3, 16)
        np.testing.assert_allclose(scaled, a * 0.5, rtol=1e-2)
        assert outs["SCALED"]["datatype"] == "FP32"

        meta = (await client.get("/v2/models/simple")).json()
        assert [t["name"] for t in meta["inputs"]] == ["INPUT0", "INPUT1"]
        assert [t["name"] for t in meta["outputs"]] == ["OUTPUT0", "OUTPUT1", "SCALED"]
        config = (await client.get("/v2/models/simple/config")).json()
        assert [t["name"] for t in config["input"]] == ["INPUT0", "INPUT1"]
        listing = (await client.get("/models")).json()
        entry = listing["models"][0] if isinstance(listing, dict) else listing[0]
        assert [t["name"] for t in entry["outputs"]] == ["OUTPUT0", "OUTPUT1", "SCALED"]


async def test_v2_mixed_json_and_binary_inputs_and_outputs_as_asked(tmp_path: Path) -> None:
    a, b = pair(2, seed=1)
    header = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [2, 16], "data": a.ravel().tolist()},
            {"name": "INPUT1", "datatype": "INT32", "shape": [2, 16], "parameters": {"binary_data_size": b.nbytes}},
        ],
        "outputs": [
            {"name": "OUTPUT1", "parameters": {"binary_data": False}},
            {"name": "OUTPUT0", "parameters": {"binary_data": True}},
        ],
    }
    raw = orjson.dumps(header)
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post(
            INFER,
            content=raw + b.tobytes(),
            headers={HEADER_LENGTH: str(len(raw)), "content-type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        length = int(r.headers[HEADER_LENGTH])
        body = orjson.loads(r.content[:length])
        outs = by_name(body)
        assert set(outs) == {"OUTPUT0", "OUTPUT1"}, "only the outputs asked for"
        np.testing.assert_array_equal(np.array(outs["OUTPUT1"]["data"]).reshape(2, 16), a - b)
        size = outs["OUTPUT0"]["parameters"]["binary_data_size"]  # type: ignore[index]
        assert size == a.nbytes
        assert len(r.content) == length + size
        np.testing.assert_array_equal(np.frombuffer(r.content[length:], np.int32).reshape(2, 16), a + b)


async def test_v2_binary_header_sent_again_answers_each_output_and_checks_each_inputs_range(tmp_path: Path) -> None:
    """The same header twice, with other data (the route answers the second from what it kept of the first): each
    output carries the second request's values, and an INT64 input is still range-checked for the INT32 model."""
    a1, b1 = pair(2, seed=3)
    a2, b2 = pair(2, seed=4)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [2, 16], "parameters": {"binary_data_size": 128}},
                {"name": "INPUT1", "datatype": "INT64", "shape": [2, 16], "parameters": {"binary_data_size": 256}},
            ],
            "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}],
            "parameters": {"binary_data_output": True},
        }
    )
    headers = {HEADER_LENGTH: str(len(header)), "content-type": "application/octet-stream"}
    too_big = b2.astype(np.int64)
    too_big[1, 5] = 2**40
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        answers = [
            await client.post(INFER, content=header + a.tobytes() + b.astype(np.int64).tobytes(), headers=headers)
            for a, b in ((a1, b1), (a2, b2), (a2, too_big))
        ]
    for r, (a, b) in zip(answers[:2], ((a1, b1), (a2, b2)), strict=True):
        assert r.status_code == 200, r.text
        length = int(r.headers[HEADER_LENGTH])
        outs = orjson.loads(r.content[:length])["outputs"]
        assert [(o["name"], o["shape"], o["parameters"]["binary_data_size"]) for o in outs] == [
            ("OUTPUT0", [2, 16], a.nbytes),
            ("OUTPUT1", [2, 16], a.nbytes),
        ]
        data = np.frombuffer(r.content[length:], np.int32).reshape(2, 2, 16)
        np.testing.assert_array_equal(data[0], a + b)
        np.testing.assert_array_equal(data[1], a - b)
    assert answers[2].status_code == 400, answers[2].text
    assert answers[2].json()["error"] == f"inputs[1].datatype: values in [{too_big.min()}, {2**40}] do not fit int32"


async def test_predict_takes_and_answers_a_mapping_of_names(tmp_path: Path) -> None:
    a, b = pair(2, seed=2)
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post("/predict", json={"inputs": {"INPUT0": a.tolist(), "INPUT1": b.tolist()}})
        assert r.status_code == 200, r.text
        outputs = r.json()["outputs"]
        assert set(outputs) == {"OUTPUT0", "OUTPUT1", "SCALED"}
        np.testing.assert_array_equal(outputs["OUTPUT0"], a + b)
        np.testing.assert_array_equal(outputs["OUTPUT1"], a - b)


async def test_concurrent_requests_batch_and_each_gets_its_own_rows(tmp_path: Path) -> None:
    requests = [pair(1 + i % 3, seed=10 + i) for i in range(12)]
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        answers = await asyncio.gather(*(client.post(INFER, json=v2_json(a, b)) for a, b in requests))
        for (a, b), r in zip(requests, answers, strict=True):
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(np.array(by_name(r.json())["OUTPUT0"]["data"]).reshape(a.shape), a + b)
        stats = (await client.get("/models")).json()
        entry = stats["models"][0] if isinstance(stats, dict) else stats[0]
        assert entry["stats"]["batches"] < len(requests), "concurrent requests shared batches"


@pytest.mark.parametrize(
    ("what", "body", "message"),
    [
        (
            "missing input",
            {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]},
            "inputs: expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing "
            "required input(s) ['INPUT1']. Please provide all required input(s).",
        ),
        (
            "rows differ",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                    {"name": "INPUT1", "datatype": "INT32", "shape": [2, 16], "data": [1] * 32},
                ]
            },
            "input 'INPUT1' has 2 rows but 'INPUT0' has 1",
        ),
        (
            "unknown input",
            {"inputs": [{"name": "INPUT9", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]},
            "inputs[0].name: unexpected inference input 'INPUT9' for model 'simple'; the model takes inputs "
            "['INPUT0', 'INPUT1']",
        ),
        (
            "twice",
            {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}] * 2},
            "input 'INPUT0' is given twice",
        ),
        (
            "float data",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1.5] * 16},
                    {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                ]
            },
            "inputs[0].datatype: inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'",
        ),
        (
            "a true among integers",
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 15 + [True]},
                    {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
                ]
            },
            "inputs[0].data: INT32 data must be numbers, got true or false",
        ),
        (
            "unknown output",
            {**v2_json(*pair(1)), "outputs": [{"name": "OUTPUT7"}]},
            "unexpected inference output 'OUTPUT7' for model 'simple'",
        ),
    ],
)
async def test_v2_refusals_name_the_input(tmp_path: Path, what: str, body: dict[str, object], message: str) -> None:
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post(INFER, json=body)
        assert r.status_code == 400, (what, r.text)
        assert message in r.json()["error"], (what, r.text)
        a, b = pair(1)
        assert (await client.post(INFER, json=v2_json(a, b))).status_code == 200, "serving goes on"


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([[1] * 16], "takes several inputs"),
        ({"INPUT0": [[1] * 16]}, "inputs.INPUT1: missing"),
        ({"INPUT0": [[1] * 16], "INPUT1": [[1] * 16, [2] * 16]}, "inputs.INPUT1: 2 samples, but 'INPUT0' has 1"),
        ({"INPUT0": [[1] * 16], "INPUT1": [[1] * 16], "X": [[1]]}, "inputs.X: unexpected input"),
        ({"INPUT0": [[1.5] * 16], "INPUT1": [[1] * 16]}, "inputs.INPUT0: the input takes integers"),
        # numpy reads a true beside numbers as 1: it had been taken as an integer 1.
        (
            {"INPUT0": [[True] + [1] * 15], "INPUT1": [[1] * 16]},
            "inputs.INPUT0: the 'INPUT0' input takes numbers (INT32), got true or false",
        ),
        ({"INPUT0": [[1] * 16], "INPUT1": [[False] * 16]}, "inputs.INPUT1: values must be numbers, got booleans"),
    ],
)
async def test_predict_refusals_name_the_input(tmp_path: Path, inputs: object, message: str) -> None:
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post("/predict", json={"inputs": inputs})
        assert r.status_code == 400, r.text
        assert message in r.json()["error"], r.text


async def test_a_raw_binary_body_is_refused_for_several_inputs(tmp_path: Path) -> None:
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post(
            INFER, content=b"\0" * 128, headers={HEADER_LENGTH: "0", "content-type": "application/octet-stream"}
        )
        assert r.status_code == 400, r.text
        assert "INPUT0" in r.json()["error"], r.text


def loaded(root: Path) -> store.LoadedModel:
    return store.load(root, "simple")


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16, Precision.FP16])
def test_forward_star_args_takes_inputs_in_manifest_order_and_pads_to_buckets(
    tmp_path: Path, precision: Precision
) -> None:
    model = loaded(
        save_simple(tmp_path, "test_add_sub_args", execution=Execution(pad_to_bucket=True, batch_buckets=[4]))
    )
    engine = Engine(model, precision, torch.device("cpu"), max_batch_size=8)
    assert engine.positional
    assert engine.named
    assert engine.buckets == [4, 8]
    engine.warmup(8)
    a, b = pair(3, seed=5)
    x = np.empty(3, dtype=packing.input_records(model.manifest))
    x["INPUT0"], x["INPUT1"] = a, b
    outcomes = engine.run_batch([x[:1], x[1:]])  # 3 rows, run as the bucket of 4
    got = np.concatenate([o.data for o in outcomes])  # type: ignore[union-attr]
    np.testing.assert_array_equal(got["OUTPUT0"], a + b)
    np.testing.assert_array_equal(got["OUTPUT1"], a - b)
    assert got.dtype["OUTPUT0"].base == np.int32
    engine.close()


@models.register("test_wrong_names")
class WrongNames(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def test_a_forward_without_the_manifests_input_names_is_refused_at_load(tmp_path: Path) -> None:
    save_simple(tmp_path, "test_wrong_names")
    with pytest.raises(EngineError, match="no parameter named 'INPUT0'"):
        Engine(loaded(tmp_path), Precision.FP32, torch.device("cpu"))


@models.register("test_overflowing_pair")
class OverflowingPair(nn.Module):
    """Two floating inputs; output ``big`` overflows fp16 (200 * sum) for large inputs, ``small`` never does."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = (a + b).sum(-1, keepdim=True)
        return s * 200.0, s * 0.001


def test_a_half_precision_overflow_in_one_output_reruns_the_rows_in_fp32(tmp_path: Path) -> None:
    manifest = Manifest(
        name="pair",
        architecture="test_overflowing_pair",
        inputs=[TensorSpec(name="a", shape=[4]), TensorSpec(name="b", shape=[4])],
        outputs=[TensorSpec(name="big", shape=[1]), TensorSpec(name="small", shape=[1])],
        overflow=OverflowPolicy.RERUN_FP32,
    )
    store.save(tmp_path, manifest, models.build("test_overflowing_pair"))
    engine = Engine(store.load(tmp_path, "pair"), Precision.FP16, torch.device("cpu"))
    x = np.zeros(2, dtype=packing.input_records(manifest))
    x["a"][1] = 100.0  # row 1: 200 * 400 = 80000, past fp16's 65504
    small, large = engine.run_batch([x[:1], x[1:]])
    assert small.precision == "fp16"
    assert large.precision == "fp32"
    assert large.data["big"][0, 0] == pytest.approx(80000.0)  # type: ignore[union-attr]
    assert engine.fp32_reruns == 1
    engine.close()


async def test_a_request_with_thousands_of_input_entries_is_refused_before_any_is_decoded(tmp_path: Path) -> None:
    entry = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post(INFER, json={"inputs": [entry] * 5000})
        assert r.status_code == 400, r.text
        assert "inputs: expected 2 inputs but got 5000 inputs for model 'simple'" in r.json()["error"]
        r = await client.post("/predict", json={"inputs": {f"X{i}": [[1]] for i in range(5000)}})
        assert r.status_code == 400, r.text
        assert "unexpected input" in r.json()["error"]
        a, b = pair(1)
        assert (await client.post(INFER, json=v2_json(a, b))).status_code == 200, "serving goes on"
