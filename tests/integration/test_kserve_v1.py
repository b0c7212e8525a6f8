"""KServe's V1 data plane (``/v1/models``, ``/v1/models/{name}``, ``/v1/models/{name}:predict``) on the app with its
lifespan: the answers ``/predict`` gives, in V1's shape; the row format's instances of several inputs; photos;
readiness; and each refusal naming its field, with the server serving on."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from halfserve.settings import Settings
from tests.conftest import save_photo_cnn, save_tiny_mlp
from tests.integration.conftest import serving
from tests.integration.test_named_tensors import pair, save_simple
from tests.integration.test_text import TEXTS, save_texty
from tests.integration.test_v2 import AUTH, TOKEN

PREDICT = "/v1/models/tiny:predict"


async def test_instances_and_inputs_are_answered_as_predict_answers_them(tiny_store: Path) -> None:
    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    async with serving(Settings(store=tiny_store, precision="fp32")) as client:
        plain = await client.post("/predict", json={"inputs": x.tolist()})
        rows = await client.post(PREDICT, json={"instances": x.tolist()})
        named = await client.post(PREDICT, json={"instances": [{"features": r} for r in x.tolist()]})
        columns = await client.post(PREDICT, json={"inputs": x.tolist()})
    assert plain.status_code == 200, plain.text
    for r in (rows, named, columns):
        assert r.status_code == 200, r.text
        assert list(r.json()) == ["predictions"]
        np.testing.assert_array_equal(np.array(r.json()["predictions"]), np.array(plain.json()["outputs"]))


async def test_instances_of_several_inputs_are_rows_of_named_samples(tmp_path: Path) -> None:
    a, b = pair(3, seed=4)
    instances = [{"INPUT0": a[i].tolist(), "INPUT1": b[i].tolist()} for i in range(3)]
    async with serving(Settings(store=save_simple(tmp_path))) as client:
        r = await client.post("/v1/models/simple:predict", json={"instances": instances})
        assert r.status_code == 200, r.text
        predictions = r.json()["predictions"]
        assert [sorted(p) for p in predictions] == [["OUTPUT0", "OUTPUT1", "SCALED"]] * 3
        np.testing.assert_array_equal([p["OUTPUT0"] for p in predictions], a + b)  # integer sums, exact
        np.testing.assert_array_equal([p["OUTPUT1"] for p in predictions], a - b)
        rows = await client.post("/v1/models/simple:predict", json={"instances": [a[0].tolist()]})
        assert rows.status_code == 400
        assert rows.json()["error"] == (  # had named /predict's column format
            "instances[0]: model 'simple' takes several inputs; send each instance as {\"INPUT0\": sample, "
            '"INPUT1": sample}'
        )
        mixed = [instances[0], {"INPUT0": instances[1]["INPUT0"]}]
        r = await client.post("/v1/models/simple:predict", json={"instances": mixed})
        assert r.status_code == 400
        assert r.json()["error"] == (
            "instances[1]: names ['INPUT0'], but instances[0] names ['INPUT0', 'INPUT1']; every instance names the "
            "same inputs"
        )


async def test_photos_as_b64_instances(tmp_path: Path) -> None:
    save_photo_cnn(tmp_path)
    photos = []
    for value in (30, 200):
        buf = io.BytesIO()
        Image.new("L", (8, 8), value).save(buf, format="PNG")
        photos.append({"b64": base64.b64encode(buf.getvalue()).decode()})
    async with serving(Settings(store=tmp_path, precision="fp32")) as client:
        plain = await client.post("/predict", json={"inputs": photos})
        r = await client.post("/v1/models/photo:predict", json={"instances": photos})
        # By the name V2's metadata lists for the photo input: had been "the model takes ['pixels']".
        named = await client.post("/v1/models/photo:predict", json={"instances": [{"photo": p} for p in photos]})
        by_name = await client.post("/predict", json={"inputs": {"photo": photos}})
        both = await client.post("/predict", json={"inputs": {"photo": photos, "pixels": [[[[0.0] * 8] * 8]]}})
        broken = await client.post("/v1/models/photo:predict", json={"instances": [photos[0], {"b64": "bm90IGEgcG5n"}]})
        # TorchServe's KServe envelope, as KServe's TorchServe predictor sends an image_classifier archive's photos.
        enveloped = [{"data": photos[0]["b64"]}, {"body": photos[1]["b64"]}]
        torchserve = await client.post("/v1/models/photo:predict", json={"instances": enveloped})
        # Wrapped as GNU base64 and Python's encodebytes wrap it, which TorchServe's VisionHandler decodes.
        lines = [{"data": base64.encodebytes(base64.b64decode(p["b64"])).decode()} for p in photos]
        wrapped = await client.post("/v1/models/photo:predict", json={"instances": lines})
        not_photo = await client.post("/v1/models/photo:predict", json={"instances": [enveloped[0], {"data": "aGk="}]})
        not_b64 = await client.post("/v1/models/photo:predict", json={"instances": [{"data": "?"}]})
        raw = await client.post("/predictions/photo", content=base64.b64decode(photos[0]["b64"]))
        alone = await client.post("/predict", json={"inputs": photos[:1]})  # a batch of one, as raw's
    assert torchserve.status_code == 200, torchserve.text  # had been "instances.data: unexpected input"
    assert torchserve.json()["predictions"] == plain.json()["outputs"]  # as /predictions answers an unlabelled one
    assert "\n" in lines[0]["data"]
    assert wrapped.json() == torchserve.json(), wrapped.text
    # Each value in a float32's shortest form, as /predict writes it: /predictions had written the double's digits.
    assert raw.json() == alone.json()["outputs"][0], raw.text
    assert not_photo.status_code == 400
    assert not_photo.json()["error"].startswith("instances[1].data: "), not_photo.text
    assert not_b64.status_code == 400
    assert not_b64.json()["error"].startswith("instances[0].data: "), not_b64.text
    assert r.status_code == 200, r.text
    assert r.json()["predictions"] == plain.json()["outputs"]
    assert r.json()["predictions"][0] != r.json()["predictions"][1]
    assert named.json()["predictions"] == r.json()["predictions"], named.text
    assert by_name.json()["outputs"] == plain.json()["outputs"], by_name.text
    assert both.status_code == 400
    assert both.json()["error"] == "inputs: give 'photo' (photos) or 'pixels', not both"
    assert broken.status_code == 400
    assert broken.json()["error"].startswith("instances[1].b64: ")


async def test_texts_as_instances_plain_or_named(tmp_path: Path) -> None:
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        plain = await client.post("/predict", json={"inputs": TEXTS})
        rows = await client.post("/v1/models/texty:predict", json={"instances": TEXTS})
        named = await client.post("/v1/models/texty:predict", json={"instances": [{"text": t} for t in TEXTS]})
        # TorchServe's KServe envelope, as KServe's TorchServe predictor sends a text classifier's texts.
        enveloped = await client.post("/v1/models/texty:predict", json={"instances": [{"data": t} for t in TEXTS]})
        long = await client.post("/v1/models/texty:predict", json={"instances": ["x" * 401]})
        odd = await client.post("/v1/models/texty:predict", json={"instances": ["hi", 5]})
    assert plain.status_code == 200, plain.text
    for r in (rows, named, enveloped):
        assert r.status_code == 200, r.text
        assert r.json()["predictions"] == plain.json()["outputs"]
    assert long.status_code == 400, long.text
    assert long.json()["error"] == "instances.text[0]: 401 bytes, more than the 400 a text may have"
    assert odd.status_code == 400
    assert odd.json()["error"] == "instances[1]: expected a text, as instances[0] is, got int"  # had been "numbers"


async def test_token_ids_outside_the_embedding_are_named_by_the_v1_field_that_holds_them(tmp_path: Path) -> None:
    """The check runs where the rows reach the model, below the routes, whose refusal names the column format's
    ``inputs``: V1's row format names the instance (it had read ``inputs: input 'tokens' row 1``)."""
    pytest.importorskip("tokenizers")
    ids = [[2, 3, 4], [5, 100_000, 7]]
    async with serving(Settings(store=save_texty(tmp_path), precision="fp32")) as client:
        rows = await client.post("/v1/models/texty:predict", json={"instances": ids})
        columns = await client.post("/v1/models/texty:predict", json={"inputs": ids})
        after = await client.post("/v1/models/texty:predict", json={"instances": ids[:1]})
    assert rows.status_code == 400, rows.text
    error = rows.json()["error"]
    assert error.startswith("instances[1]: input 'tokens' holds 100000, outside 0.."), error
    assert error.endswith(" rows takes"), error
    assert columns.status_code == 400, columns.text
    assert columns.json()["error"].startswith("inputs: input 'tokens' row 1 holds 100000, outside 0..")
    assert after.status_code == 200, after.text


async def test_a_true_among_an_instances_numbers_is_refused_not_read_as_1(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    row = [0.5] * 15
    async with serving(Settings(store=tmp_path)) as client:
        refused = await client.post(PREDICT, json={"instances": [[True, *row]]})
        taken = await client.post(PREDICT, json={"instances": [[1, *row]]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == "instances: the 'features' input takes numbers (FP32), got true or false"
    assert taken.status_code == 200, taken.text


async def test_models_are_listed_and_readiness_follows_unload(tmp_path: Path) -> None:
    save_tiny_mlp(tmp_path)
    async with serving(Settings(store=tmp_path, admin_token=TOKEN)) as client:
        listed = await client.get("/v1/models")
        ready = await client.get("/v1/models/tiny")
        unknown = await client.get("/v1/models/nope")
        wrong_method = await client.get(PREDICT)
        explained = await client.post("/v1/models/tiny:explain", json={"instances": [[0.0] * 16]})
        # Every method: a GET had been a 405 "use POST", whose POST is this 404.
        others = [await client.request(m, "/v1/models/tiny:explain") for m in ("GET", "DELETE")]
        assert (await client.post("/v2/repository/models/tiny/unload", headers=AUTH)).status_code == 200
        unloaded = await client.get("/v1/models/tiny")
    assert listed.json() == {"models": ["tiny"]}
    assert (ready.status_code, ready.json()) == (200, {"name": "tiny", "ready": True})
    assert unknown.status_code == 404
    assert unknown.json()["error"].startswith("Request for unknown model: 'nope' is not found")
    assert wrong_method.status_code == 405  # had read as readiness of a model named "tiny:predict"
    assert wrong_method.headers["allow"] == "POST"
    assert explained.status_code == 404
    assert explained.json()["error"] == "explanations are not served here; /v1/models/tiny:predict answers the model"
    assert [(r.status_code, r.json()) for r in others] == [(404, explained.json())] * 2
    assert unloaded.status_code == 503  # KServe's ModelNotReady: a probe reading it sees the model out
    assert unloaded.json()["error"] == "model 'tiny' is not ready: unloaded"


async def test_a_wrong_method_or_verb_on_a_model_s_verb_path_says_what_is_served(tiny_store: Path) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        deleted = await client.delete(PREDICT)
        unknown = await client.post("/v1/models/tiny:PREDICT", json={"instances": [[0.0] * 16]})
    assert deleted.status_code == 405  # had named the readiness route's GET, itself a 405 there
    assert deleted.headers["allow"] == "POST"
    assert deleted.json()["error"] == "DELETE /v1/models/{model}:predict: use POST"
    assert unknown.status_code == 404  # had been a bare "Method Not Allowed"
    assert unknown.json()["error"] == (
        "/v1/models/tiny:PREDICT: no verb ':PREDICT' here; V1 serves /v1/models/{model}:predict"
    )


SAMPLE = [0.0] * 16
REFUSALS = [
    (b'{"instances": []}', 400, "instances: empty; send at least one instance"),
    (b'{"instances": 5}', 400, "instances: expected a list of instances, got int"),
    # Mixed: had been "samples are ragged".
    (b'{"instances": [[0], {"features": [0]}]}', 400, "instances[1]: an object of input name to sample, but"),
    (b"{}", 400, 'instances: missing; send {"instances": [sample, ...]}'),
    (b'{"instances": [[1, 2]]}', 400, "instances: each sample must have shape [16], got [2]"),
    (b'{"instances": [[0]], "inputs": [[0]]}', 400, "body: give instances (one sample per entry) or inputs"),
    (b'{"instances": [[0]], "signature_name": "serving_default"}', 400, "signature_name: unexpected field"),
    (b'{"instances": [{"b64": "aGk="}]}', 400, "instances[0].b64: model 'tiny' takes no images"),
    # TorchServe's KServe envelope, which a model with a handler reads: a model without one takes tensors.
    (b'{"instances": [{"data": "aGk="}]}', 400, "instances.data: unexpected input; the model takes ['features']"),
    (b"[1]", 400, "body: expected a JSON object, got list"),
    (b'{"instances": [{"features": []}, [0]]}', 400, "instances[1]: expected an object of input name to sample, as"),
    (b"{", 400, "body: malformed JSON"),
]


@pytest.mark.parametrize(("body", "status", "message"), REFUSALS)
async def test_refusals_name_the_field_and_serving_goes_on(
    tiny_store: Path, body: bytes, status: int, message: str
) -> None:
    async with serving(Settings(store=tiny_store)) as client:
        r = await client.post(PREDICT, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["error"].startswith(message), r.text
        assert (await client.post(PREDICT, json={"instances": [SAMPLE]})).status_code == 200


async def test_instances_past_the_limits_are_refused_before_decoding(tiny_store: Path) -> None:
    """A request of more rows than any batch takes, and one of more JSON values than the server parses: a 413 naming
    the setting, as /predict's, and the next request is served."""
    settings = Settings(store=tiny_store, max_json_values=100_000)
    async with serving(settings) as client:
        rows = await client.post(PREDICT, json={"instances": [SAMPLE] * 5_000})
        values = await client.post(PREDICT, json={"instances": [{"features": SAMPLE}] * 7_000})
        after = await client.post(PREDICT, json={"instances": [SAMPLE]})
    assert rows.status_code == 413, rows.text
    assert rows.json()["error"].startswith("instances: 5000 rows exceed the limit of")
    assert values.status_code == 413, values.text
    assert "max_json_values" in values.json()["error"]
    assert after.status_code == 200
