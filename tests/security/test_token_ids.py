"""Token ids outside the embedding they index are refused with a 400 naming the input and the valid range, before
they are queued: on a GPU an out-of-range index is a device-side assert that poisons the CUDA context for every
model, and on a CPU it was a 500 from the forward. The range is found at load from the model's own embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server.settings import Settings
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
            assert "'tokens'" in error and f"holds {value}" in error, error
            assert f"outside 0..{vocab - 1}" in error, error
            predict = await client.post("/predict", json={"inputs": bad.tolist()})
            assert predict.status_code == 400, predict.text
            assert "'tokens'" in predict.json()["error"]
        # The model keeps serving: the refused ids never reached the forward.
        again = await client.post(INFER, json=ids_body(good))
        assert again.status_code == 200, again.text
        assert again.json()["outputs"] == fine.json()["outputs"]
