"""Variable-length inputs: requests of different lengths share a batch, padded with the input's pad value and an
attention mask the server builds; each answer equals the request's answer served alone; per-token outputs come back
at the request's own length; lengths past max_length are refused (or cut with truncate)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from halfserve import models, packing, store
from halfserve.engine.core import Engine
from halfserve.execution import Batching
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec
from halfserve.models.transformer import attention_bias
from halfserve.settings import Settings
from tests.integration.conftest import serving

CPU = torch.device("cpu")
VOCAB, CLASSES, MAX = 32, 10, 48
INFER = "/v2/models/seq/infer"


@models.register("test_per_token")
class PerToken(nn.Module):
    """The transformer classifier's logits, and a per-token score (each token's embedding summed) for every position."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = models.build("transformer_classifier", vocab=VOCAB, classes=CLASSES, max_length=MAX)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        per_token = self.classifier.embed(tokens).sum(-1, keepdim=True)
        return {"logits": self.classifier(tokens, mask), "token_scores": per_token}


def save_seq(root: Path, architecture: str = "test_per_token", **batching: object) -> store.LoadedModel:
    kwargs = {} if architecture == "test_per_token" else {"vocab": VOCAB, "classes": CLASSES, "max_length": MAX}
    outputs = [TensorSpec(name="logits", shape=[CLASSES])]
    if architecture == "test_per_token":
        outputs.append(TensorSpec(name="token_scores", shape=[-1, 1]))
    manifest = Manifest(
        name="seq",
        architecture=architecture,
        arch_kwargs=kwargs,
        inputs=[
            TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=MAX, pad=0),
            TensorSpec(name="mask", datatype=DataType.INT64, shape=[-1], mask_for="tokens"),
        ],
        outputs=outputs,
        batching=Batching.model_validate({"max_batch_size": 16, "max_delay_ms": 30, **batching}),
    )
    torch.manual_seed(0)
    store.save(root, manifest, models.build(architecture, **kwargs))
    return store.load(root, "seq")


def tokens(length: int, seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, VOCAB, (rows, length)).astype(np.int64)


def packed(loaded: store.LoadedModel, x: np.ndarray) -> np.ndarray:
    return packing.pack(loaded.manifest, {"tokens": x})


@pytest.mark.parametrize(
    ("precision", "tolerance"),
    [(Precision.FP32, 1e-5), (Precision.BF16, 0.06), (Precision.FP16, 0.01)],
)
def test_a_row_in_a_padded_mixed_length_batch_equals_it_alone(
    tmp_path: Path, precision: Precision, tolerance: float
) -> None:
    """The bound is on the largest logit difference relative to the largest logit: a row in a padded batch runs
    through different matmul shapes, so in a half precision its rounding differs by a few ulps."""
    loaded = save_seq(tmp_path, "transformer_classifier", group_lengths=False)
    engine = Engine(loaded, precision, CPU)
    lengths = [3, 17, 40, 1, 9]
    chunks = [packed(loaded, tokens(n, seed=n)) for n in lengths]
    together = [o.data["logits"] for o in engine.run_batch(chunks)]  # type: ignore[union-attr]
    assert engine.padded_elements > 0
    for chunk, got in zip(chunks, together, strict=True):
        (alone,) = engine.run_batch([chunk])
        want = alone.data["logits"]  # type: ignore[union-attr]
        assert np.isfinite(got).all()
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(got - want).max() / scale <= tolerance, (precision, chunk["tokens#length"])
    engine.close()


def test_a_variable_length_model_is_timed_at_its_max_length(tmp_path: Path) -> None:
    """The timed forward that decides its threads and whether it may run on the event loop is the longest it can be
    sent, not the one-token warm-up batch."""
    engine = Engine(save_seq(tmp_path), Precision.FP32, CPU, max_batch_size=4)
    lengths: list[int] = []
    original = engine.forward

    def spy(x: np.ndarray | list[np.ndarray], inst: object = None) -> np.ndarray:
        batch = x if isinstance(x, np.ndarray) else np.concatenate(x)
        lengths.extend(batch["tokens" + packing.LENGTH].tolist())
        return original(x, inst)  # type: ignore[arg-type]

    engine.forward = spy  # type: ignore[method-assign]
    try:
        engine.settle_threads(4, 2)
    finally:
        engine.close()
    assert lengths == [MAX] * 4 * 4  # four forwards of four rows: one to start, three timed
    assert engine.loop_bound is not None


def test_fp16_stays_finite_where_a_literal_mask_constant_would_not(tmp_path: Path) -> None:
    loaded = save_seq(tmp_path, "transformer_classifier", group_lengths=False)
    engine = Engine(loaded, Precision.FP16, CPU, max_batch_size=16)
    # One long row among short ones, and padded rows up to the bucket: most of the batch is padding.
    chunks = [packed(loaded, tokens(MAX, seed=1))] + [packed(loaded, tokens(1, seed=s)) for s in range(2, 7)]
    outs = engine.run_batch(chunks)
    assert all(np.isfinite(o.data["logits"]).all() for o in outs)  # type: ignore[union-attr]
    assert all(o.precision == "fp16" for o in outs)  # type: ignore[union-attr]
    # The same bias with the classic literal: -1e9 is -inf in fp16, and a row of padding only becomes NaN.
    x = torch.zeros(1, 4, 8, dtype=torch.float16)
    padding_only = torch.zeros(1, 4, dtype=torch.long)
    scores = torch.zeros(1, 1, 4, 4, dtype=torch.float16)
    literal = torch.zeros(1, 1, 1, 4).masked_fill(~padding_only.bool()[:, None, None, :], -1e9).half()
    assert torch.isinf(literal).all()
    assert torch.isnan((scores + literal).softmax(-1)).all()
    assert torch.isfinite((scores + attention_bias(padding_only, x)).softmax(-1)).all()
    engine.close()


def v2(x: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": list(x.shape), "data": x.ravel().tolist()}]}


async def test_requests_of_different_lengths_are_answered_as_if_alone_with_per_token_outputs_cut_back(
    tmp_path: Path,
) -> None:
    save_seq(tmp_path, group_lengths=False)
    requests = [tokens(n, seed=n, rows=1 + n % 2) for n in (2, 5, 11, 30, 48, 7)]
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        alone = [(await client.post(INFER, json=v2(x))).json() for x in requests]
        together = await asyncio.gather(*(client.post(INFER, json=v2(x)) for x in requests))
        for x, one, r in zip(requests, alone, together, strict=True):
            assert r.status_code == 200, r.text
            outs = {o["name"]: o for o in r.json()["outputs"]}
            solo = {o["name"]: o for o in one["outputs"]}
            assert outs["token_scores"]["shape"] == [len(x), x.shape[1], 1], "cut back to the request's length"
            np.testing.assert_allclose(outs["logits"]["data"], solo["logits"]["data"], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(outs["token_scores"]["data"], solo["token_scores"]["data"], rtol=1e-5)
        stats = (await client.get("/models/seq/stats")).json()
        assert stats["batches"] < 2 * len(requests), "the concurrent requests shared batches"
        assert stats["padding_waste"] > 0
        metrics = (await client.get("/metrics")).text
        assert 'halfserve_padded_elements_total{model="seq"}' in metrics
        meta = (await client.get("/v2/models/seq")).json()
        assert meta["inputs"] == [{"name": "tokens", "datatype": "INT64", "shape": [-1, -1]}], "the mask is built"


async def test_lengths_are_grouped_into_buckets_when_asked(tmp_path: Path) -> None:
    save_seq(tmp_path)  # group_lengths: true (the default)
    short, long = tokens(3, seed=1), tokens(40, seed=2)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        before = (await client.get("/models/seq/stats")).json()["batches"]
        answers = await asyncio.gather(*(client.post(INFER, json=v2(x)) for x in (short, long, short, long)))
        assert all(r.status_code == 200 for r in answers)
        stats = (await client.get("/models/seq/stats")).json()
        assert stats["batches"] - before == 2, "a batch of short ones (bucket 8) and one of long ones (bucket 64)"
        # Each bucket padded at most to its power of two: 3 -> 8 and 40 -> 48 (the max_length caps 64).
        assert stats["padded_elements"] == 2 * (8 - 3) + 2 * (48 - 40)


@pytest.mark.parametrize(
    ("what", "body", "message"),
    [
        ("too long", v2(tokens(MAX + 1, seed=0)), f"'tokens': length {MAX + 1} is longer than its max_length {MAX}"),
        ("mask sent", {"inputs": [{"name": "mask", "datatype": "INT64", "shape": [1, 2], "data": [1, 1]}]},
         "unexpected inference input 'mask'"),
        ("length zero", {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, 0], "data": []}]},
         "must be at least 1"),
    ],
)  # fmt: skip
async def test_refusals_name_the_input_and_the_limit(tmp_path: Path, what: str, body: object, message: str) -> None:
    save_seq(tmp_path)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        r = await client.post(INFER, json=body)
        assert r.status_code == 400, (what, r.text)
        assert message in r.json()["error"], (what, r.text)
        r = await client.post("/predict", json={"inputs": tokens(MAX + 5, seed=0).tolist()})
        assert r.status_code == 400, r.text
        assert f"longer than its max_length {MAX}" in r.json()["error"]
        assert (await client.post(INFER, json=v2(tokens(4, seed=0)))).status_code == 200, "serving goes on"


async def test_truncate_cuts_long_inputs_to_max_length(tmp_path: Path) -> None:
    loaded = save_seq(tmp_path)
    m = loaded.manifest
    inputs = [m.inputs[0].model_copy(update={"truncate": True}), m.inputs[1]]
    store.write_manifest(tmp_path, m.model_copy(update={"inputs": inputs}))
    long = tokens(MAX + 10, seed=3)
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        cut = (await client.post("/predict", json={"inputs": long[:, :MAX].tolist()})).json()
        r = await client.post("/predict", json={"inputs": long.tolist()})
        assert r.status_code == 200, r.text
        assert r.json()["outputs"]["logits"] == cut["outputs"]["logits"]
        assert np.array(r.json()["outputs"]["token_scores"]).shape == (1, MAX, 1)


def test_manifests_with_variable_dimensions_are_checked() -> None:
    base = {
        "name": "m",
        "architecture": "transformer_classifier",
        "outputs": [TensorSpec(name="y", shape=[2])],
    }
    with pytest.raises(ValueError, match="needs a max_length"):
        Manifest.model_validate({**base, "inputs": [TensorSpec(name="t", datatype=DataType.INT64, shape=[-1])]})
    with pytest.raises(ValueError, match="mask_for 'x' names no variable input"):
        Manifest.model_validate(
            {
                **base,
                "inputs": [
                    TensorSpec(name="t", datatype=DataType.INT64, shape=[-1], max_length=8),
                    TensorSpec(name="m", datatype=DataType.INT64, shape=[-1], mask_for="x"),
                ],
            }
        )
    with pytest.raises(ValueError, match="the first may be -1"):
        TensorSpec(name="t", shape=[4, -1])


async def test_padding_waste_counts_requests_not_warm_up_or_calibration(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_seq(tmp_path)
    save_file({"tokens": tokens(5, seed=9, rows=8)}, str(tmp_path / "seq" / "1" / "calibration.safetensors"))
    async with serving(Settings(store=tmp_path, precision="bf16")) as client:
        stats = (await client.get("/models/seq/stats")).json()
        assert "padded_elements" not in stats, "nothing counted before the first request"
        listing = (await client.get("/models")).json()
        models_ = listing["models"] if isinstance(listing, dict) else listing
        assert models_[0]["fidelity"]["samples"] == 8
        assert (await client.post(INFER, json=v2(tokens(5, seed=1)))).status_code == 200
        stats = (await client.get("/models/seq/stats")).json()
        assert (stats["real_elements"], stats["padded_elements"]) == (5, 3)  # 5 tokens, padded to the bucket of 8
