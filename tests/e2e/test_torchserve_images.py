"""TorchServe's inference API on a real server: photos of load_digits rows (PNG and JPEG, upscaled so the resize
matters) sent as a raw body, with ``PUT`` as ``curl -T`` sends them and as form fields, answered with the labels the
same rows get as tensors; every abusive input refused with a 4xx naming the problem while good requests go on being
answered; and the same through ``--http-workers`` front-ends."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from halfserve import cli
from tests.conftest import DIGITS_CNN_IMPORT, DIGITS_PHOTO, SHIPPED_STORE, ServerProcess

pytestmark = pytest.mark.slow

StartServer = Callable[..., ServerProcess]
MODEL = "photo"
UNLABELLED = "photo_unlabelled"
ROWS = 48
UPSCALE = 4
TIMEOUT = httpx.Timeout(120.0)
LABELS = [f"digit {i}" for i in range(10)]


def pixels() -> np.ndarray:
    """The first rows of load_digits as 8-bit grey images: each value 0..16 scaled to 0..255."""
    x = load_digits().data[:ROWS].reshape(ROWS, 8, 8)
    return np.rint(x * 255 / 16).astype(np.uint8)


def photo(image: np.ndarray, fmt: str, **options: object) -> bytes:
    """One row as a photo of 32x32 (each pixel a 4x4 block)."""
    big = np.kron(image, np.ones((UPSCALE, UPSCALE), dtype=np.uint8))
    buf = io.BytesIO()
    Image.fromarray(big).save(buf, format=fmt, **options)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def grey_png(width: int, height: int, rows: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", rows) + png_chunk(b"IEND", b"")


def bomb() -> bytes:
    """A real PNG of 6000x6000 black pixels (36 million, past the default 25 million): about 35 KB on the wire."""
    rows = zlib.compress(b"\x00" * (6000 + 1) * 6000, 9)
    return grey_png(6000, 6000, rows)


def many_scans(count: int) -> bytes:
    """A real progressive JPEG whose last scan is repeated until it has ``count`` scans: a few KB that would hold a
    decoding thread for seconds."""
    noise = np.random.default_rng(1).integers(0, 256, (8, 8), dtype=np.uint8)
    data = photo(noise, "JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * (count - data.count(b"\xff\xda")) + data[-2:]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_cnn's weights imported with an image section (grey, exactly 8x8, nearest, each pixel / 255: the
    digits' 0..1 as the model was trained on), TorchServe's index_to_name.json for labels; and digits_mlp as shipped,
    which takes no images."""
    root = tmp_path_factory.mktemp("photo-store")
    labels = root.parent / "index_to_name.json"
    labels.write_text(json.dumps({str(i): [f"n{i:08d}", name] for i, name in enumerate(LABELS)}))
    image = [*DIGITS_PHOTO, "--image-interpolation", "nearest"]
    rest = ["--samples", "8", "--store", str(root)]
    assert cli.main([*DIGITS_CNN_IMPORT, "--name", MODEL, *image, "--labels", str(labels), *rest]) == 0
    assert cli.main([*DIGITS_CNN_IMPORT, "--name", UNLABELLED, *image, *rest]) == 0
    shutil.copytree(SHIPPED_STORE / "digits_mlp", root / "digits_mlp")
    return root


@pytest.fixture(scope="module")
def server(server_factory: StartServer, store: Path) -> ServerProcess:
    return server_factory(store, "--max-body-bytes", str(2**20))


def tensor_labels(url: str, images: np.ndarray) -> list[str]:
    """The top label of each row sent as the pixel values the image section makes of it, through ``/predict``."""
    values = (images.astype(np.float32) * np.float32(1 / 255))[:, None].tolist()
    r = httpx.post(f"{url}/predict", json={"model": MODEL, "inputs": values}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    labels: list[str] = r.json()["labels"]
    return labels


def top(answer: dict[str, float]) -> str:
    assert list(answer.values()) == sorted(answer.values(), reverse=True)
    assert len(answer) == 5
    assert 0 < sum(answer.values()) <= 1 + 1e-9
    return next(iter(answer))


def form(files: list[bytes], field: str = "data") -> list[tuple[str, tuple[str, bytes, str]]]:
    return [(field, (f"{i}.png", data, "image/png")) for i, data in enumerate(files)]


def test_a_png_as_the_body_gets_the_label_its_pixels_get_as_a_tensor(server: ServerProcess) -> None:
    images = pixels()
    want = [tensor_labels(server.url, images[i : i + 1])[0] for i in range(ROWS)]
    got = []
    for i in range(ROWS):
        # As curl -T sends a file: PUT, no Content-Type.
        r = httpx.put(f"{server.url}/predictions/{MODEL}", content=photo(images[i], "PNG"), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        got.append(top(r.json()))
    assert got == want
    assert set(got) <= set(LABELS)
    # The rows' real digits, as a sanity check of the pixels' scale (digits_cnn scores 99% on the test split).
    truth = [LABELS[d] for d in load_digits().target[:ROWS]]
    assert sum(g == t for g, t in zip(got, truth, strict=True)) >= 0.9 * ROWS


def test_form_fields_are_a_batch_answered_one_per_image(server: ServerProcess) -> None:
    images = pixels()[:16]
    want = tensor_labels(server.url, images)
    r = httpx.post(
        f"{server.url}/predictions/{MODEL}/1", files=form([photo(x, "PNG") for x in images]), timeout=TIMEOUT
    )
    assert r.status_code == 200, r.text
    assert [top(a) for a in r.json()] == want
    one = httpx.post(f"{server.url}/predictions/{MODEL}", files=form([photo(images[0], "PNG")], "body"))
    assert top(one.json()) == want[0]  # one image: the answer itself, not a list of one


def test_kserve_s_torchserve_envelope_is_answered_as_predictions_answers(server: ServerProcess) -> None:
    """KServe's TorchServe predictor sends an image_classifier archive's photos as ``{"instances": [{"data": b64}]}``
    and answers what the handler answers: each photo's top five classes, as ``/predictions`` gives them (the raw
    logits had come back); ``{"b64": ...}`` instances, KServe V1's own photos, still get the output."""
    images = pixels()[:4]
    files = [photo(x, "PNG") for x in images]
    predictions = httpx.post(f"{server.url}/predictions/{MODEL}", files=form(files), timeout=TIMEOUT)
    encoded = [base64.b64encode(f).decode() for f in files]
    url = f"{server.url}/v1/models/{MODEL}:predict"
    enveloped = httpx.post(url, json={"instances": [{"data": e} for e in encoded]}, timeout=TIMEOUT)
    b64 = httpx.post(url, json={"instances": [{"b64": e} for e in encoded]}, timeout=TIMEOUT)
    assert enveloped.status_code == 200, enveloped.text
    assert enveloped.json() == {"predictions": predictions.json()}
    assert [top(a) for a in enveloped.json()["predictions"]] == tensor_labels(server.url, images)
    assert b64.status_code == 200, b64.text
    assert [len(row) for row in b64.json()["predictions"]] == [len(LABELS)] * len(images)


def test_jpegs_get_the_tensors_labels_for_most_rows(server: ServerProcess) -> None:
    images = pixels()
    want = tensor_labels(server.url, images[:16]) + tensor_labels(server.url, images[16:32])
    got = []
    for chunk in (images[:16], images[16:32]):
        files = [("data", (f"{i}.jpg", photo(x, "JPEG", quality=90), "image/jpeg")) for i, x in enumerate(chunk)]
        r = httpx.post(f"{server.url}/predictions/{MODEL}", files=files, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        got += [top(a) for a in r.json()]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 0.9 * len(want)


def test_a_model_without_labels_answers_its_output_and_ping_is_healthy(server: ServerProcess) -> None:
    images = pixels()[:3]
    values = (images.astype(np.float32) * np.float32(1 / 255))[:, None].tolist()
    r = httpx.post(f"{server.url}/predict", json={"model": UNLABELLED, "inputs": values}, timeout=TIMEOUT)
    want = r.json()["outputs"]
    r = httpx.post(f"{server.url}/predictions/{UNLABELLED}", files=form([photo(x, "PNG") for x in images]))
    assert r.status_code == 200, r.text
    assert r.json() == want  # the same rows in a batch of the same size: the same numbers
    r = httpx.get(f"{server.url}/ping")
    assert (r.status_code, r.json()) == (200, {"status": "Healthy"})
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f'model="{UNLABELLED}"' in metrics
    assert 'protocol="torchserve"' in metrics


GOOD = photo(pixels()[0], "PNG")


def abusive() -> list[tuple[str, dict[str, object], int, str]]:
    """Requests to refuse: (path, httpx arguments, status, what the message says)."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64), dtype=np.uint8)
    jpeg = photo(noise, "JPEG")

    def encoded(fmt: str) -> bytes:
        buf = io.BytesIO()
        Image.new("L", (32, 32)).save(buf, format=fmt)
        return buf.getvalue()

    path = f"/predictions/{MODEL}"
    return [
        (
            path,
            {"content": grey_png(60000, 60000, zlib.compress(b"\x00" * 60001))},
            413,
            "a PNG image of 3600000000 pixels, more than the",
        ),
        (path, {"content": grey_png(9000, 9000, zlib.compress(b"\x00" * 9001))}, 413, "9000x9000 PNG image"),
        (path, {"content": bomb()}, 413, "6000x6000 PNG image, more than the 25000000 pixels"),
        (path, {"content": jpeg[: len(jpeg) // 2]}, 400, "body: cannot decode the JPEG image"),
        (path, {"content": many_scans(2000)}, 400, "body: a JPEG of 2000 scans"),
        (path, {"content": b"\x00garbage" * 100}, 400, "body: not an image the server reads"),
        (path, {"content": encoded("GIF")}, 400, "body: a GIF image; the server takes JPEG, PNG, WEBP"),
        (path, {"content": encoded("TIFF")}, 400, "body: a TIFF image"),
        (path, {"content": b'<svg xmlns="http://www.w3.org/2000/svg"/>'}, 400, "body: a SVG image"),
        (path, {"content": b""}, 400, "body: no image"),
        (path, {"content": b"\xff\xd8\xff" + b"\x00" * (2**20)}, 413, "max_body_bytes"),
        (path, {"files": form([GOOD] * 17)}, 413, "more than 16 fields in one request (max_request_images)"),
        (path, {"files": form([GOOD], "file")}, 400, "form.file: images go in fields named data or body"),
        (path, {"files": form([GOOD, encoded("GIF")])}, 400, "form.data[1]: a GIF image"),
        (
            path,
            {"content": b"--x\r\nno headers end", "headers": {"Content-Type": "multipart/form-data; boundary=x"}},
            400,
            "body: form part 0: no closing boundary",
        ),
        ("/predictions/digits_mlp", {"content": GOOD}, 400, "model 'digits_mlp' takes no images"),
        ("/predictions/nosuch", {"content": GOOD}, 404, "nosuch"),
        (f"/predictions/{MODEL}/9", {"content": GOOD}, 404, "version 9"),
    ]


def test_abusive_inputs_are_refused_while_good_requests_are_answered(server: ServerProcess) -> None:
    cases = abusive()

    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            bad = [client.post(path, **kwargs) for path, kwargs, _, _ in cases]  # type: ignore[arg-type]
            good = [client.post(f"/predictions/{MODEL}", content=GOOD) for _ in range(8)]
            answers = await asyncio.gather(*bad, *good)
            return list(answers[: len(bad)]), list(answers[len(bad) :])

    refused, answered = asyncio.run(run())
    for (path, _, status, message), r in zip(cases, refused, strict=True):
        assert r.status_code == status, (path, message, r.text)
        body = r.json()
        assert message in body["message"], (message, body)
        assert body["code"] == status
        assert body["error"] == body["message"]
        assert body["type"].endswith("Exception")
    assert {r.status_code for r in answered} == {200}
    assert len({top(r.json()) for r in answered}) == 1
    assert httpx.put(f"{server.url}/predictions/{MODEL}", content=GOOD, timeout=TIMEOUT).status_code == 200


def test_front_ends_answer_photos_as_the_engine_process_does(
    server_factory: StartServer, server: ServerProcess, store: Path
) -> None:
    workers = server_factory(store, "--http-workers", "2")
    images = pixels()[:16]
    files = form([photo(x, "PNG") for x in images])
    single = httpx.post(f"{server.url}/predictions/{MODEL}", files=files, timeout=TIMEOUT)
    fronted = httpx.post(f"{workers.url}/predictions/{MODEL}", files=files, timeout=TIMEOUT)
    assert fronted.status_code == 200, fronted.text
    assert [top(a) for a in fronted.json()] == [top(a) for a in single.json()]
    put = httpx.put(f"{workers.url}/predictions/{MODEL}", content=photo(images[0], "PNG"), timeout=TIMEOUT)
    assert top(put.json()) == top(single.json()[0])
    gif = io.BytesIO()
    Image.new("L", (4, 4)).save(gif, format="GIF")
    refused = httpx.post(f"{workers.url}/predictions/{MODEL}", content=gif.getvalue(), timeout=TIMEOUT)
    assert (refused.status_code, refused.json()["type"]) == (400, "BadRequestException")
    assert httpx.get(f"{workers.url}/ping").json() == {"status": "Healthy"}
