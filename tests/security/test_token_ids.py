"""Token ids outside the embedding they index are refused with a 400 naming the input and the valid range, before
they are queued: on a GPU an out-of-range index is a device-side assert that poisons the CUDA context for every
model, and on a CPU it was a 500 from the forward. The range is found at load from the model's own embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from halfserve.settings import Settings
from tests.integration.conftest import serving
from tests.integration.test_text import INFER, save_texty

pytest.importorskip("tokenizers")


def ids_body(ids: np.ndarray) -> dict[str, object]:
    return {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": list(ids.shape), "data": ids.ravel().tolist()}]}


async def test_ids_outside_the_embedding_are_a_400_naming_the_input_and_range(tmp_path: Path) -> None:
    root = save_texty(tmp_path)
    tokenizers = pytest.importorskip("tokenizers")
    vocab = tokenizers.Tokenizer.from_file(str(root / "texty" / "1" / "tokenizer.json")).get_vocab_size()
    async with serving(Settings(store=root, precision="fp32")) as client:
        good = np.array([[2, 3, 4], [5, 6, 7]], dtype=np.int64)
        fine = await client.post(INFER, json=ids_body(good))
        assert fine.status_code == 200, fine.text
        for bad, value in ((np.array([[2, 3, 4], [5, 100_000, 7]]), 100_000), (np.array([[2, -1, 4], [5, 6, 7]]), -1)):
            r = await client.post(INFER, json=ids_body(bad.astype(np.int64)))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert "'tokens'" in error, error
            assert f"holds {value}" in error, error
            assert f"outside 0..{vocab - 1}" in error, error
            predict = await client.post("/predict", json={"inputs": bad.tolist()})
            assert predict.status_code == 400, predict.text
            assert "'tokens'" in predict.json()["error"]
        # The model keeps serving: the refused ids never reached the forward.
        again = await client.post(INFER, json=ids_body(good))
        assert again.status_code == 200, again.text
        assert again.json()["outputs"] == fine.json()["outputs"]


def test_a_hugging_face_models_id_inputs_get_their_own_tables_range(tmp_path: Path) -> None:
    """Found from the embedding each input reaches: the word table for ``input_ids``, the type table for
    ``token_type_ids``; the attention mask indexes nothing."""
    transformers = pytest.importorskip("transformers")
    from halfserve import store
    from halfserve.errors import InvalidInputError
    from halfserve.indices import check_indices, index_limits
    from halfserve.manifest import DataType, Manifest, TensorSpec

    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=3
    )
    ids = [TensorSpec(name=n, datatype=DataType.INT64, shape=[8]) for n in ("input_ids", "token_type_ids")]
    manifest = Manifest(
        name="bert",
        architecture="transformers:AutoModelForSequenceClassification",
        inputs=[*ids, TensorSpec(name="attention_mask", datatype=DataType.INT64, shape=[8])],
        outputs=[TensorSpec(name="logits", shape=[3])],
    )
    store.write_manifest(tmp_path, manifest)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(str(tmp_path / "bert" / "1"))
    loaded = store.load(tmp_path, "bert")
    limits = index_limits(loaded.module, loaded.manifest)
    assert limits == {"input_ids": 100, "token_type_ids": 2}
    fine = {"input_ids": np.full((2, 8), 99), "token_type_ids": np.ones((2, 8), np.int64)}
    check_indices(limits, manifest, fine)
    with pytest.raises(InvalidInputError, match=r"'token_type_ids' row 1 holds 2, outside 0..1"):
        check_indices(limits, manifest, {**fine, "token_type_ids": np.array([[0] * 8, [1, 2] + [0] * 6])})
