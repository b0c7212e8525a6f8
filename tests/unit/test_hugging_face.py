"""Hugging Face model folders as ``transformers:<AutoClass>`` architectures: built from config.json, weights from
model.safetensors, served in half precision; remote code and pickled weights refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from halfserve import store
from halfserve.engine.core import Engine
from halfserve.manifest import DataType, Manifest, Precision, TensorSpec, load_manifest
from halfserve.repository import ModelRepository
from halfserve.settings import Settings
from halfserve.storage import StoreError

CPU = torch.device("cpu")

transformers = pytest.importorskip("transformers")
HF = "transformers:AutoModelForSequenceClassification"


def floating_bytes(module: nn.Module) -> int:
    tensors = (*module.parameters(), *module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())


def tiny_bert(folder: Path) -> nn.Module:
    """A randomly initialised 2-layer BERT classifier (no hub download), saved as a Hugging Face folder."""
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def hf_store(root: Path) -> tuple[Path, nn.Module]:
    m = Manifest(
        name="bert",
        architecture=HF,
        inputs=[TensorSpec(name="input_ids", datatype=DataType.INT64, shape=[8])],
        outputs=[TensorSpec(name="logits", shape=[3])],
    )
    store.write_manifest(root, m)
    vdir = root / "bert" / "1"
    return vdir, tiny_bert(vdir)


def test_a_hugging_face_folder_loads_and_serves_in_half_precision(tmp_path: Path) -> None:
    vdir, original = hf_store(tmp_path)
    assert (vdir / "model.safetensors").is_file()
    ModelRepository(Settings(store=tmp_path)).discover()
    loaded = store.load(tmp_path, "bert")
    ids = np.random.default_rng(0).integers(0, 100, (4, 8)).astype(np.int64)
    with torch.inference_mode():
        want = original(input_ids=torch.from_numpy(ids)).logits.numpy()
    engine = Engine(loaded, Precision.FP32, CPU)
    np.testing.assert_allclose(engine.forward(ids), want, rtol=1e-5, atol=1e-5)
    engine.close()
    fp32_bytes = floating_bytes(engine.model)
    half = Engine(loaded, Precision.BF16, CPU)
    assert next(half.model.parameters()).dtype == torch.bfloat16
    assert floating_bytes(half.model) * 2 == fp32_bytes  # integer buffers (position ids) keep their type
    np.testing.assert_allclose(half.forward(ids), want, atol=0.1)
    half.close()


def test_hugging_face_remote_code_and_pickles_are_refused(tmp_path: Path) -> None:
    vdir, _ = hf_store(tmp_path)
    config = json.loads((vdir / "config.json").read_text())
    (vdir / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.Net"}}))
    with pytest.raises(StoreError, match="auto_map: the model asks for custom code"):
        store.load(tmp_path, "bert")
    (vdir / "config.json").write_text(json.dumps(config))
    (vdir / "model.safetensors").rename(vdir / "pytorch_model.bin")
    with pytest.raises(StoreError, match="pytorch_model.bin: PyTorch pickle weights are refused"):
        store.load(tmp_path, "bert")
    m = load_manifest(tmp_path / "bert").model_copy(update={"arch_kwargs": {"trust_remote_code": True}})
    store.write_manifest(tmp_path, m)
    with pytest.raises(StoreError, match="trust_remote_code is refused"):
        store.load(tmp_path, "bert")


def test_tied_weights_saved_once_load_strictly(tmp_path: Path) -> None:
    """A masked LM's output layer shares the embedding; save_pretrained writes it once, under the embedding's name."""
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    original = transformers.AutoModelForMaskedLM.from_config(config).eval()
    m = Manifest(
        name="mlm",
        architecture="transformers:AutoModelForMaskedLM",
        inputs=[TensorSpec(name="input_ids", datatype=DataType.INT64, shape=[8])],
        outputs=[TensorSpec(name="logits", shape=[8, 100])],
    )
    store.write_manifest(tmp_path, m)
    vdir = tmp_path / "mlm" / "1"
    original.save_pretrained(str(vdir), safe_serialization=True)
    saved = set(load_file(str(vdir / "model.safetensors")))
    assert "cls.predictions.decoder.weight" in original.state_dict()
    assert "cls.predictions.decoder.weight" not in saved  # the tie is what this test exercises
    ModelRepository(Settings(store=tmp_path)).discover()
    loaded = store.load(tmp_path, "mlm").module
    assert loaded.cls.predictions.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
    ids = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, original(input_ids=ids).logits, rtol=0, atol=0)
