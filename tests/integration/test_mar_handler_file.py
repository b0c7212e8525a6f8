"""An archive's own handler file (``halfserve import model.mar --archive-code DIR``): what is refused, with the
reason, before anything is written or copied, and a handler that raises is that request's error while the server keeps
serving. Archives are laid out here as torch-model-archiver lays them out (the archiver's own are in
tests/e2e/test_mar_handler_file.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib
import io
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

from halfserve import handlers, storage, tscompat
from halfserve import mar as mar_module
from halfserve.handlerinput import HandlerSection, HandlerStyle
from halfserve.settings import Settings
from tests.integration.conftest import serving
from tests.integration.test_mar_import import archive, import_mar, photo, tiny_net

STRICT = """
from ts.torch_handler.image_classifier import ImageClassifier


class Strict(ImageClassifier):
    def preprocess(self, data):
        if any((row.get("data") or row.get("body")) == b"reject" for row in data):
            raise ValueError("this handler takes photos only")
        return super().preprocess(data)
"""
INPUT = ("--input", "input:FP32:3x224x224")
OWN_INFERENCE = """
from ts.torch_handler.base_handler import BaseHandler


class OwnInference(BaseHandler):
    def inference(self, data):
        return self.model(data) * 2
"""


def handler_archive(tmp_path: Path, source: str, name: str) -> Path:
    files = {"handler": f"{name}.py", f"{name}.py": source.encode()}
    return archive(tmp_path / f"{name}.mar", tiny_net(), **files)  # type: ignore[arg-type]


def imports(tmp_path: Path, mar: Path, code: Path, *extra: str) -> int:
    flags = ["--trust-model-file", "--code-path", str(tmp_path / "model_code"), "--archive-code", str(code)]
    return import_mar(mar, tmp_path / "store", *flags, *extra)


async def test_a_handler_that_raises_is_that_request_s_error(tmp_path: Path) -> None:
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", code])) as client:
        r = await client.put("/predictions/tinynet", content=b"reject")  # type: ignore[attr-defined]
        assert r.status_code == 400, r.text
        assert r.json()["message"] == "handler preprocess failed: ValueError: this handler takes photos only"
        r = await client.put("/predictions/tinynet", content=b"not a photo")  # type: ignore[attr-defined]
        assert r.status_code == 400, r.text
        assert (
            r.json()["message"] == "handler preprocess failed: UnidentifiedImageError: data: not an image Pillow reads"
        )
        r = await client.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert len(r.json()) == 5  # ImageClassifier's top 5


@pytest.mark.parametrize("placement", ["instance_threads", pytest.param("instance_processes", marks=pytest.mark.slow)])
async def test_the_archive_s_vision_handler_holds_photos_to_the_server_s_pixel_setting(
    tmp_path: Path, placement: str
) -> None:
    """The photo has 400 x 300 pixels: a server held to fewer refuses it with a 413 (as its own image decoding
    does), naming the setting, wherever the handler runs (on the server's handler threads, or in the instance
    process)."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    paths = [tmp_path / "model_code", code]
    held = Settings(store=store, code_path=paths, max_image_pixels=119_999, placement=placement)  # type: ignore[arg-type]
    async with serving(held) as client:
        r = await client.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 413, r.text
        assert r.json()["message"] == (
            "handler preprocess failed: ImageTooLargeError: data: a 400x300 JPEG image, more than the 119999 pixels "
            "an image may have (max_image_pixels)"
        )
    enough = Settings(store=store, code_path=paths, max_image_pixels=120_000, placement=placement)  # type: ignore[arg-type]
    async with serving(enough) as client:
        r = await client.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text


async def test_a_photo_over_the_pixel_limit_fails_alone_in_its_handler_batch(tmp_path: Path) -> None:
    """A 400x300 photo and a 200x150 one in one handler batch of a server held to 119,999 pixels: the batch's 413 is
    rerun one request per call, so only the large photo's request gets it."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    manifest_file = store / "tinynet" / storage.MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["batching"] = {"max_batch_size": 2, "max_delay_ms": 5000.0}  # cut when both are queued
    manifest_file.write_text(json.dumps(manifest))
    small = io.BytesIO()
    Image.open(io.BytesIO(photo("JPEG"))).resize((200, 150)).save(small, "JPEG")
    held = Settings(store=store, code_path=[tmp_path / "model_code", code], max_image_pixels=119_999)
    async with serving(held) as client:
        big, alone = await asyncio.gather(
            client.put("/predictions/tinynet", content=photo("JPEG")),  # type: ignore[attr-defined]
            client.put("/predictions/tinynet", content=small.getvalue()),  # type: ignore[attr-defined]
        )
    assert big.status_code == 413, big.text
    assert big.json()["type"] == "RequestTooLargeException"
    assert alone.status_code == 200, alone.text


async def test_payloads_past_the_handler_queue_s_bytes_are_refused_before_the_handler_runs(tmp_path: Path) -> None:
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    held = Settings(store=store, code_path=[tmp_path / "model_code", code], handler_queue_bytes=2**20)
    async with serving(held) as client:
        r = await client.put("/predictions/tinynet", content=b"reject" + bytes(2**20))  # type: ignore[attr-defined]
        assert r.status_code == 413, r.text
        assert r.json()["message"] == (
            "inputs: request has 1048582 bytes of payloads; the handler queue holds at most 1048576 "
            "(handler_queue_bytes)"
        )
        r = await client.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text


async def test_an_empty_form_part_is_refused_naming_it_before_the_handler_runs(tmp_path: Path) -> None:
    """TorchServe's handlers read ``row.get("data") or row.get("body")``: an empty part reached them as None and
    failed with a TypeError."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", code])) as client:
        files = [("data", ("a.jpg", photo("JPEG"), "image/jpeg")), ("data", ("b.jpg", b"", "image/jpeg"))]
        r = await client.post("/predictions/tinynet", files=files)  # type: ignore[attr-defined]
        assert r.status_code == 400, r.text
        assert r.json()["message"] == "form.data[1]: empty; send the bytes the model's handler reads"
        r = await client.post("/predictions/tinynet", files=files[:1])  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text


async def test_a_photo_sent_to_predict_is_pointed_to_the_route_that_runs_the_handler(tmp_path: Path) -> None:
    """``/predict`` feeds tensors, not the handler: a photo there had read "takes no images: its manifest has no image
    section (halfserve import --image)", of a model that reads photos."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", code])) as client:
        sent = {"inputs": [{"b64": base64.b64encode(photo("JPEG")).decode()}]}
        r = await client.post("/predict", json=sent)  # type: ignore[attr-defined]
        assert r.status_code == 400, r.text
        assert r.json()["error"] == (
            "inputs[0].b64: model 'tinynet' reads photos through its handler: send them to /predictions/tinynet (the "
            "raw body, or form fields named data or body)"
        )
        tensor = {"instances": [[[[0.0] * 224] * 224] * 3]}  # fed to the model, as /predict and V2 feed it
        r = await client.post("/v1/models/tinynet:predict", json=tensor)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        r = await client.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text


async def test_kserve_v1_instances_of_torchserve_s_envelope_are_answered_by_the_handler(tmp_path: Path) -> None:
    """KServe's TorchServe predictor sends photos as ``{"instances": [{"data": "<base64>"}]}``: each instance goes to
    the handler as TorchServe hands it (the text, which its ``VisionHandler`` base64-decodes), answered as
    ``/predictions`` answers it, one prediction per instance in order; a bad one is that request's 400."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 0
    jpeg, png = photo("JPEG"), photo("PNG")
    instances = [{"data": base64.b64encode(jpeg).decode()}, {"body": base64.b64encode(png).decode()}]
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", code])) as client:
        form = await client.post("/predictions/tinynet", files=[("data", jpeg), ("data", png)])  # type: ignore[attr-defined]
        assert form.status_code == 200, form.text
        r = await client.post("/v1/models/tinynet:predict", json={"instances": instances})  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert r.json() == {"predictions": form.json()}
        broken = await client.post("/v1/models/tinynet:predict", json={"instances": [instances[0], {"data": "x"}]})  # type: ignore[attr-defined]
        assert broken.status_code == 400, broken.text
        assert broken.json()["error"] == (
            "handler preprocess failed: ValueError: data: not base64 (Invalid base64-encoded string: number of data "
            "characters (1) cannot be 1 more than a multiple of 4)"
        )
        columns = await client.post("/v1/models/tinynet:predict", json={"inputs": instances})  # type: ignore[attr-defined]
        assert columns.status_code == 400, columns.text
        assert columns.json()["error"] == (
            'inputs[0]: TorchServe\'s KServe envelope is sent as instances: {"instances": [{"data": ...}]}, each '
            "instance one request to the handler of model 'tinynet'"
        )
        empty = await client.post("/v1/models/tinynet:predict", json={"instances": [instances[0], {"body": ""}]})  # type: ignore[attr-defined]
        assert (empty.status_code, empty.json()) == (
            400,
            {"error": "instances[1].body: empty; send the bytes the model's handler reads"},
        )
        many = await client.post("/v1/models/tinynet:predict", json={"instances": instances[:1] * 17})  # type: ignore[attr-defined]
        assert (many.status_code, many.json()) == (
            413,
            {"error": "instances: 17 images, more than the 16 one request may carry (max_request_images)"},
        )
        again = await client.post("/v1/models/tinynet:predict", json={"instances": instances[:1]})  # type: ignore[attr-defined]
        assert again.status_code == 200, again.text
        assert again.json() == {"predictions": form.json()[:1]}


def test_a_handler_overriding_inference_is_refused_at_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert imports(tmp_path, handler_archive(tmp_path, OWN_INFERENCE, "own_inference"), tmp_path / "code", *INPUT) == 2
    err = capsys.readouterr().err
    assert "OwnInference overrides inference, which is not called here: the server runs the forward" in err
    assert not (tmp_path / "store" / "tinynet").exists()


def test_the_handler_file_is_not_run_without_the_flag_nor_copied_into_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mar, store = handler_archive(tmp_path, STRICT, "strict_handler"), tmp_path / "store"
    assert import_mar(mar, store, "--trust-model-file", "--code-path", str(tmp_path / "model_code")) == 2
    assert "import with --archive-code DIR" in capsys.readouterr().err
    assert imports(tmp_path, mar, store / "code") == 2
    assert "lies inside the store" in capsys.readouterr().err
    assert not (store / "code").exists()
    assert not (store / "tinynet").exists()
    stock = archive(tmp_path / "stock.mar", tiny_net())
    assert imports(tmp_path, stock, tmp_path / "code") == 2
    assert "the archive's handler is the stock 'image_classifier', not a file" in capsys.readouterr().err


def test_a_different_file_of_the_same_name_in_the_folder_is_kept_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "model.py").write_text("# the operator's own\n")
    assert imports(tmp_path, handler_archive(tmp_path, STRICT, "strict_handler"), code) == 2
    assert "exists and differs from the archive's model.py" in capsys.readouterr().err
    assert (code / "model.py").read_text() == "# the operator's own\n"
    assert [p.name for p in code.iterdir()] == ["model.py"]  # nothing copied where one file is refused


@pytest.mark.parametrize(
    ("file", "stem"), [("my-handler.py", "my_handler"), ("1handler.py", "_1handler"), ("a.b.py", "a_b")]
)
def test_a_handler_file_named_as_no_module_is_copied_as_one(tmp_path: Path, file: str, stem: str) -> None:
    """TorchServe imports such a file by its name; its copy gets a module name (the import builds the handler from
    it, so it imports), made of the stem's letters, digits and underscores and the file's digest."""
    mar = archive(tmp_path / "h.mar", tiny_net(), handler=file, **{file: STRICT.encode()})
    assert imports(tmp_path, mar, tmp_path / "code") == 0
    module = f"{stem}_{hashlib.sha256(STRICT.encode()).hexdigest()[:8]}"
    manifest = json.loads((tmp_path / "store" / "tinynet" / "config.json").read_text())
    assert manifest["handler"]["code"] == f"{module}:Strict"
    assert (tmp_path / "code" / f"{module}.py").read_text() == STRICT


async def test_a_handler_file_with_a_hyphen_serves(tmp_path: Path) -> None:
    mar = archive(tmp_path / "h.mar", tiny_net(), handler="my-handler.py", **{"my-handler.py": STRICT.encode()})
    assert imports(tmp_path, mar, tmp_path / "code") == 0
    async with serving(Settings(store=tmp_path / "store", code_path=[tmp_path / "model_code", tmp_path / "code"])) as c:
        r = await c.put("/predictions/tinynet", content=photo("JPEG"))  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        assert len(r.json()) == 5  # ImageClassifier's top 5


def which(letter: str) -> str:
    return f"""
from ts.torch_handler.image_classifier import ImageClassifier


class Which(ImageClassifier):
    def postprocess(self, data):
        return [{{"which": "{letter}"}} for _ in range(len(data))]
"""


async def test_two_archives_handler_py_files_are_two_modules(tmp_path: Path) -> None:
    """TorchServe archives mostly ship ``handler.py``: each is copied under its own module name (its stem and its
    digest), so the second model served runs its own code, not the first's, which a module name shared in the
    process would give it."""
    store, codes = tmp_path / "store", [tmp_path / "code_a", tmp_path / "code_b"]
    for letter, code in zip("ab", codes, strict=True):
        files = {"handler": "handler.py", "handler.py": which(letter).encode()}
        mar = archive(tmp_path / f"{letter}.mar", tiny_net(), model_name=f"net_{letter}", **files)  # type: ignore[arg-type]
        assert imports(tmp_path, mar, code) == 0
    modules = [next(code.glob("handler_*.py")).stem for code in codes]
    assert modules[0] != modules[1]
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", *codes])) as client:
        for letter in "ab":
            r = await client.put(f"/predictions/net_{letter}", content=photo("JPEG"))  # type: ignore[attr-defined]
            assert r.status_code == 200, r.text
            assert r.json() == {"which": letter}


def test_a_real_ts_package_installed_refuses_the_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its BaseHandler.initialize would load the model itself: the handler is refused, naming why. A folder named
    ts that is no package (a namespace package) is not one: the compatibility package goes before it."""
    (tmp_path / "folder" / "ts").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "folder"))
    monkeypatch.delitem(sys.modules, "ts", raising=False)
    with tscompat.shadowing():
        assert Path(importlib.import_module("ts").__file__ or "").parent == tscompat.HERE / "ts"
    monkeypatch.delitem(sys.modules, "ts")
    real = tmp_path / "site" / "ts"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    section = HandlerSection(code="anything:Handler", style=HandlerStyle.TORCHSERVE)
    with pytest.raises(handlers.HandlerLoadError, match="TorchServe's own ts package is installed"):
        handlers.build(section)


def test_python_past_the_bound_or_a_copy_escaping_the_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    mar, code = handler_archive(tmp_path, STRICT, "strict_handler"), tmp_path / "code"
    code.mkdir()
    (tmp_path / "elsewhere.py").write_text("# not the code folder's\n")
    (code / "model.py").symlink_to(tmp_path / "elsewhere.py")  # a copy through it would land outside the folder
    assert imports(tmp_path, mar, code) == 2
    assert "model.py would land outside it" in capsys.readouterr().err
    assert (tmp_path / "elsewhere.py").read_text() == "# not the code folder's\n"
    (code / "model.py").unlink()
    monkeypatch.setattr(mar_module, "MAX_CODE_BYTES", 100)  # the archive's two files hold more
    assert imports(tmp_path, mar, code) == 2
    assert "more than the 100 allowed" in capsys.readouterr().err
    assert list(code.iterdir()) == []


STATEFUL = """
import time

import torch
from ts.torch_handler.base_handler import BaseHandler


class Stateful(BaseHandler):
    def preprocess(self, data):
        self.keys = [(row.get("data") or row.get("body")).decode() for row in data]
        time.sleep(0.02)  # another batch's preprocess would overwrite self.keys here
        return torch.zeros(len(data), 3, 224, 224)

    def postprocess(self, data):
        time.sleep(0.02)
        return [{"key": key} for key in self.keys]
"""


async def test_a_torchserve_handler_keeps_its_batch_state_on_itself(tmp_path: Path) -> None:
    """TorchServe ran one batch at a time per handler, so its handlers keep a batch's state on ``self`` from
    preprocess to postprocess: concurrent requests each get their own answer back, never another batch's."""
    code, store = tmp_path / "code", tmp_path / "store"
    assert imports(tmp_path, handler_archive(tmp_path, STATEFUL, "stateful_handler"), code, *INPUT) == 0
    async with serving(Settings(store=store, code_path=[tmp_path / "model_code", code])) as client:

        async def one(i: int) -> tuple[str, object]:
            key = f"request-{i}"
            r = await client.put("/predictions/tinynet", content=key.encode())  # type: ignore[attr-defined]
            assert r.status_code == 200, r.text
            return key, r.json()

        for _ in range(3):
            for key, answer in await asyncio.gather(*(one(i) for i in range(12))):
                assert answer == {"key": key}
