"""The app in-process: /predict, listings, stats, readiness, precision switch and bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from halfserve import precision, store
from halfserve.execution import Batching, Execution
from halfserve.placement import LOOP_SECONDS_PER_ROW, available_cores
from halfserve.settings import Settings
from tests.conftest import needs_cxx, save_tiny_mlp
from tests.integration.conftest import serving


def reference(store_dir: Path, name: str, x: np.ndarray) -> np.ndarray:
    loaded = store.load(store_dir, name)
    with torch.inference_mode():
        return loaded.module(torch.from_numpy(x)).numpy()


async def test_predict_answers_outputs_and_labels(tiny_store: Path) -> None:
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        r = await client.post("/predict", json={"model": "tiny", "inputs": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["model"], body["version"], body["precision"]) == ("tiny", 1, "fp32")
    want = reference(tiny_store, "tiny", x)
    np.testing.assert_allclose(np.array(body["outputs"]), want, rtol=1e-5, atol=1e-5)
    assert body["labels"] == [["a", "b", "c", "d"][i] for i in want.argmax(1)]


async def test_model_name_is_optional_with_one_model(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post("/predict", json={"inputs": [[0.5] * 16]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


async def test_one_models_entry_is_the_listings_and_an_unknown_model_a_404(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "halfmodel", precision="bf16")
    save_tiny_mlp(tmp_path, "fullmodel", precision="fp32")
    async with serving(Settings(store=tmp_path)) as client:
        listing = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
        one = {name: await client.get(f"/models/{name}") for name in listing}
        unknown = await client.get("/models/nope")
    assert {name: r.status_code for name, r in one.items()} == {"halfmodel": 200, "fullmodel": 200}
    assert {name: r.json() for name, r in one.items()} == listing
    assert listing["halfmodel"]["precision"] != listing["fullmodel"]["precision"]
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "Request for unknown model: 'nope' is not found (served: fullmodel, halfmodel)"


async def test_fp32_switch_serves_fp32_weights(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        listing = (await client.get("/models")).json()["models"][0]
        r = await client.post("/predict", json={"inputs": [[0.5] * 16]})
    assert listing["precision"] == "fp32"
    assert listing["weight_dtype"] == "float32"
    assert r.json()["precision"] == "fp32"


@pytest.mark.parametrize(("mode", "dtype"), [("fp16", "float16"), ("bf16", "bfloat16"), ("autocast", "float32")])
async def test_half_precision_agrees_with_fp32(tiny_store: Path, mode: str, dtype: str) -> None:
    """Half-precision logits stay within 2% of the logits' scale of fp32 and pick the same top class."""
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    async with serving(Settings(store=tiny_store, precision=mode, max_request_rows=64)) as client:
        listing = (await client.get("/models")).json()["models"][0]
        body = (await client.post("/predict", json={"inputs": x.tolist()})).json()
    assert listing["weight_dtype"] == dtype
    assert body["precision"] == mode
    want = reference(tiny_store, "tiny", x)
    got = np.array(body["outputs"])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=0.02 * scale, rtol=0)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.95


async def test_manifest_precision_applies_per_model_and_global_switch_overrides(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, "halfmodel", precision="bf16")
    save_tiny_mlp(tmp_path, "fullmodel", precision="fp32")
    async with serving(Settings(store=tmp_path)) as client:
        per_model = {m["name"]: m["precision"] for m in (await client.get("/models")).json()["models"]}
    assert per_model == {"halfmodel": "bf16", "fullmodel": "fp32"}
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        switched = {m["name"]: m["precision"] for m in (await client.get("/models")).json()["models"]}
    assert switched == {"halfmodel": "fp32", "fullmodel": "fp32"}


async def test_auto_picks_a_half_precision_only_where_it_is_fast(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        listing = (await client.get("/models")).json()["models"][0]
    expected = precision.resolve("auto", torch.device("cpu")).value
    assert listing["precision"] == expected
    assert expected in ("bf16", "fp32")  # never fp16 on a CPU


async def test_concurrent_requests_are_batched(tiny_store: Path) -> None:
    x = np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32)
    async with serving(Settings(store=tiny_store, precision="fp32", max_delay_ms=20)) as client:
        responses = await asyncio.gather(*(client.post("/predict", json={"inputs": [row.tolist()]}) for row in x))
        stats = (await client.get("/models/tiny/stats")).json()
    got = np.array([r.json()["outputs"][0] for r in responses])
    np.testing.assert_allclose(got, reference(tiny_store, "tiny", x), rtol=1e-5, atol=1e-5)
    assert stats["requests"] == 32
    assert stats["rows"] == 32
    assert max(int(k) for k in stats["batch_size_histogram"]) > 1
    assert sum(int(k) * v for k, v in stats["batch_size_histogram"].items()) == 32


async def test_request_larger_than_a_batch_spans_batches(tiny_store: Path) -> None:
    x = np.random.default_rng(3).standard_normal((20, 16)).astype(np.float32)  # max_batch_size is 8
    async with serving(Settings(store=tiny_store, precision="fp32", max_request_rows=20)) as client:
        body = (await client.post("/predict", json={"inputs": x.tolist()})).json()
        stats = (await client.get("/models/tiny/stats")).json()
    np.testing.assert_allclose(np.array(body["outputs"]), reference(tiny_store, "tiny", x), rtol=1e-5, atol=1e-5)
    assert stats["batch_size_histogram"] == {"4": 1, "8": 2}


BAD_REQUESTS = [
    (b"{", 400, "malformed JSON"),
    (b"", 400, "body: empty"),
    (b"[1, 2]", 400, "expected a JSON object"),
    (b'{"inputs": []}', 400, "inputs: empty"),
    (b'{"inputs": 3}', 400, "inputs: expected a list"),
    (b'{"model": "tiny"}', 400, "inputs: missing"),
    (b'{"inputs": [[1, 2, 3]]}', 400, "inputs: each sample must have shape [16], got [3]"),
    (b'{"inputs": [1, 2]}', 400, "got a scalar"),
    (b'{"inputs": [["x", "y", "z", "w", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"]]}', 400, "strings"),
    (b'{"inputs": [[1, null, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]}', 400, "must be numbers"),
    (b'{"inputs": [[1, 2], [1]]}', 400, "ragged"),
    (b'{"model": 7, "inputs": [[1]]}', 400, "model: expected a string"),
    # Fields /predict does not read had been left out silently: a misspelt one, or KServe v1's instances.
    (b'{"instances": [[1]]}', 400, "instances: unexpected field; /predict reads inputs, and model and version if"),
    (b'{"inputs": [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], "verison": 1}', 400, "verison: unexpected field"),
    # As /predictions names them; the numbers' refusal ("values must be numbers") had been given.
    (b'{"inputs": [{"b64": "iVBORw0KGgo="}]}', 400, "inputs[0].b64: model 'tiny' takes no images: its manifest has no"),
    (b'{"model": "nope", "inputs": [[1]]}', 404, "Request for unknown model: 'nope' is not found"),
]


async def test_bad_input_gets_a_4xx_naming_the_problem_and_serving_goes_on(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        for body, status, message in BAD_REQUESTS:
            r = await client.post("/predict", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            assert message in r.json()["error"], (body, r.text)
        ok = await client.post("/predict", json={"inputs": [[0.0] * 16]})
        assert ok.status_code == 200
        assert (await client.get("/models/nope/stats")).status_code == 404
        missing = await client.get("/no/such/path")
        assert missing.status_code == 404
        assert "error" in missing.json()


async def test_listing_shows_signature_batching_and_device(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store, max_batch_size=16, precision="fp32")) as client:
        m = (await client.get("/models")).json()["models"][0]
        health = await client.get("/health")
    assert health.json() == {"status": "live"}
    assert m["name"] == "tiny"
    assert m["version"] == 1
    assert m["device"] == "cpu"
    assert m["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [16]}]
    assert m["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [4]}]
    assert m["batching"]["max_batch_size"] == 16  # the global override wins over the manifest's 8
    assert m["batching"]["adaptive_delay"] is True  # the manifest's default
    assert m["weight_bytes"] == (16 * 32 + 32 + 32 * 4 + 4) * 4


async def test_adaptive_delay_is_a_manifest_field_with_a_global_override(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, batching=Batching(max_batch_size=8, max_delay_ms=5, adaptive_delay=False))
    async with serving(Settings(store=tmp_path)) as client:
        assert (await client.get("/models")).json()["models"][0]["batching"]["adaptive_delay"] is False
    async with serving(Settings(store=tmp_path, adaptive_delay=True)) as client:
        assert (await client.get("/models")).json()["models"][0]["batching"]["adaptive_delay"] is True


async def test_highest_version_is_served_unless_pinned(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, seed=0)
    save_tiny_mlp(tmp_path, seed=1)
    async with serving(Settings(store=tmp_path)) as client:
        assert (await client.post("/predict", json={"inputs": [[0.0] * 16]})).json()["version"] == 2
    save_tiny_mlp(tmp_path, seed=2, version=1)  # rewrites the manifest with a pin
    async with serving(Settings(store=tmp_path)) as client:
        assert (await client.post("/predict", json={"inputs": [[0.0] * 16]})).json()["version"] == 1
        # A version asked for must be the one served, as on V2's /versions/{v} (it was ignored).
        served = await client.post("/predict", json={"version": 1, "inputs": [[0.0] * 16]})
        as_text = await client.post("/predict", json={"version": "1", "inputs": [[0.0] * 16]})
        other = await client.post("/predict", json={"version": 2, "inputs": [[0.0] * 16]})
        v2 = await client.post("/v2/models/tiny/versions/2/infer", json={"inputs": []})
        wrong = await client.post("/predict", json={"version": True, "inputs": [[0.0] * 16]})
        empty = await client.post("/predict", json={"version": "", "inputs": [[0.0] * 16]})  # it meant any
    assert served.status_code == as_text.status_code == 200
    assert other.status_code == v2.status_code == 404
    assert other.json()["error"] == v2.json()["error"]
    assert other.json()["error"].endswith("'tiny' version 2 is not found (it serves version 1)")
    assert wrong.status_code == 400
    assert wrong.json()["error"] == "version: expected an integer, got true"
    assert empty.status_code == 400
    assert empty.json()["error"] == 'version: expected an integer, got ""'


@needs_cxx
async def test_a_model_compiled_with_inductor_serves_in_bf16_and_reports_its_compile_time(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, execution=Execution(compile="inductor"), batching=Batching(max_batch_size=2))
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    async with serving(Settings(store=tmp_path, precision="bf16")) as client:
        answers = await asyncio.gather(
            *(client.post("/predict", json={"model": "tiny", "inputs": x[i : i + 1].tolist()}) for i in range(3))
        )
        listing = (await client.get("/models")).json()
    assert [r.status_code for r in answers] == [200] * 3
    assert {r.json()["precision"] for r in answers} == {"bf16"}
    got = np.concatenate([r.json()["outputs"] for r in answers])
    want = reference(tmp_path, "tiny", x)
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), rtol=0)
    (entry,) = listing["models"]
    assert entry["execution"]["buckets"] == [1, 2]
    assert entry["execution"]["inductor"] is True
    assert entry["execution"]["inductor_compile_seconds"] > 0
    assert entry["execution"]["compile_cache"] == "miss"
    assert len(list((tmp_path / ".cache" / "compile").glob("*.artifacts"))) == 1


async def post_each_row(client: httpx.AsyncClient, x: np.ndarray, *batches: np.ndarray) -> np.ndarray:
    """Each row of ``x`` as a ``/predict`` request of its own and each of ``batches`` as one request, all at once:
    every answer a 200, their outputs in that order."""
    got = await asyncio.gather(
        *(client.post("/predict", json={"inputs": x[i : i + 1].tolist()}) for i in range(len(x))),
        *(client.post("/predict", json={"inputs": b.tolist()}) for b in batches),
    )
    assert [r.status_code for r in got] == [200] * (len(x) + len(batches))
    return np.concatenate([r.json()["outputs"] for r in got])


@pytest.mark.instance_threads
async def test_a_cpu_model_whose_forward_is_shorter_than_the_loops_work_runs_on_the_event_loop(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, batching=Batching(max_batch_size=8, max_delay_ms=50))
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    loop_work = 8 * LOOP_SECONDS_PER_ROW
    # Made-up forwards of a full batch: a tenth and ten times the loop's work on it.
    runs = {
        "short": (loop_work / 10, "auto"),
        "long": (loop_work * 10, "auto"),
        "off": (loop_work / 10, "instance_threads"),
    }
    answers, placed = {}, {}
    for run, (seconds, setting) in runs.items():
        settings = Settings(store=tmp_path, precision="fp32", forward_seconds=seconds, placement=setting)  # type: ignore[arg-type]
        async with serving(settings) as client:
            answers[run] = await post_each_row(client, x)
            (entry,) = (await client.get("/models")).json()["models"]
            placed[run] = entry["execution"]["placement"] == "event_loop"
            histogram = (await client.get("/models/tiny/stats")).json()["batch_size_histogram"]
            assert sum(int(k) * v for k, v in histogram.items()) >= 8
    # By default where the forward settles on one thread: on up to 2 cores (on more it takes every core but one).
    assert placed == {"short": available_cores() <= 2, "long": False, "off": False}
    for run in runs:
        np.testing.assert_array_equal(answers[run], answers["off"])
    np.testing.assert_allclose(answers["off"], reference(tmp_path, "tiny", x), rtol=1e-5, atol=1e-5)


@pytest.mark.instance_threads
async def test_a_pipelined_cpu_model_answers_as_an_eager_one(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path, batching=Batching(max_batch_size=8, max_delay_ms=50))
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    answers, listed = {}, {}
    for setting in (True, False):
        placement = "beside_loop" if setting else "instance_threads"
        async with serving(Settings(store=tmp_path, precision="fp32", placement=placement)) as client:  # type: ignore[arg-type]
            answers[setting] = await post_each_row(client, x, x[:8])  # 8: more rows than a pipelined batch takes
            (entry,) = (await client.get("/models")).json()["models"]
            stats = (await client.get("/models/tiny/stats")).json()
            listed[setting] = (entry["execution"]["placement"] == "beside_loop", stats["max_batch_size"])
            assert max(int(k) for k in stats["batch_size_histogram"]) <= stats["max_batch_size"]
    # Pipelined: two batches in flight, each of up to half the model's max_batch_size.
    assert listed == {True: (True, 4), False: (False, 8)}
    np.testing.assert_array_equal(answers[True], answers[False])
    want = reference(tmp_path, "tiny", x)
    np.testing.assert_allclose(answers[True], np.concatenate([want, want[:8]]), rtol=1e-5, atol=1e-5)
