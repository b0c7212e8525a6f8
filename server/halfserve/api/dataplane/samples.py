"""Samples as JSON (``/predict``'s ``inputs``, KServe V1's ``instances`` turned into columns): nested lists of each
sample's values, texts and ``{"b64": ...}`` photos, decoded into the model's named inputs by the rules V2 uses too,
texts tokenized and photos decoded off the event loop."""

from __future__ import annotations

from typing import Any

import numpy as np

from halfserve.api.dataplane.bounds import check_size
from halfserve.api.dataplane.codec import decode_samples, encode_texts
from halfserve.api.dataplane.decode import from_base64
from halfserve.api.dataplane.photos import decode_photos, image_count, no_images
from halfserve.api.dataplane.signature import Wording, check_shape
from halfserve.errors import InvalidInputError
from halfserve.manifest import TensorSpec, sent_inputs
from halfserve.serving import ModelHandle
from halfserve.settings import Settings


async def decode_inputs(
    samples: object, served: ModelHandle, settings: Settings, field: str = "inputs"
) -> dict[str, np.ndarray]:
    """``samples`` (a request's ``inputs``) as the model's named inputs: a list of samples for a model with one
    input, else a mapping of input name to its samples (every input, the same number of samples each); texts tokenized
    off the event loop.

    Awaited inside :func:`~halfserve.api.dataplane.infer.infer`, so it raises domain errors, as the data plane does;
    ``field`` names the samples in them (KServe V1's route gives ``instances``)."""
    specs = sent_inputs(served.manifest)
    text = served.manifest.text
    if text is not None:
        if len(specs) == 1 and isinstance(samples, list) and samples and isinstance(samples[0], str):
            for i, t in enumerate(samples):
                if not isinstance(t, str):  # a list of texts with one that is not had read "values must be numbers"
                    raise InvalidInputError(f"{field}[{i}]: expected a text, as {field}[0] is, got {type(t).__name__}")
            samples = {text.input: samples}
        if isinstance(samples, dict) and text.input in samples:
            texts = samples[text.input]
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise InvalidInputError(f"{field}.{text.input}: expected a list of texts")
            check_size(settings, served, len(texts), f"{field}.{text.input}")
            rest = {k: v for k, v in samples.items() if k != text.input}
            if text.feeds in rest:
                raise InvalidInputError(f"{field}: give {text.input!r} or {text.feeds!r}, not both")
            others = [t for t in specs if t.name != text.feeds]
            decoded = {t.name: _samples(rest.get(t.name), t, served, f"{field}.{t.name}") for t in others}
            return await encode_texts(texts, f"{field}.{text.input}", served, settings) | decoded
    image = served.manifest.image
    if image is not None and isinstance(samples, dict) and image.input in samples:  # the photos by their input's name
        if len(samples) > 1:
            raise InvalidInputError(f"{field}: give {image.input!r} (photos) or {image.feeds!r}, not both")
        photos = samples[image.input]
        if not isinstance(photos, list) or not photos:
            raise InvalidInputError(f'{field}.{image.input}: expected a list of {{"b64": "<base64 of a photo>"}}')
        return await _photos(photos, served, settings, f"{field}.{image.input}")
    if isinstance(samples, list) and samples and isinstance(samples[0], dict):
        if image is not None:
            return await _photos(samples, served, settings, field)
        if "b64" in samples[0]:  # KServe v1's photo, named as /predictions names photos a model cannot take
            raise no_images(served, f"{field}[0].b64")
    if len(specs) == 1 and not isinstance(samples, dict):  # a mapping is checked by name, as for several inputs
        if isinstance(samples, list):
            check_size(settings, served, len(samples), field)
        return {specs[0].name: _samples(samples, specs[0], served, field)}
    names = [t.name for t in specs]
    if not isinstance(samples, dict):
        example = ", ".join(f'"{n}": [sample, ...]' for n in names)
        raise InvalidInputError(f"{field}: model {served.name!r} takes several inputs; send {{{example}}}")
    for name in samples:
        if name not in names:
            raise InvalidInputError(f"{field}.{name}: unexpected input; the model takes {names}")
    for name in names:
        if name not in samples:
            raise InvalidInputError(f"{field}.{name}: missing; the model takes {names}")
        if not isinstance(samples[name], list):
            raise InvalidInputError(f"{field}.{name}: expected a list of samples, got {type(samples[name]).__name__}")
    rows = len(samples[names[0]])
    for name in names[1:]:
        if len(samples[name]) != rows:
            raise InvalidInputError(
                f"{field}.{name}: {len(samples[name])} samples, but {names[0]!r} has {rows}; every input needs one "
                "per row",
            )
    check_size(settings, served, rows, field)
    return {t.name: _samples(samples[t.name], t, served, f"{field}.{t.name}") for t in specs}


async def _photos(samples: list[Any], served: ModelHandle, settings: Settings, field: str) -> dict[str, np.ndarray]:
    """KServe v1's encoded photos, ``[{"b64": "..."}, ...]`` (one per sample), decoded off the event loop into the
    input the manifest's ``image`` section feeds: counted against ``max_request_images`` before any is read."""
    image_count(settings, served, len(samples), field)
    photos = []
    for i, sample in enumerate(samples):
        value = sample.get("b64") if isinstance(sample, dict) else None
        if not isinstance(value, str) or len(sample) != 1:
            raise InvalidInputError(f'{field}[{i}]: expected {{"b64": "<base64 of a photo>"}}')
        photos.append(from_base64(value, f"{field}[{i}].b64"))
    return await decode_photos(photos, [f"{field}[{i}].b64" for i in range(len(photos))], served, settings)


def _samples(samples: object, spec: TensorSpec, served: ModelHandle, field: str) -> np.ndarray:
    """One input's samples as the batcher's array, its shape checked by the rule V2 uses too (the request's rows are
    held to their limits before any input is decoded, by the same ``check_size``)."""
    x = decode_samples(samples, spec, field)
    check_shape(list(x.shape), spec, served, None, field, Wording.SAMPLES)
    return x
