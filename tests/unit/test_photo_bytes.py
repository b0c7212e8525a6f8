"""Photos as a V2 ``BYTES`` input (HTTP binary data and JSON base64 strings, gRPC ``bytes_contents`` and raw
contents) and as ``/predict``'s ``{"b64": ...}`` samples: decoded into the input the image section feeds, with the
same limits and errors as TorchServe's photos (issue 51)."""

from __future__ import annotations

import base64
import io
import struct
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import cast

import numpy as np
import orjson
import pytest
from PIL import Image

from halfserve import grpc_messages as pb
from halfserve import images, text
from halfserve.api.dataplane.decode import decode, from_base64, tokenize
from halfserve.api.dataplane.json_request import read_request
from halfserve.api.dataplane.request import Inference
from halfserve.api.dataplane.samples import decode_inputs
from halfserve.api.grpc.grpc_codec import infer_request
from halfserve.api.grpc.grpc_limits import check_infer_request
from halfserve.errors import InvalidInputError, OverLimitError, QueueFullError
from halfserve.execution import Batching
from halfserve.imageinput import ImageInput
from halfserve.manifest import Manifest, Precision, TensorSpec
from halfserve.serving import ModelHandle
from halfserve.settings import Settings
from tests.unit.test_images import png_claiming

SETTINGS = Settings(max_request_images=3, max_image_pixels=10_000)
SECTION = ImageInput.model_validate({"input": "photo", "feeds": "pixels", "mode": "L", "resize": [8, 8]})


def handle() -> ModelHandle:
    manifest = Manifest(
        name="m",
        architecture="small_cnn",
        inputs=[TensorSpec(name="pixels", shape=[1, 8, 8])],
        outputs=[TensorSpec(name="logits", shape=[10])],
        batching=Batching(max_batch_size=16),
        image=SECTION,
    )
    served = SimpleNamespace(
        name="m", version=1, manifest=manifest, batching=manifest.batching, precision=Precision.FP32
    )
    return cast(ModelHandle, served)


SERVED = handle()


def png(value: int, size: int = 16) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, format="PNG")
    return buf.getvalue()


def gif() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (8, 8), 0).save(buf, format="GIF")
    return buf.getvalue()


PHOTOS = [png(0), png(128), png(255)]
EXPECTED = images.decode_all(PHOTOS, SECTION, SETTINGS.max_image_pixels, ["x"] * 3)


def elements(photos: list[bytes]) -> bytes:
    """BYTES binary data: each element's 4-byte little-endian length, then the element."""
    return b"".join(struct.pack("<I", len(p)) + p for p in photos)


async def via_binary(photos: list[bytes], shape: list[int] | None = None) -> np.ndarray:
    body = elements(photos)
    entry = {"name": "photo", "datatype": "BYTES", "shape": shape or [len(photos)]}
    entry["parameters"] = {"binary_data_size": len(body)}
    payload = orjson.loads(orjson.dumps({"inputs": [entry]}))
    req = await tokenize(decode(read_request(payload, memoryview(body), SERVED), SERVED, SETTINGS), SERVED, SETTINGS)
    return req.x


async def via_json(values: list[object]) -> np.ndarray:
    payload = {"inputs": [{"name": "photo", "datatype": "BYTES", "shape": [len(values)], "data": values}]}
    req = await tokenize(decode(read_request(payload, None, SERVED), SERVED, SETTINGS), SERVED, SETTINGS)
    return req.x


async def via_grpc(photos: list[bytes], raw: bool = False) -> np.ndarray:
    message = pb.ModelInferRequest(model_name="m")
    entry = message.inputs.add(name="photo", datatype="BYTES", shape=[len(photos)])
    if raw:
        message.raw_input_contents.append(elements(photos))
    else:
        entry.contents.bytes_contents.extend(photos)
    typed = await infer_request(message, SERVED, SETTINGS)
    return (await tokenize(decode(typed, SERVED, SETTINGS), SERVED, SETTINGS)).x


def b64(photo: bytes) -> str:
    return base64.b64encode(photo).decode()


async def test_every_transport_decodes_the_photos_into_the_input_they_feed() -> None:
    for x in (
        await via_binary(PHOTOS),
        await via_binary(PHOTOS, [3, 1]),
        await via_json([b64(p) for p in PHOTOS]),
        await via_grpc(PHOTOS),
        await via_grpc(PHOTOS, raw=True),
        (await decode_inputs([{"b64": b64(p)} for p in PHOTOS], SERVED, SETTINGS))["pixels"],
    ):
        assert x.dtype == np.float32
        assert x.shape == (3, 1, 8, 8)
        np.testing.assert_array_equal(x, EXPECTED)


async def test_wrapped_base64_is_read_as_the_decoders_of_torchserve_and_browsers_read_it() -> None:
    def wrapped(photo: bytes, line: str) -> str:
        text = b64(photo)
        return line.join(text[i : i + 8] for i in range(0, len(text), 8)) + line

    for line in ("\n", "\r\n", " ", "\t"):
        x = await via_json([wrapped(p, line) for p in PHOTOS])
        np.testing.assert_array_equal(x, EXPECTED)
        photos = [{"b64": wrapped(p, line)} for p in PHOTOS]
        np.testing.assert_array_equal((await decode_inputs(photos, SERVED, SETTINGS))["pixels"], EXPECTED)
    assert from_base64(base64.encodebytes(PHOTOS[0]).decode(), "f") == PHOTOS[0]  # GNU base64's 76 columns
    text = b64(PHOTOS[0])
    for odd in (text[:-1], text[:4] + "_" + text[5:], text[:8] + "\v" + text[8:], text[:8] + "\u00a0" + text[8:], "!"):
        with pytest.raises(InvalidInputError, match=r"^f: not base64 \(standard alphabet, padded\)$"):
            from_base64(odd, "f")


async def test_a_decoded_request_holds_its_photos_until_tokenize_decodes_them() -> None:
    body = elements(PHOTOS[:1])
    entry = {"name": "photo", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(body)}}
    req = decode(read_request({"inputs": [entry]}, memoryview(body), SERVED), SERVED, SETTINGS)
    assert req.inputs == {}
    assert req.photos == ([PHOTOS[0]], ["inputs[0][0]"])
    assert (await tokenize(req, SERVED, SETTINGS)).photos is None
    assert req.inputs["pixels"].shape == (1, 1, 8, 8)


async def test_a_broken_photo_is_a_400_naming_its_element() -> None:
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\[1\]: a GIF image; the server takes JPEG, PNG, WEBP"):
        await via_binary([PHOTOS[0], gif()])
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\[0\]: (cannot decode the|a broken) PNG image"):
        await via_grpc([PHOTOS[0][:40]])
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.data\[1\]: not base64"):
        await via_json([b64(PHOTOS[0]), "not base64!"])
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.data: nested lists that do not match shape \[1\]"):
        await via_json([[1, 2]])
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.data: expected 1 base64 strings"):
        await via_json([1])
    with pytest.raises(InvalidInputError, match=r"inputs\[1\]\.b64: not base64"):
        await decode_inputs([{"b64": b64(PHOTOS[0])}, {"b64": "@@"}], SERVED, SETTINGS)
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.b64: a GIF image"):
        await decode_inputs([{"b64": b64(gif())}], SERVED, SETTINGS)
    with pytest.raises(InvalidInputError, match=r'inputs\[0\]: expected \{"b64"'):
        await decode_inputs([{"b64": 3}], SERVED, SETTINGS)


async def test_a_photo_too_small_for_its_header_s_pixels_is_a_400_on_every_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its header says 4000x4000, its data is a few rows: decoded before, the other rows grey (16 megapixels)."""
    monkeypatch.setattr(f"{__name__}.SETTINGS", Settings(max_request_images=3, max_image_pixels=25_000_000))
    short = png_claiming(4000, 4000)
    said = r"a 4000x4000 PNG image in \d+ bytes, fewer than its pixels take \(1941 at least\): its image data is cut"
    attempts: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        (r"inputs\[0\]\[1\]", lambda: via_binary([PHOTOS[0], short])),
        (r"inputs\[0\]\[0\]", lambda: via_grpc([short])),
        (r"inputs\[0\]\[0\]", lambda: via_grpc([short], raw=True)),
        (r"inputs\[0\]\[0\]", lambda: via_json([b64(short)])),
        (r"inputs\[0\]\.b64", lambda: decode_inputs([{"b64": b64(short)}], SERVED, SETTINGS)),
    ]
    for field, attempt in attempts:
        with pytest.raises(InvalidInputError, match=f"{field}: {said}"):
            await attempt()


async def test_too_many_photos_or_pixels_is_a_413() -> None:
    with pytest.raises(OverLimitError, match=r"inputs\[0\]\.shape: 4 images, more than the 3 .*max_request_images"):
        await via_binary(PHOTOS + PHOTOS[:1])
    with pytest.raises(OverLimitError, match=r"inputs: 4 images, more than the 3"):
        await decode_inputs([{"b64": b64(PHOTOS[0])}] * 4, SERVED, SETTINGS)
    with pytest.raises(OverLimitError, match=r"inputs\[0\]\[0\]: a 101x101 PNG image, more than the 10000 pixels"):
        await via_grpc([png(0, 101)])


async def test_the_shape_and_datatype_are_checked() -> None:
    payload = {"inputs": [{"name": "photo", "datatype": "BYTES", "shape": [1, 2], "data": ["", ""]}]}
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.shape: expected \[N\] or \[N, 1\]"):
        decode(read_request(payload, None, SERVED), SERVED, SETTINGS)
    payload = {"inputs": [{"name": "photo", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.datatype: image input 'photo' is BYTES"):
        decode(read_request(payload, None, SERVED), SERVED, SETTINGS)


async def test_a_full_decoding_queue_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text, "TOKENIZER_QUEUE", -text.TOKENIZER_THREADS)
    with pytest.raises(QueueFullError, match=r"inputs\[0\]\[0\]: the server is decoding"):
        await via_grpc(PHOTOS[:1])


async def binary_body(body: bytes, shape: list[int]) -> np.ndarray:
    entry = {"name": "photo", "datatype": "BYTES", "shape": shape, "parameters": {"binary_data_size": len(body)}}
    req = decode(read_request({"inputs": [entry]}, memoryview(body), SERVED), SERVED, SETTINGS)
    return (await tokenize(req, SERVED, SETTINGS)).x


async def raw_contents(body: bytes, shape: list[int]) -> np.ndarray:
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="photo", datatype="BYTES", shape=shape)
    message.raw_input_contents.append(body)
    typed = await infer_request(message, SERVED, SETTINGS)
    return (await tokenize(decode(typed, SERVED, SETTINGS), SERVED, SETTINGS)).x


async def test_bytes_elements_past_the_shapes_count_are_named_by_the_element_where_they_part() -> None:
    """A first element's length too short leaves the photo's bytes after it: refused as bytes past the shape's one
    element, not as a second element whose length is four bytes of the PNG (issue 4); gRPC names its own field."""
    body = struct.pack("<I", 10) + PHOTOS[0]
    extra = len(body) - 14
    for send, field in (
        (binary_body, r"inputs\[0\]\.parameters\.binary_data_size"),
        (raw_contents, r"raw_input_contents\[0\]"),
    ):
        with pytest.raises(
            InvalidInputError,
            match=rf"^{field}: {extra} bytes follow BYTES element 0, the last of the 1 elements of shape \[1\]",
        ):
            await send(body, [1])
        short = elements(PHOTOS[:2])[:-4]
        with pytest.raises(
            InvalidInputError,
            match=rf"^{field}: BYTES element 1 of shape \[2\] declares {len(PHOTOS[1])} bytes, but "
            rf"{len(PHOTOS[1]) - 4} bytes follow its length",
        ):
            await send(short, [2])
        with pytest.raises(InvalidInputError, match=rf"^{field}: BYTES element 1 of shape \[2\] ends inside its"):
            await send(elements(PHOTOS[:1]) + b"\0\0", [2])
        with pytest.raises(InvalidInputError, match=rf"^{field}: 1 BYTES elements, but shape \[2\] holds 2"):
            await send(elements(PHOTOS[:1]), [2])


async def test_json_data_nested_as_its_shape_is_read_as_flat_data() -> None:
    """V2 allows data nested as the shape (row-major), as numbers are: ``[N, 1]`` as N lists of one (issue 2); a
    nesting that is not the shape's is refused naming the field."""
    strings = [b64(p) for p in PHOTOS[:2]]
    nested = {"name": "photo", "datatype": "BYTES", "shape": [2, 1], "data": [[s] for s in strings]}
    req = await tokenize(decode(read_request({"inputs": [nested]}, None, SERVED), SERVED, SETTINGS), SERVED, SETTINGS)
    np.testing.assert_array_equal(req.x, EXPECTED[:2])
    for shape, data in (([2], [[s] for s in strings]), ([2, 1], [strings]), ([2, 1], [[strings[0]], strings[1]])):
        bad = {"name": "photo", "datatype": "BYTES", "shape": shape, "data": data}
        with pytest.raises(InvalidInputError, match=r"^inputs\[0\]\.data: nested lists that do not match shape"):
            decode(read_request({"inputs": [bad]}, None, SERVED), SERVED, SETTINGS)


async def test_a_scalar_shape_is_refused_alike_on_every_path() -> None:
    """Shape ``[]`` for one photo: the same 400 over HTTP as JSON and as binary data, and over gRPC as BYTES elements
    (the message's prescan counting one value for it, as the shape holds) and as a raw entry (issue 1)."""
    refusal = r"^inputs\[0\]\.shape: expected \[N\] or \[N, 1\] \(one encoded photo per row\), got \[\]$"
    with pytest.raises(InvalidInputError, match=refusal):
        await binary_body(elements(PHOTOS[:1]), [])
    with pytest.raises(InvalidInputError, match=refusal):
        await raw_contents(elements(PHOTOS[:1]), [])
    payload = {"inputs": [{"name": "photo", "datatype": "BYTES", "shape": [], "data": [b64(PHOTOS[0])]}]}
    with pytest.raises(InvalidInputError, match=refusal):
        decode(read_request(payload, None, SERVED), SERVED, SETTINGS)
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="photo", datatype="BYTES", shape=[]).contents.bytes_contents.append(PHOTOS[0])
    check_infer_request(message.SerializeToString(), lambda _: (100, "max_request_rows"))
    with pytest.raises(InvalidInputError, match=refusal):
        decode(await infer_request(message, SERVED, SETTINGS), SERVED, SETTINGS)


def test_once_decoded_the_request_waits_what_was_left_of_its_deadline() -> None:
    assert Inference({}, None, False, timeout_us=1_000_000).timeout(0.5) == 0.5  # the client's is the shorter
    assert Inference({}, None, False, timeout_us=1_000_000).timeout(None) == 1.0
    assert Inference({}, None, False).timeout(None) is None
    decoded = Inference({}, None, False, timeout_us=1_000_000, left=0.25)
    assert decoded.timeout(0.5) == 0.25  # what decoding left of the shortest, the model's own among them


async def test_the_model_s_own_limit_is_spent_by_decoding_too() -> None:
    """A request with no deadline of its own, to a model with ``request_timeout_ms``: what decoding took is spent from
    the model's limit, not granted again in the queue."""
    limited = SERVED.batching.model_copy(update={"request_timeout_ms": 10_000.0})
    served = cast(ModelHandle, SimpleNamespace(**{**vars(SERVED), "batching": limited}))
    payload = {"inputs": [{"name": "photo", "datatype": "BYTES", "shape": [1], "data": [b64(PHOTOS[0])]}]}
    req = await tokenize(decode(read_request(payload, None, served), served, SETTINGS), served, SETTINGS)
    assert req.left is not None
    assert 0 < req.left < 10.0
    assert req.timeout(None) == req.left
