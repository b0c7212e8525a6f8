"""Padding invariance and real calibration data on the Hugging Face import path: a transformer classifier imported
without its attention mask is refused (and fails its load, the other models serving on), with its mask it is
accepted; texts and ragged sequences given as calibration are stored and replayed at load, and the report and
/models say which samples were used; labels come from config.json's id2label."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from halfserve import calibration, cli, padding, store
from halfserve.app import create_app
from halfserve.manifest import DataType, Manifest, TensorSpec, load_manifest, sent_inputs
from halfserve.settings import Settings
from tests.conftest import save_tiny_mlp
from tests.integration.test_text import CORPUS, wordpiece
from tests.waiting import until

transformers = pytest.importorskip("transformers")

HF = "transformers:AutoModelForSequenceClassification"
MAX = 24


def tiny_bert(folder: Path, vocab: int = 100, **config: object) -> Path:
    """A randomly initialised 2-layer BERT classifier with 3 classes, saved as a Hugging Face folder."""
    settings = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "num_labels": 3,
        "pad_token_id": 0,
        **config,
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(transformers.BertConfig(**settings))
    model.eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


def text_bert(folder: Path) -> Path:
    """A tiny BERT with the WordPiece tokenizer its vocabulary comes from, as a team's text classifier folder."""
    folder.mkdir(parents=True)
    return tiny_bert(folder, wordpiece(folder / "tokenizer.json"))


def import_args(source: Path, root: Path, *more: str) -> list[str]:
    return [
        "import",
        str(source),
        "--store",
        str(root),
        "--name",
        "bert",
        "--architecture",
        HF,
        "--input",
        "input_ids:INT64:-1",
        "--max-length",
        str(MAX),
        "--device",
        "cpu",
        *more,
    ]


@contextlib.asynccontextmanager
async def started(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan, once every model has finished loading (ready or failed)."""
    app = create_app(settings)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    async with app.router.lifespan_context(app), client:
        repo = app.state.serving.repository
        await until(lambda: all(m.state.value != "loading" for m in repo.models.values()), "every model loaded")
        yield client


async def listed(client: httpx.AsyncClient) -> dict[str, dict[str, object]]:
    body = (await client.get("/models")).json()
    return {m["name"]: m for m in (body["models"] if isinstance(body, dict) else body)}


def test_a_transformer_imported_without_its_mask_is_refused_and_with_it_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, root = tiny_bert(tmp_path / "bert"), tmp_path / "store"
    capsys.readouterr()  # transformers' progress bar while saving
    assert cli.main(import_args(source, root)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "its answers change with padding" in line
    assert "has no attention mask input" in line
    assert "import it with --mask attention_mask" in line  # the forward's own argument, named
    assert "--accept-padding-variance" in line
    assert not (root / "bert").exists()  # refused before anything is written

    assert cli.main(import_args(source, root, "--mask", "attention_mask")) == 0
    printed = capsys.readouterr().out
    report = next(x for x in printed.splitlines() if "padding:" in x)
    assert "a sample alone and padded to" in report
    assert "CHANGE" not in report
    assert load_manifest(root / "bert").padding_invariant

    assert cli.main(import_args(source, root, "--accept-padding-variance")) == 0
    assert "ANSWERS CHANGE WITH PADDING, accepted by --accept-padding-variance" in capsys.readouterr().out
    assert load_manifest(root / "bert").padding_invariant is False


def save_unmasked_bert(root: Path, name: str, **fields: object) -> None:
    """A BERT classifier's manifest with a variable input and no attention mask, as an operator might write it."""
    manifest = Manifest(
        name=name,
        architecture=HF,
        inputs=[TensorSpec(name="input_ids", datatype=DataType.INT64, shape=[-1], max_length=MAX)],
        outputs=[TensorSpec(name="logits", shape=[3])],
        **fields,
    )
    store.write_manifest(root, manifest)
    tiny_bert(root / name / "1")


async def test_a_model_whose_answers_change_with_padding_fails_its_load_and_the_others_serve(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    save_unmasked_bert(tmp_path, "unmasked")
    save_unmasked_bert(tmp_path, "accepted", padding_invariant=False)
    async with started(Settings(store=tmp_path, precision="fp32")) as client:
        models = await listed(client)
        assert models["unmasked"]["state"] == "failed"
        error = str(models["unmasked"]["error"])
        assert "its answers change with padding" in error
        assert "--mask attention_mask" in error
        assert '"mask_for": "input_ids"' in error  # the manifest's fix too, for a store written by hand
        accepted = models["accepted"]
        assert accepted["state"] == "ready"
        padding = accepted["padding"]
        assert isinstance(padding, dict)
        assert padding["invariant"] is False
        assert padding["accepted"] is True
        assert padding["max_rel_diff"] > padding["tolerance"]
        assert "random" in str(padding["calibration"])  # no samples stored: random ones, and it says so
        assert models["tiny"]["state"] == "ready"
        assert models["tiny"]["padding"] is None  # no variable dimension
        r = await client.post("/predict", json={"model": "tiny", "inputs": [[0.5] * 16]})
        assert r.status_code == 200, r.text
        r = await client.post("/predict", json={"model": "unmasked", "inputs": [[1, 2, 3]]})
        assert r.status_code == 503
        assert "answers change with padding" in r.json()["error"]


def test_a_mask_the_model_ignores_is_named_as_the_cause(tmp_path: Path) -> None:
    source = tiny_bert(tmp_path / "bert")
    manifest = Manifest(
        name="bert",
        architecture=HF,
        inputs=[
            TensorSpec(name="input_ids", datatype=DataType.INT64, shape=[-1], max_length=MAX),
            # Passed as token_type_ids: the model never sees a mask, though the manifest builds one.
            TensorSpec(name="token_type_ids", datatype=DataType.INT64, shape=[-1], mask_for="input_ids"),
        ],
        outputs=[TensorSpec(name="logits", shape=[3])],
    )
    torch.manual_seed(0)
    loaded = store.LoadedModel(manifest, 1, store.build(tmp_path, manifest, source).eval(), source)
    result = padding.check(loaded, calibration.random_samples(sent_inputs(manifest), 8))
    assert result is not None
    assert not result.invariant
    assert "It is given the mask 'token_type_ids', so the model ignores it" in padding.reason(result, loaded)


async def test_texts_given_as_calibration_are_tokenized_stored_and_replayed_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, root = text_bert(tmp_path / "bert"), tmp_path / "store"
    texts = tmp_path / "calib.txt"
    texts.write_text("\n".join(CORPUS[:5]) + "\n\n")
    text_args = ["--mask", "attention_mask", "--text", "text", "--calibration", str(texts)]
    assert cli.main(import_args(source, root, *text_args)) == 0
    printed = capsys.readouterr().out
    assert f"calibration: texts from {texts} (5 lines), stored as calibration.safetensors" in printed
    stored = calibration.stored(root / "bert" / "1", load_manifest(root / "bert"))
    assert stored is not None
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(source / "tokenizer.json"))
    want = [len(tokenizer(t)["input_ids"]) for t in CORPUS[:5]]
    assert stored.arrays["input_ids#length"].tolist() == want  # each text its own length, as requests are
    async with started(Settings(store=root, precision="bf16")) as client:
        entry = (await listed(client))["bert"]
        assert entry["state"] == "ready"
        assert entry["calibration"] == f"texts from {texts} (5 lines)"
        assert isinstance(entry["fidelity"], dict)
        assert entry["fidelity"]["samples"] == 5
        assert isinstance(entry["padding"], dict)
        assert entry["padding"]["calibration"] == entry["calibration"]


def test_a_text_longer_than_max_length_is_refused_unless_truncated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, root = text_bert(tmp_path / "bert"), tmp_path / "store"
    texts = tmp_path / "calib.txt"
    texts.write_text("a short text\n" + " ".join(CORPUS) + "\n")
    text_args = ["--mask", "attention_mask", "--text", "text", "--calibration", str(texts)]
    capsys.readouterr()
    assert cli.main(import_args(source, root, *text_args)) == 2
    err = capsys.readouterr().err
    # the second text, cut before tokenizing: its length is known only to pass max_length
    assert f"{texts}: text[1]: input 'input_ids': more than {MAX} tokens, longer than its max_length" in err
    assert "(or import with --truncate" in err
    assert cli.main(import_args(source, root, *text_args, "--truncate")) == 0
    manifest = load_manifest(root / "bert")
    assert manifest.inputs[0].truncate
    stored = calibration.stored(root / "bert" / "1", manifest)
    assert stored is not None
    assert stored.arrays["input_ids#length"].max() == MAX  # cut as a request would be


async def test_ragged_sequences_given_as_calibration_are_stored_and_replayed_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, root = tiny_bert(tmp_path / "bert"), tmp_path / "store"
    rows = [[2, 17, 5], [2, 40, 41, 42, 43, 44, 45, 3], [9]]
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    assert cli.main(import_args(source, root, "--mask", "attention_mask", "--calibration", str(jsonl))) == 0
    source_line = f"3 sequences from {jsonl} (lengths 1..8)"
    assert f"calibration: {source_line}, stored as" in capsys.readouterr().out
    async with started(Settings(store=root, precision="bf16")) as client:
        entry = (await listed(client))["bert"]
        assert entry["state"] == "ready"
        assert entry["calibration"] == source_line
        assert isinstance(entry["fidelity"], dict)
        assert entry["fidelity"]["samples"] == 3
    stored = calibration.stored(root / "bert" / "1", load_manifest(root / "bert"))
    assert stored is not None
    replayed = stored.rows(load_manifest(root / "bert"))
    assert replayed["input_ids#length"].tolist() == [3, 8, 1]
    assert replayed["input_ids"][1][:8].tolist() == rows[1]
    assert np.all(replayed["input_ids"][2][1:] == 0)


@pytest.mark.parametrize(
    ("id2label", "given", "want"),
    [
        ({0: "negative", 1: "neutral", 2: "positive"}, None, ["negative", "neutral", "positive"]),
        (None, None, None),  # transformers' own LABEL_0, LABEL_1, LABEL_2: not names
        ({0: "negative", 1: "neutral", 2: "positive"}, ["bad", "meh", "good"], ["bad", "meh", "good"]),
    ],
)
def test_labels_come_from_id2label_unless_given(
    tmp_path: Path, id2label: dict[int, str] | None, given: list[str] | None, want: list[str] | None
) -> None:
    config = {} if id2label is None else {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    source, root = tiny_bert(tmp_path / "bert", **config), tmp_path / "store"
    if id2label is None:
        assert json.loads((source / "config.json").read_text())["id2label"]["0"] == "LABEL_0"
    more = ["--mask", "attention_mask"]
    if given is not None:
        (tmp_path / "labels.txt").write_text("\n".join(given))
        more += ["--labels", str(tmp_path / "labels.txt")]
    assert cli.main(import_args(source, root, *more)) == 0
    assert load_manifest(root / "bert").labels == want
