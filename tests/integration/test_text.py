"""Text in: texts tokenized by the server with the version's tokenizer.json, over /predict and V2 BYTES (JSON and
binary); each text answered as if it came alone; not UTF-8, too many bytes and too many tokens refused by name."""

from __future__ import annotations

import json
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import save_file

from halfserve import cli, models, store
from halfserve.api.dataplane.codec import HEADER_LENGTH, encode_bytes
from halfserve.manifest import DataType, Manifest, TensorSpec, TextInput
from halfserve.settings import Settings
from tests.conftest import shm_key
from tests.integration.conftest import serving
from tests.integration.test_shm import AUTH, TOKEN, register
from tests.waiting import until

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "the server batches requests of different lengths",
    "half precision halves the weights on the device",
    "a short text",
    "tokens are padded to the longest text in the batch and masked",
    "the quick brown fox jumps over the lazy dog",
] * 4
MAX = 24
INFER = "/v2/models/texty/infer"


def wordpiece(path: Path) -> int:
    """A WordPiece tokenizer trained here on a tiny corpus (as a team would train theirs), saved as tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return int(tok.get_vocab_size())


def save_texty(root: Path) -> Path:
    vdir = root / "texty" / "1"
    vdir.mkdir(parents=True)
    vocab = wordpiece(vdir / "tokenizer.json")
    kwargs = {"vocab": vocab, "classes": 3, "dim": 32, "heads": 2, "layers": 1, "hidden": 64, "max_length": MAX}
    manifest = Manifest(
        name="texty",
        architecture="transformer_classifier",
        arch_kwargs=kwargs,
        inputs=[
            TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=MAX),
            TensorSpec(name="mask", datatype=DataType.INT64, shape=[-1], mask_for="tokens"),
        ],
        outputs=[TensorSpec(name="logits", shape=[3])],
        labels=["a", "b", "c"],
        text=TextInput(input="text", feeds="tokens", max_bytes=400),
    )
    torch.manual_seed(0)
    store.save(root, manifest, models.build("transformer_classifier", **kwargs), version=1)
    return root


def binary_texts(data: bytes, rows: int) -> tuple[bytes, dict[str, str]]:
    """A V2 request whose text input is ``data`` as binary BYTES for a shape of ``rows``: body and headers."""
    item = {"name": "text", "datatype": "BYTES", "shape": [rows], "parameters": {"binary_data_size": len(data)}}
    header = orjson.dumps({"inputs": [item]})
    return header + data, {HEADER_LENGTH: str(len(header)), "content-type": "application/octet-stream"}


TEXTS = ["a short text", "the quick brown fox jumps over the lazy dog and the server batches requests"]


async def test_texts_over_predict_are_answered_as_if_each_came_alone(tmp_path: Path) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        together = await client.post("/predict", json={"inputs": TEXTS})
        assert together.status_code == 200, together.text
        for text, row in zip(TEXTS, together.json()["outputs"], strict=True):
            alone = (await client.post("/predict", json={"inputs": [text]})).json()["outputs"][0]
            np.testing.assert_allclose(row, alone, rtol=1e-5, atol=1e-6)
        assert len(together.json()["labels"]) == 2
        meta = (await client.get("/v2/models/texty")).json()
        assert {"name": "text", "datatype": "BYTES", "shape": [-1, 1]} in meta["inputs"]
        config = (await client.get("/v2/models/texty/config")).json()
        assert [(i["name"], i["data_type"], i["dims"], i.get("optional")) for i in config["input"]] == [
            ("tokens", "TYPE_INT64", [-1], True),
            ("text", "TYPE_STRING", [1], True),
        ]  # the inputs a client sends, as the metadata lists them (the mask is built by the server), either one


async def test_v2_bytes_as_json_and_as_binary_give_the_same_answer(tmp_path: Path) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        as_json = await client.post(
            INFER, json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": TEXTS}]}
        )
        assert as_json.status_code == 200, as_json.text
        body, headers = binary_texts(encode_bytes([t.encode() for t in TEXTS]), 2)
        as_binary = await client.post(INFER, content=body, headers=headers)
        assert as_binary.status_code == 200, as_binary.text
        assert as_binary.json()["outputs"] == as_json.json()["outputs"]
        # nested as the shape [2, 1], row-major as the V2 spec allows for any datatype (issue 2)
        nested = [[t] for t in TEXTS]
        as_nested = await client.post(
            INFER, json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": nested}]}
        )
        assert as_nested.status_code == 200, as_nested.text
        assert as_nested.json()["outputs"] == as_json.json()["outputs"]
        mismatched = await client.post(
            INFER, json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": nested}]}
        )
        assert mismatched.status_code == 400, mismatched.text
        assert mismatched.json()["error"].startswith("inputs[0].data: nested lists that do not match shape [2]")


async def test_texts_in_shared_memory_are_read_as_binary_texts_are_behind_the_admin_token(
    tmp_path: Path, segment: shared_memory.SharedMemory
) -> None:
    data = encode_bytes([t.encode() for t in TEXTS])
    segment.buf[: len(data)] = data
    params = {"shared_memory_region": "r", "shared_memory_byte_size": len(data)}
    in_memory = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "parameters": params}]}
    settings = Settings(store=save_texty(tmp_path), precision="fp32", admin_token=TOKEN, max_body_bytes=2048)
    past_a_body = {"shared_memory_region": "r", "shared_memory_byte_size": 2049}
    too_many = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "parameters": past_a_body}]}
    async with serving(settings) as client:
        anonymous = await client.post(INFER, json=in_memory)
        await register(client, "r", {"key": shm_key(segment), "byte_size": 4096})
        read = await client.post(INFER, json=in_memory, headers=AUTH)
        body, headers = binary_texts(data, 2)
        want = await client.post(INFER, content=body, headers=headers)
        large = await client.post(INFER, json=too_many, headers=AUTH)
    assert large.status_code == 413, large.text  # before a byte is read: as many bytes as a body may hold
    assert large.json()["error"] == (
        "inputs[0].parameters.shared_memory_byte_size: 2049 bytes, more than the 2048 a request's body may hold "
        "(max_body_bytes)"
    )
    # As a tensor input: the region had been passed over and the missing data refused ("expected 2 strings").
    assert anonymous.status_code == 401, anonymous.text
    assert "shared_memory_region: using a shared memory region needs the admin token" in anonymous.json()["error"]
    assert read.status_code == 200, read.text
    assert want.status_code == 200, want.text
    assert read.json()["outputs"] == want.json()["outputs"]


@pytest.mark.parametrize(
    ("what", "texts", "message"),
    [
        ("not UTF-8", [b"caf\xe9"], "inputs[0][0]: not UTF-8"),
        ("too many bytes", [b"x" * 401], "401 bytes, more than the 400 a text may have"),
        ("too many tokens", [" ".join(["fox"] * (MAX + 1)).encode()], f"longer than its max_length {MAX}"),
        ("no tokens", [b"   "], "the text gives no tokens"),
    ],
)
async def test_bad_texts_are_refused_by_name(tmp_path: Path, what: str, texts: list[bytes], message: str) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        data = encode_bytes(texts)
        body, headers = binary_texts(data, 1)
        r = await client.post(INFER, content=body, headers=headers)
        assert r.status_code == 400, (what, r.text)
        assert message in r.json()["error"], (what, r.text)
        body, headers = binary_texts(data[:3], 1)  # a length prefix cut short
        r = await client.post(INFER, content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert (await client.post("/predict", json={"inputs": ["a short text"]})).status_code == 200, "serving goes on"


def test_a_text_block_must_feed_a_variable_integer_input() -> None:
    with pytest.raises(ValueError, match="text.feeds: 'x' names no variable integer input"):
        Manifest(
            name="m",
            architecture="transformer_classifier",
            inputs=[TensorSpec(name="tokens", datatype=DataType.INT64, shape=[-1], max_length=8)],
            outputs=[TensorSpec(name="y", shape=[2])],
            text=TextInput(input="text", feeds="x"),
        )


async def test_a_body_of_many_empty_bytes_elements_stops_at_the_declared_rows(tmp_path: Path) -> None:
    body, headers = binary_texts(b"\0\0\0\0" * 1_000_000, 1)  # a million empty texts for a shape of one
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        r = await client.post(INFER, content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert "3999996 bytes follow BYTES element 0, the last of the 1 elements of shape [1]" in r.json()["error"]


async def test_a_missing_tokenizer_fails_the_models_load_not_its_requests(tmp_path: Path) -> None:
    (save_texty(tmp_path) / "texty" / "1" / "tokenizer.json").write_text("{not json")
    from halfserve.app import create_app

    app = create_app(Settings(store=tmp_path, precision="fp32"))
    async with app.router.lifespan_context(app):
        repo = app.state.serving.repository
        await until(lambda: repo.models["texty"].state.value == "failed", "texty's load failing", every=0.05)
        assert "cannot read the tokenizer" in repo.models["texty"].error


async def test_a_wrong_input_name_lists_the_text_input(tmp_path: Path) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        body = {"inputs": [{"name": "sentence", "datatype": "BYTES", "shape": [1, 1], "data": ["a short text"]}]}
        r = await client.post(INFER, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == (
            "inputs[0].name: unexpected inference input 'sentence' for model 'texty'; the model takes text input "
            "'text' (BYTES, one text per row) or 'tokens'"
        )


async def test_a_tokenizer_gone_after_load_is_the_servers_problem_not_the_requests(tmp_path: Path) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        assert (await client.post("/predict", json={"inputs": ["a short text"]})).status_code == 200
        (tmp_path / "texty" / "1" / "tokenizer.json").unlink()
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["a short text"]}]}
        for r in (await client.post(INFER, json=body), await client.post("/predict", json={"inputs": ["a text"]})):
            assert r.status_code == 503, r.text  # as a missing checkpoint: the server's files, not the client's text
            assert "model 'texty' cannot take text now" in r.json()["error"]
            assert "tokenizer.json: the model's tokenizer is missing" in r.json()["error"]


async def test_a_state_dict_imports_with_the_tokenizer_beside_it_and_answers_texts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, root = tmp_path / "trained", tmp_path / "store"
    source.mkdir()
    tokenizer = source / "tokenizer.json"
    kwargs = {"vocab": wordpiece(tokenizer), "classes": 3, "dim": 32, "heads": 2, "layers": 1, "hidden": 64}
    torch.manual_seed(0)
    model = models.build("transformer_classifier", **kwargs, max_length=MAX)
    save_file(model.state_dict(), str(source / "model.safetensors"))
    (tmp_path / "texts.txt").write_text("\n".join(CORPUS[:5]))
    args = ["import", str(source / "model.safetensors"), "--store", str(root), "--name", "texty", "--device", "cpu"]
    args += ["--architecture", "transformer_classifier", "--arch-kwargs", json.dumps({**kwargs, "max_length": MAX})]
    args += ["--input", "tokens:INT64:-1", "--max-length", str(MAX), "--mask", "mask", "--text", "text"]
    tokenizer.rename(tmp_path / "elsewhere.json")
    assert cli.main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"halfserve import: --text text: {tokenizer}: not found; a text model is served with the tokenizer.json "
        "beside its weights, which the import copies into the version: put the model's tokenizer there"
    )
    assert not root.exists(), "nothing written"
    tokenizer.symlink_to(tmp_path / "elsewhere.json")  # copied, it would be whatever file it links to
    assert cli.main(args) == 2
    assert (
        capsys.readouterr().err.strip().endswith(f"{tokenizer}: a symbolic link; put the tokenizer file itself there")
    )
    tokenizer.unlink()
    tokenizer.write_text('{"not": "a tokenizer"}')  # the version would fail its load: refused now
    assert cli.main(args) == 2
    assert f"--text text: {tokenizer}: cannot read the tokenizer" in capsys.readouterr().err
    assert not root.exists(), "nothing written"
    (tmp_path / "elsewhere.json").rename(tokenizer)
    assert cli.main([*args, "--calibration", str(tmp_path / "texts.txt")]) == 0  # tokenized with it
    assert "calibration: texts from" in capsys.readouterr().out
    assert (root / "texty" / "1" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    async with serving(Settings(store=root, precision="fp32")) as client:
        r = await client.post("/predict", json={"inputs": TEXTS})
        assert r.status_code == 200, r.text
        assert len(r.json()["outputs"]) == 2
