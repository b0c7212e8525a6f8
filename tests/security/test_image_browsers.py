"""TorchServe's ``/predictions`` takes a photo with any ``Content-Type`` (its clients send none, an image type, a form,
or a urlencoded one as ``curl --data-binary`` names it), so a web page's cross-site request is refused by who sent it,
as on every route: a browser's cross-site ``POST`` or ``PUT`` of a form is a 403 before its body is read, while a
program's request, and the server's own page's, are answered."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from halfserve import cli
from halfserve.settings import Settings
from tests.conftest import DIGITS_CNN_IMPORT, DIGITS_PHOTO
from tests.integration.conftest import serving


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photo-browsers")
    flags = [*DIGITS_CNN_IMPORT, "--name", "photo", *DIGITS_PHOTO, "--samples", "8", "--store", str(root)]
    assert cli.main(flags) == 0
    return root


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (32, 32), 128).save(buf, format="PNG")
    return buf.getvalue()


FORM = b'--x\r\nContent-Disposition: form-data; name="data"\r\n\r\n'


@pytest.mark.parametrize(
    ("method", "headers", "status"),
    [
        ("POST", {"Sec-Fetch-Site": "cross-site", "Content-Type": "multipart/form-data; boundary=x"}, 403),
        ("POST", {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"}, 403),
        ("PUT", {"Sec-Fetch-Site": "same-site"}, 403),
        ("POST", {"Sec-Fetch-Site": "same-origin", "Content-Type": "multipart/form-data; boundary=x"}, 200),
        ("POST", {"Content-Type": "application/x-www-form-urlencoded"}, 200),  # curl --data-binary
        ("PUT", {}, 200),  # curl -T
    ],
)
async def test_browsers_cross_site_requests_are_refused_and_programs_served(
    store: Path, method: str, headers: dict[str, str], status: int
) -> None:
    form = headers.get("Content-Type", "").startswith("multipart/")
    body = FORM + png() + b"\r\n--x--\r\n" if form else png()
    async with serving(Settings(store=store)) as client:
        r = await client.request(method, "/predictions/photo", content=body, headers=headers)
        stats = (await client.get("/models/photo/stats")).json()
    assert r.status_code == status, r.text
    assert stats["requests"] == (1 if status == 200 else 0)  # a refused request never reaches the model
    if status == 200:
        assert len(r.json()) == 10  # no labels: the 10 scores
