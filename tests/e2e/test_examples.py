"""The examples in ``examples/``, each served by a real ``halfserve serve`` and asked as the README shows."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from sklearn.datasets import load_digits
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, StartServer

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def simple_server(server_factory: StartServer) -> ServerProcess:
    """Triton's simple model from its own file, as the README runs it."""
    folder = EXAMPLES / "simple"
    return server_factory(folder / "model_store", "--code-path", str(folder))


@pytest.fixture
def simple_client(simple_server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=simple_server.url.removeprefix("http://"))
    try:
        yield client
    finally:
        client.close()


def test_simple_answers_tritonclient_with_mixed_json_and_binary_tensors(
    simple_client: triton.InferenceServerClient,
) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**30), 2**30, (2, 16), dtype=np.int32)
    b = rng.integers(-(2**20), 2**20, (2, 16), dtype=np.int32)
    inputs = [triton.InferInput("INPUT0", [2, 16], "INT32"), triton.InferInput("INPUT1", [2, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(b, binary_data=True)
    outputs = [
        triton.InferRequestedOutput("OUTPUT0", binary_data=True),
        triton.InferRequestedOutput("OUTPUT1", binary_data=False),
    ]
    result = simple_client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    kinds = {
        o["name"]: ("binary" if "binary_data_size" in o.get("parameters", {}) else "json") for o in response["outputs"]
    }
    assert kinds == {"OUTPUT0": "binary", "OUTPUT1": "json"}

    meta = simple_client.get_model_metadata("simple")
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("INPUT0", "INT32", [-1, 16]),
        ("INPUT1", "INT32", [-1, 16]),
    ]
    assert [t["name"] for t in meta["outputs"]] == ["OUTPUT0", "OUTPUT1"]


def test_simple_refuses_a_request_missing_an_input(simple_client: triton.InferenceServerClient) -> None:
    only = triton.InferInput("INPUT0", [1, 16], "INT32")
    only.set_data_from_numpy(np.ones((1, 16), np.int32))
    with pytest.raises(InferenceServerException, match=r"missing required input\(s\) \['INPUT1'\]"):
        simple_client.infer("simple", [only])


def run(*args: str) -> str:
    """A command of the README's, run as written (``halfserve`` as ``python -m halfserve``)."""
    cmd = [sys.executable, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def listing(server: ServerProcess, name: str) -> dict[str, object]:
    body = httpx.get(f"{server.url}/models").json()
    entries = body["models"] if isinstance(body, dict) else body
    return next(e for e in entries if e["name"] == name)


def test_a_users_own_model_file_trains_imports_and_serves(server_factory: StartServer, tmp_path: Path) -> None:
    out, store_dir = tmp_path / "own", tmp_path / "store"
    run(str(EXAMPLES / "own_model" / "train.py"), str(out))
    printed = run(
        "-m", "halfserve", "import", str(out / "weights.pth"), "--store", str(store_dir), "--name", "digits_net",
        "--architecture", "digits_net:build", "--code-path", str(EXAMPLES / "own_model"),
        "--input", "pixels:FP32:64", "--labels", str(out / "labels.txt"),
        "--calibration", str(out / "calibration.npy"),
    )  # fmt: skip
    assert "vs fp32 on 200 calibration samples: top-1 agreement" in printed
    assert "fidelity bar (top-1 agreement >= 0.98" in printed
    assert "met, so the server serves it in" in printed
    digits = load_digits()
    x, y = digits.data[1500:1564].astype(np.float32), digits.target[1500:1564]
    code = ("--code-path", str(EXAMPLES / "own_model"))
    half = server_factory(store_dir, *code, "--precision", "bf16")
    r = httpx.post(f"{half.url}/predict", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    assert r.json()["precision"] == "bf16"
    assert np.mean(np.array(r.json()["labels"]).astype(int) == y) > 0.8
    entry = listing(half, "digits_net")
    assert entry["fidelity"]["samples"] == 200
    assert entry["fidelity"]["top1_agreement"] >= 0.98
    assert entry["fidelity"]["source"] == "calibration"
    assert entry["fp32_fallback"] is None
    fp32 = server_factory(store_dir, *code, "--precision", "fp32")  # the fallback switch
    r32 = httpx.post(f"{fp32.url}/predict", json={"inputs": x.tolist()})
    assert r32.json()["precision"] == "fp32"
    assert listing(fp32, "digits_net")["fidelity"] is None  # nothing half to measure


def test_a_hugging_face_classifier_imports_and_serves_in_half_precision(
    server_factory: StartServer, tmp_path: Path
) -> None:
    folder, store_dir = tmp_path / "tiny_bert", tmp_path / "store"
    run(str(EXAMPLES / "hf_classifier" / "make_model.py"), str(folder))
    printed = run(
        "-m", "halfserve", "import", str(folder), "--store", str(store_dir), "--name", "tiny_bert",
        "--architecture", "transformers:AutoModelForSequenceClassification", "--input", "input_ids:INT64:16",
    )  # fmt: skip
    assert "outputs logits FP32 [3]" in printed
    assert "vs fp32 on 64 random samples: top-1 agreement" in printed
    ids = np.random.default_rng(0).integers(0, 1000, (3, 16))
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [3, 16], "data": ids.ravel().tolist()}]}
    answers = {}
    for precision in ("bf16", "fp32"):
        server = server_factory(store_dir, "--precision", precision)
        r = httpx.post(f"{server.url}/v2/models/tiny_bert/infer", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["parameters"]["precision"] == precision
        (out,) = r.json()["outputs"]
        assert (out["name"], out["shape"]) == ("logits", [3, 3])
        answers[precision] = np.array(out["data"]).reshape(3, 3)
        entry = listing(server, "tiny_bert")
        assert entry["weight_dtype"] == ("bfloat16" if precision == "bf16" else "float32")
        if precision == "bf16":
            assert entry["fidelity"]["top1_agreement"] is not None
    np.testing.assert_allclose(answers["bf16"], answers["fp32"], atol=0.05)


def test_a_torchvision_resnet18_state_dict_imports_and_serves(server_factory: StartServer, tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # PyPI's wheel links CUDA torch's libraries: it does not import with a CPU-only torch
        pytest.skip(f"torchvision does not import here ({type(e).__name__}: {e})")
    out, store_dir = tmp_path / "rn18", tmp_path / "store"
    run(str(EXAMPLES / "torchvision_resnet18" / "save_state_dict.py"), str(out))
    run(
        "-m", "halfserve", "import", str(out / "resnet18.pth"), "--store", str(store_dir), "--name", "resnet18",
        "--architecture", "torchvision:resnet18", "--arch-kwargs", '{"num_classes": 10}',
        "--input", "image:FP32:3x64x64", "--samples", "16",
    )  # fmt: skip
    server = server_factory(store_dir)
    image = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    r = httpx.post(f"{server.url}/predict", json={"inputs": image.tolist()})
    assert r.status_code == 200, r.text
    assert np.array(r.json()["outputs"]).shape == (2, 10)
    assert listing(server, "resnet18")["fidelity"]["samples"] == 16


def test_several_and_variable_inputs_cross_the_front_end_processes(server_factory: StartServer, tmp_path: Path) -> None:
    """With --http-workers the front-ends decode requests and hand named tensors to the engine process: several
    inputs, and sequences whose mask the engine builds, get the answers a single process gives."""
    store_dir = tmp_path / "store"
    shutil.copytree(EXAMPLES.parent / "model_store" / "digits_transformer", store_dir / "digits_transformer")
    shutil.copytree(EXAMPLES / "simple" / "model_store" / "simple", store_dir / "simple")
    code = ("--code-path", str(EXAMPLES / "simple"), "--precision", "fp32")
    single = server_factory(store_dir, *code)
    workers = server_factory(store_dir, *code, "--http-workers", "2")
    digits = load_digits()
    sequences = [(digits.data[i].astype(int) + 1)[: 48 + 8 * (i % 3)].tolist() for i in range(6)]
    pair = {"INPUT0": [list(range(16))], "INPUT1": [[3] * 16]}
    for name, inputs in [("simple", pair), *[("digits_transformer", [s]) for s in sequences]]:
        answers = [httpx.post(f"{s.url}/predict", json={"model": name, "inputs": inputs}) for s in (single, workers)]
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        assert answers[0].json()["outputs"] == answers[1].json()["outputs"]


def test_texts_over_tritonclient_bytes_in_one_process_and_through_front_ends(
    server_factory: StartServer, tmp_path: Path
) -> None:
    from tests.integration.test_text import TEXTS, save_texty

    store_dir = save_texty(tmp_path / "store")
    answers = []
    for extra in ((), ("--http-workers", "2")):
        server = server_factory(store_dir, "--precision", "fp32", *extra)
        client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
        try:
            for binary in (False, True):
                text = triton.InferInput("text", [len(TEXTS), 1], "BYTES")
                text.set_data_from_numpy(np.array([[t.encode()] for t in TEXTS], dtype=object), binary_data=binary)
                result = client.infer("texty", [text])
                answers.append(result.as_numpy("logits"))
            bad = triton.InferInput("text", [1, 1], "BYTES")
            bad.set_data_from_numpy(np.array([[b"caf\xe9"]], dtype=object), binary_data=True)
            with pytest.raises(InferenceServerException, match="not UTF-8"):
                client.infer("texty", [bad])
        finally:
            client.close()
    assert answers[0].shape == (2, 3)
    for other in answers[1:]:
        np.testing.assert_allclose(other, answers[0], rtol=1e-5, atol=1e-6)


def report(printed: str) -> list[str]:
    """An import's report as lines, its figures and folders left out (they differ between runs and machines)."""
    lines = printed[printed.index("imported ") :].splitlines()
    return [re.sub(r"\S*/", "", re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)).rstrip() for line in lines if line]


def documented_import(first_line: str) -> str:
    """The import report docs/model-store.md shows, from its line beginning with ``first_line``."""
    page = (EXAMPLES.parent / "docs" / "model-store.md").read_text()
    start = page.index(first_line)
    return page[start : page.index("```", start)]


def test_a_hugging_face_text_classifier_with_its_tokenizer_takes_text(
    server_factory: StartServer, tmp_path: Path
) -> None:
    folder, store_dir = tmp_path / "model", tmp_path / "store"
    run(str(EXAMPLES / "hf_text_classifier" / "make_model.py"), str(folder))
    labels = tmp_path / "labels.txt"
    labels.write_text("negative\nneutral\npositive\n")
    printed = run(
        "-m", "halfserve", "import", str(folder), "--store", str(store_dir), "--name", "reviews",
        "--architecture", "transformers:AutoModelForSequenceClassification",
        "--input", "input_ids:INT64:-1", "--max-length", "64", "--mask", "attention_mask", "--text", "text",
        "--labels", str(labels), "--calibration", str(EXAMPLES / "hf_text_classifier" / "corpus.txt"),
    )  # fmt: skip
    assert "inputs  input_ids INT64 [-1], attention_mask INT64 [-1]" in printed
    assert "calibration: texts from" in printed
    assert "corpus.txt (14 lines)" in printed
    assert report(printed) == report(documented_import("imported reviews v1")), "docs/model-store.md is stale"
    texts = ["This review is positive: fast and cheap.", "A short reply."]
    answers = {}
    for precision in ("bf16", "fp32"):
        server = server_factory(store_dir, "--precision", precision)
        together = httpx.post(f"{server.url}/predict", json={"inputs": texts}).json()
        assert together["precision"] == precision
        assert set(together["labels"]) <= {"negative", "neutral", "positive"}
        alone = [httpx.post(f"{server.url}/predict", json={"inputs": [t]}).json()["outputs"][0] for t in texts]
        np.testing.assert_allclose(together["outputs"], alone, atol=1e-5 if precision == "fp32" else 0.02)
        answers[precision] = np.array(together["outputs"])
        too_long = httpx.post(f"{server.url}/predict", json={"inputs": [" ".join(["review"] * 80)]})
        assert too_long.status_code == 400
        assert "longer than its max_length 64" in too_long.json()["error"]
    np.testing.assert_allclose(answers["bf16"], answers["fp32"], atol=0.05)
