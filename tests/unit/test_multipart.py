"""The ``multipart/form-data`` reader of ``/predictions`` (against what httpx, as curl -F does, sends), and its
top-five answer."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from halfserve.api.dataplane.stockanswers import top_classes
from halfserve.api.errors import APIError
from halfserve.api.http import multipart


def sent(files: list[tuple[str, tuple[str, bytes, str]]]) -> tuple[bytes, str]:
    """The body and Content-Type httpx sends for ``files``, as a client's form."""
    request = httpx.Request("POST", "http://127.0.0.1/predictions/m", files=files)
    return request.read(), request.headers["content-type"]


def test_a_client_s_form_is_read_field_by_field_bytes_unchanged() -> None:
    payloads = [b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3, b"--\r\n\r\n--not the boundary\r\n", b""]
    body, content_type = sent([("data", ("a.png", p, "image/png")) for p in payloads] + [("body", ("b", b"x", "x/y"))])
    assert multipart.is_multipart(content_type)
    parts = multipart.parts(body, content_type, 16, "max_request_images")
    assert [(p.name, p.data) for p in parts] == [("data", p) for p in payloads] + [("body", b"x")]


def test_a_quoted_boundary_a_preamble_and_unquoted_names_are_read() -> None:
    disposition = b'Content-Disposition: form-data; filename="name=x"; name=data'
    body = b"preamble\r\n--b o\r\n" + disposition + b"\r\n\r\nhi\r\n--b o--\r\n"
    parts = multipart.parts(body, 'multipart/form-data; boundary="b o"', 4, "max_request_images")
    assert [(p.name, p.data) for p in parts] == [("data", b"hi")]


def test_more_fields_than_the_limit_are_refused_before_the_next_is_read() -> None:
    body, content_type = sent([("data", (str(i), b"x", "image/png")) for i in range(5)])
    assert len(multipart.parts(body, content_type, 5, "max_request_images")) == 5
    with pytest.raises(APIError, match=r"more than 4 fields in one request \(max_request_images\)") as e:
        multipart.parts(body, content_type, 4, "max_request_images")
    assert e.value.status == 413


@pytest.mark.parametrize(
    ("body", "content_type", "message"),
    [
        (b"--x\r\n\r\n", "multipart/form-data", "without a boundary"),
        (b"no boundary here", "multipart/form-data; boundary=x", "no boundary line"),
        (b"--x\r\nContent-Disposition: form-data; name=data\r\n\r\nhalf", "multipart/form-data; boundary=x", "no clos"),
        (b"--x\r\nContent-Type: image/png\r\n\r\nab\r\n--x--", "multipart/form-data; boundary=x", "with a name"),
        (b"--x\r\n" + b"H" * 9000 + b"\r\n--x--", "multipart/form-data; boundary=x", "no end to its headers"),
        (b"--xjunk", "multipart/form-data; boundary=x", "malformed boundary line"),
        (b"--x\r\n\r\nab\r\n--x--", "multipart/form-data; boundary=x", "part 0: no Content-Disposition with a name"),
    ],
)
def test_a_broken_form_is_a_400_naming_the_problem(body: bytes, content_type: str, message: str) -> None:
    with pytest.raises(APIError, match=message) as e:
        multipart.parts(body, content_type, 16, "max_request_images")
    assert e.value.status == 400


def test_the_top_five_after_softmax_highest_first() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.0, -1.0, 5.0], dtype=np.float32)
    answer = top_classes(logits, list("abcdefg"))
    assert list(answer) == ["g", "b", "d", "c", "a"]  # equal scores: the first class first
    exp = np.exp(logits.astype(np.float64) - 5.0)
    assert answer["g"] == pytest.approx(float(exp[6] / exp.sum()))
    assert answer["b"] == answer["d"]
    assert list(top_classes(np.array([0.5, 0.25]), ["x", "y"])) == ["x", "y"]  # fewer classes than five


def test_field_names_are_utf8_and_a_long_one_is_shown_cut() -> None:
    body, content_type = sent([("данные", ("a", b"x", "image/png")), ("n" * 8000, ("b", b"y", "image/png"))])
    names = [p.name for p in multipart.parts(body, content_type, 16, "max_request_images")]
    assert names == ["данные", "n" * 8000]
    assert multipart.shown(names[0]) == "данные"
    assert multipart.shown(names[1]) == "n" * multipart.SHOWN_NAME + "..."
