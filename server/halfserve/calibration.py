"""Calibration samples: the real inputs a version is checked on at load (fidelity, padding invariance).

``halfserve import --calibration`` reads them from what a team has (:func:`read`):

* ``.npy``: the samples of a model with one input, rows first;
* ``.npz`` or ``.safetensors``: one array per input name. A variable-length input's rows may be ragged: give them
  padded to the longest, with each row's length as ``<name>#length`` (``np.savez(f, ids=padded,
  **{"ids#length": lengths})``); without it every row is the array's full length;
* ``.jsonl``: one sample per line, an object by input name (``{"input_ids": [101, 2023, 102]}``); rows may differ
  in length. A text model's line may give its text input instead (``{"text": "..."}``);
* ``.txt``: a text model's texts, one per line (blank lines skipped), tokenized the way requests are (its
  ``tokenizer.json``, ``max_length`` and ``truncate``);
* a folder of image files (``.png``, ``.jpg``, ...) for a model with one image input: each decoded with Pillow to the
  input's channels (grey, RGB or RGBA) and size and laid out as its ``format`` says; a ``UINT8`` input or one with
  ``normalize`` gets the pixel values as they are (the server normalises on the device, as for requests), any other
  floating input the values / 255. A model with an ``image`` section gets each through that section, as a request's
  photo (:mod:`halfserve.images`: JPEG, PNG and WebP). Either way a photo is held to a pixel limit, read from its
  header before it is decoded: the one requests are held to by default (``max_image_pixels``), raised with
  ``halfserve import --max-image-pixels``.

Without a file, samples are random (:func:`random_samples`), and everything that reports them says so.

The version keeps them as ``<version>/calibration.safetensors``: one tensor per input, rows first, a variable input
padded to its longest row with ``<name>#length`` beside it, and where they came from in the file's metadata
(``source``). Files written before lengths were kept (every row full length) read as they always did.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from torch import nn

from halfserve import images, packing, storage, text
from halfserve.manifest import InputFormat, Manifest, TensorSpec, sent_inputs
from halfserve.packing import LENGTH
from halfserve.settings import MAX_IMAGE_PIXELS, MOST_IMAGE_PIXELS
from halfserve.storage import StoreError
from halfserve.store import LoadedModel

CALIBRATION = "calibration.safetensors"
MAX_SAMPLES = 4096
"""Calibration rows read at most (the rest are ignored): enough for an agreement figure, bounded in load time."""
RANDOM_SAMPLES = 64
SAMPLE_LENGTH = 16
"""The length of random samples of a variable input (at most its ``max_length``)."""
RANDOM_KEY = "random"
"""The calibration file's metadata key saying its samples were drawn at random (``"true"``), not given."""
INT_RANGE = 100
"""Random integer inputs of a model without an embedding are drawn from ``[0, INT_RANGE)`` (class indices, small
counts); a model with one draws them below its first embedding table's size (token ids of its whole vocabulary)."""
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
_FORMATS = frozenset({"BMP", "GIF", "JPEG", "PNG", "TIFF", "WEBP"})
"""The formats of :data:`IMAGE_SUFFIXES` (by their first bytes, :func:`halfserve.images.sniff`): only their readers
are reached."""
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


class CalibrationError(StoreError):
    """Calibration samples that cannot be read or do not fit the model; the message names the file and the input."""


@dataclass(frozen=True)
class Samples:
    """Calibration samples by input name (the inputs clients send), each variable input padded to its longest row
    with each row's length under ``<name>#length``; and where they came from, in words."""

    arrays: dict[str, np.ndarray]
    source: str
    random: bool = False

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def rows(self, manifest: Manifest) -> np.ndarray:
        """The samples as the engine takes rows: the one input's array, or records (:func:`halfserve.packing.pack`)."""
        if not packing.packs_records(manifest):
            return np.ascontiguousarray(self.arrays[sent_inputs(manifest)[0].name])
        try:
            return packing.pack(manifest, self.arrays)
        except packing.PackError as e:
            raise CalibrationError(f"calibration samples: {e}") from None

    def save(self, version_dir: Path) -> Path:
        """Write them as ``version_dir``'s calibration file, with where they came from."""
        path = version_dir / CALIBRATION
        metadata = {"source": self.source, RANDOM_KEY: "true" if self.random else "false"}
        save_file({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, str(path), metadata)
        path.chmod(storage.created_mode())  # safetensors creates the file owner-only
        return path


def stored(version_dir: Path, manifest: Manifest) -> Samples | None:
    """A version's stored calibration samples, checked against the manifest, or ``None`` when it has none. Raises
    :class:`CalibrationError` naming the file for samples that do not fit."""
    path = version_dir / CALIBRATION
    try:
        with storage.readable_path(path) as readable:
            tensors = load_file(readable)
    except FileNotFoundError:
        return None
    except StoreError as e:  # not a regular file
        raise CalibrationError(str(e)) from None
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CalibrationError(f"{path}: cannot read calibration samples ({e})") from None
    specs = sent_inputs(manifest)
    names = [t.name for t in specs]
    lengths = {t.name + LENGTH for t in specs if t.variable}
    if not set(names) <= set(tensors) or not set(tensors) <= set(names) | lengths:
        raise CalibrationError(
            f"{path}: holds {sorted(tensors)}; calibration samples need one tensor per input, {names}"
        )
    arrays = _checked({k: v[:MAX_SAMPLES] for k, v in tensors.items()}, specs, str(path))
    count = len(arrays[names[0]])
    return Samples(
        arrays, _recorded(path) or f"{count} samples from {CALIBRATION}", _recorded(path, RANDOM_KEY) == "true"
    )


def source_of(version_dir: Path) -> str | None:
    """Where a version's stored calibration samples came from, as its file records it (the file's name where it was
    written before sources were recorded); ``None`` when it stores none."""
    path = version_dir / CALIBRATION
    if not path.is_file():
        return None
    return _recorded(path) or CALIBRATION


def _recorded(path: Path, key: str = "source") -> str | None:
    try:
        with storage.readable_path(path) as readable, safe_open(readable, framework="np") as f:
            return (f.metadata() or {}).get(key)
    except Exception:  # an unreadable file fails where its samples are read, with the reason
        return None


def at_load(loaded: LoadedModel, count: int = RANDOM_SAMPLES) -> Samples:
    """The samples a version is checked on at load: its stored calibration samples, else ``count`` random ones."""
    found = stored(loaded.path.parent, loaded.manifest)
    if found is not None:
        return found
    return random_samples(sent_inputs(loaded.manifest), count, int_range(loaded.module))


def int_range(module: nn.Module) -> int:
    """The values random integer inputs are drawn below: the size of the model's first embedding table (its
    vocabulary: every token id it takes, none past it, which would fail the forward), else :data:`INT_RANGE`."""
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return INT_RANGE if embedding is None else max(1, embedding.num_embeddings)


def random_samples(specs: list[TensorSpec], count: int, high: int = INT_RANGE) -> Samples:
    """``count`` random rows of the declared shapes: normal floats, booleans, integers in ``[0, high)``; variable
    inputs :data:`SAMPLE_LENGTH` long (at most their ``max_length``)."""
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for t in specs:
        length = min(SAMPLE_LENGTH, t.max_length or SAMPLE_LENGTH)
        shape = (count, *t.bounded(length))
        kind = t.datatype.numpy.kind
        if kind == "f":
            arrays[t.name] = rng.standard_normal(shape).astype(t.datatype.numpy)
        elif kind == "b":
            arrays[t.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            arrays[t.name] = rng.integers(0, high, shape).astype(t.datatype.numpy)
        if t.variable:
            arrays[t.name + LENGTH] = np.full(count, length, dtype=np.int32)
    source = f"{count} random samples of the declared shapes (normal floats, integers in [0, {high}))"
    return Samples(arrays, source, random=True)


def read(path: Path, manifest: Manifest, tokenizer: Path | None = None, max_pixels: int = MAX_IMAGE_PIXELS) -> Samples:
    """Samples from the file or folder ``path`` given to ``halfserve import --calibration`` (see the module), for
    ``manifest``'s inputs; a text model's texts are tokenized with ``tokenizer``, a photo of more than ``max_pixels``
    pixels is refused. Raises :class:`CalibrationError` naming the option, the file and what does not fit."""
    where = f"--calibration {path}"
    specs = sent_inputs(manifest)
    if path.is_dir():
        return _images(path, specs, manifest, where, max_pixels)
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            return _text_file(lines[:MAX_SAMPLES], manifest, tokenizer, where, path)
        if suffix == ".jsonl":
            return _jsonl(path, specs, manifest, tokenizer, where)
        if suffix == ".npy":
            if len(specs) != 1:
                raise CalibrationError(f"{where}: a .npy file feeds one input; use .npz, .safetensors or .jsonl")
            arrays = {specs[0].name: np.load(path, allow_pickle=False)}
        elif suffix == ".npz":
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
        elif suffix == ".safetensors":
            arrays = load_file(str(path))
        else:
            raise CalibrationError(
                f"{where}: expected a .npy, .npz, .safetensors, .jsonl or .txt file, or a folder of images"
            )
    except CalibrationError:
        raise
    except UnicodeDecodeError as e:
        raise CalibrationError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise CalibrationError(
                f"{where}: holds an object array (ragged rows, say); reading one would unpickle it, which is "
                "refused. Give a variable-length input's rows padded to the longest with each row's length as "
                "'<name>#length', or one sample per line in a .jsonl file"
            ) from None
        raise CalibrationError(f"{where}: cannot read it ({e})") from None
    except Exception as e:  # OSError, zip and safetensors errors: the file is not what its name says
        raise CalibrationError(f"{where}: cannot read it ({e})") from None
    for t in specs:
        if t.name not in arrays:
            raise CalibrationError(f"{where}: no samples for input {t.name!r} (it has {sorted(arrays)})")
    known = {t.name for t in specs} | {t.name + LENGTH for t in specs if t.variable}
    extra = sorted(set(arrays) - known)
    if extra:
        raise CalibrationError(f"{where}: {extra[0]!r} is no input of the model (it takes {sorted(known)})")
    arrays = _checked({k: v[:MAX_SAMPLES] for k, v in arrays.items()}, specs, where)
    return Samples(arrays, _described(arrays, specs, str(path)))


def _described(arrays: dict[str, np.ndarray], specs: list[TensorSpec], path: str) -> str:
    count = len(arrays[specs[0].name])
    variable = next((t for t in specs if t.variable), None)
    if variable is None:
        return f"{count} samples from {path}"
    lengths = arrays[variable.name + LENGTH]
    return f"{count} sequences from {path} (lengths {int(lengths.min())}..{int(lengths.max())})"


def _checked(arrays: dict[str, np.ndarray], specs: list[TensorSpec], where: str) -> dict[str, np.ndarray]:
    """``arrays`` as stored samples: each input's rows of its shape and dtype, a variable input's rows within its
    ``max_length`` (longer ones cut where it ``truncate``\\ s, refused otherwise) with their lengths."""
    out: dict[str, np.ndarray] = {}
    rows = {len(arrays[t.name]) for t in specs}
    if len(rows) != 1 or 0 in rows:
        raise CalibrationError(f"{where}: every input needs the same number of rows (at least one), got {sorted(rows)}")
    for t in specs:
        a = arrays[t.name]
        if a.dtype.kind not in "fiub":
            raise CalibrationError(f"{where}: {t.name!r} holds {a.dtype} values, not numbers")
        if not t.variable:
            if list(a.shape[1:]) != t.shape:
                raise CalibrationError(f"{where}: {t.name!r} has samples of shape {list(a.shape[1:])}, not {t.shape}")
            out[t.name] = a.astype(t.datatype.numpy, copy=False)
            continue
        if a.ndim != len(t.shape) + 1 or list(a.shape[2:]) != t.shape[1:] or a.shape[1] < 1:
            raise CalibrationError(f"{where}: {t.name!r} has samples of shape {list(a.shape[1:])}, not {t.shape}")
        given = arrays.get(t.name + LENGTH)
        lengths = np.full(len(a), a.shape[1], dtype=np.int64) if given is None else given.astype(np.int64)
        if lengths.shape != (len(a),) or lengths.min() < 1 or lengths.max() > a.shape[1]:
            raise CalibrationError(
                f"{where}: {t.name + LENGTH!r} needs one length per row, each 1..{a.shape[1]} (the rows' width)"
            )
        limit = t.max_length or a.shape[1]
        if lengths.max() > limit and not t.truncate:
            row = int(np.argmax(lengths > limit))
            raise CalibrationError(
                f"{where}: sample {row} of {t.name!r} is {int(lengths[row])} long, more than its max_length {limit} "
                "(cut such samples, or let the input truncate: --truncate)"
            )
        lengths = np.minimum(lengths, limit)
        width = int(lengths.max())
        a = a[:, :width].astype(t.datatype.numpy)  # a copy: the padding is rewritten below
        a[np.arange(width)[None, :] >= lengths[:, None]] = t.pad
        out[t.name] = a
        out[t.name + LENGTH] = lengths.astype(np.int32)
    return out


def _ragged(rows: list[np.ndarray], spec: TensorSpec, where: str) -> dict[str, np.ndarray]:
    """Rows of one variable input, each its own length, padded to the longest with their lengths beside."""
    for i, r in enumerate(rows):
        if r.ndim != len(spec.shape) or list(r.shape[1:]) != spec.shape[1:] or len(r) < 1:
            raise CalibrationError(f"{where}: sample {i} of {spec.name!r} has shape {list(r.shape)}, not {spec.shape}")
    width = max(len(r) for r in rows)
    padded = np.full((len(rows), width, *spec.shape[1:]), spec.pad, dtype=np.float64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return {spec.name: padded, spec.name + LENGTH: np.asarray([len(r) for r in rows], dtype=np.int64)}


def _jsonl(path: Path, specs: list[TensorSpec], manifest: Manifest, tokenizer: Path | None, where: str) -> Samples:
    texts = manifest.text
    samples: dict[str, list[Any]] = {}
    count = 0
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if count == MAX_SAMPLES:
                break
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(f"{where}: line {number}: not JSON ({e.msg})") from None
            if not isinstance(sample, dict):
                raise CalibrationError(f"{where}: line {number}: expected an object by input name")
            if texts is not None and texts.input in sample:
                if not isinstance(sample[texts.input], str):
                    raise CalibrationError(f"{where}: line {number}: {texts.input!r} must be a string")
                sample = {**sample, texts.feeds: sample.pop(texts.input)}
            for t in specs:
                if t.name not in sample:
                    raise CalibrationError(
                        f"{where}: line {number}: no {t.name!r} (the model takes {_names(manifest)})"
                    )
            extra = sorted(set(sample) - {t.name for t in specs})
            if extra:
                raise CalibrationError(f"{where}: line {number}: {extra[0]!r} is no input of the model")
            for name, value in sample.items():
                samples.setdefault(name, []).append(value)
            count += 1
    if not count:
        raise CalibrationError(f"{where}: no samples (one JSON object per line)")
    arrays: dict[str, np.ndarray] = {}
    for t in specs:
        values = samples[t.name]
        if texts is not None and t.name == texts.feeds and all(isinstance(v, str) for v in values):
            arrays.update(_texts(values, manifest, tokenizer, where))
            continue
        try:
            rows = [np.asarray(v, dtype=np.float64 if t.datatype.numpy.kind == "f" else np.int64) for v in values]
        except (ValueError, TypeError) as e:
            raise CalibrationError(f"{where}: {t.name!r}: samples must be nested lists of numbers ({e})") from None
        if t.variable:
            arrays.update(_ragged(rows, t, where))
        else:
            bad = next((i for i, r in enumerate(rows) if list(r.shape) != t.shape), None)
            if bad is not None:
                raise CalibrationError(
                    f"{where}: sample {bad} of {t.name!r} has shape {list(rows[bad].shape)}, not {t.shape}"
                )
            arrays[t.name] = np.stack(rows)
    arrays = _checked(arrays, specs, where)
    return Samples(arrays, _described(arrays, specs, str(path)))


def _names(manifest: Manifest) -> list[str]:
    names = [t.name for t in sent_inputs(manifest)]
    return names + ([f"{manifest.text.input} (text)"] if manifest.text is not None else [])


def _text_file(lines: list[str], manifest: Manifest, tokenizer: Path | None, where: str, path: Path) -> Samples:
    if manifest.text is not None:
        others = [t.name for t in sent_inputs(manifest) if t.name != manifest.text.feeds]
        if others:
            raise CalibrationError(
                f"{where}: a file of texts feeds {manifest.text.feeds!r} alone; the model also takes "
                f"{others}: give them together in a .jsonl file"
            )
    return Samples(_texts(lines, manifest, tokenizer, where), f"texts from {path} ({len(lines)} lines)")


def _texts(lines: list[str], manifest: Manifest, tokenizer: Path | None, where: str) -> dict[str, np.ndarray]:
    """Texts as token ids (and each one's length), tokenized as requests are (:class:`halfserve.text.Encoder`: the
    input's ``max_length`` and ``truncate``)."""
    if manifest.text is None or tokenizer is None:
        raise CalibrationError(f"{where}: texts need a text input (--text, with the folder's tokenizer.json)")
    if not lines:
        raise CalibrationError(f"{where}: no texts (one per line)")
    try:
        encoder = text.encoder_at(tokenizer, manifest)
    except text.TextError as e:
        raise CalibrationError(f"{where}: {e}") from None
    try:
        encoded = encoder.encode(lines, f"{where}: text")
    except text.TextError as e:
        raise CalibrationError(
            str(e).replace("(or set truncate)", "(or import with --truncate: it cuts texts as it cuts requests)")
        ) from None
    lengths = encoded[encoder.spec.name + LENGTH]
    ids = [row[:n] for row, n in zip(encoded[encoder.spec.name], lengths, strict=True)]
    return _ragged(ids, encoder.spec, where)


def photo_files(folder: Path) -> list[Path]:
    """The image files in ``folder`` read as calibration samples: by name, at most :data:`MAX_SAMPLES`."""
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())[:MAX_SAMPLES]


def too_large(where: str, error: images.ImageTooLargeError) -> CalibrationError:
    """A calibration photo over the pixel limit, with the flag that raises it (as ``serve``'s raises the requests')."""
    return CalibrationError(
        f"{where}: {error}; --max-image-pixels raises it (to at most {MOST_IMAGE_PIXELS}), as it does for requests"
    )


def _images(folder: Path, specs: list[TensorSpec], manifest: Manifest, where: str, max_pixels: int) -> Samples:
    if manifest.image is not None:
        return _photos(folder, manifest, where, max_pixels)
    pictured = [t for t in specs if t.image_format in (InputFormat.NCHW, InputFormat.NHWC)]
    if len(specs) != 1 or not pictured:
        raise CalibrationError(
            f"{where}: a folder of images feeds a model with one image input (three fixed dimensions, NCHW or NHWC)"
        )
    spec = pictured[0]
    nchw = spec.image_format is InputFormat.NCHW
    channels, height, width = spec.shape if nchw else (spec.shape[2], spec.shape[0], spec.shape[1])
    if channels not in _MODES:
        raise CalibrationError(f"{where}: {spec.name!r} has {channels} channels; images have 1, 3 or 4")
    files = photo_files(folder)
    if not files:
        raise CalibrationError(f"{where}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    try:
        from PIL import Image  # noqa: PLC0415 (needed by this path alone)
    except ImportError:
        raise CalibrationError(f"{where}: reading images needs Pillow (pip install pillow)") from None
    pixels = np.empty((len(files), height, width, channels), dtype=np.uint8)
    for i, file in enumerate(files):
        data = file.read_bytes()
        kind = images.sniff(data)
        if kind not in _FORMATS:
            said = f"a {kind} file" if kind else "not an image file"
            raise CalibrationError(
                f"{where}: {file.name}: {said}; calibration images are {', '.join(sorted(_FORMATS))}"
            )
        try:
            with images.opened(data, kind, max_pixels, file.name) as image:
                converted = image.convert(_MODES[channels]).resize((width, height), Image.Resampling.BILINEAR)
                pixels[i] = np.asarray(converted).reshape(height, width, channels)
        except images.ImageTooLargeError as e:
            raise too_large(where, e) from None
        except Exception as e:  # Pillow raises many types for files that are not images it reads
            raise CalibrationError(f"{where}: {file.name}: cannot read it as an image ({e})") from None
    laid = pixels.transpose(0, 3, 1, 2) if nchw else pixels
    raw = spec.datatype.numpy.kind == "u" or manifest.normalize is not None
    values = laid.astype(spec.datatype.numpy) if raw else laid.astype(np.float32) / 255.0
    scale = "pixel values 0..255" if raw else "pixel values / 255"
    mode = re.sub("^L$", "grey", _MODES[channels])
    source = f"images from {folder} ({len(files)} files, {mode} {width}x{height}, {scale})"
    return Samples({spec.name: np.ascontiguousarray(values.astype(spec.datatype.numpy))}, source)


def _photos(folder: Path, manifest: Manifest, where: str, max_pixels: int) -> Samples:
    """A folder of photos for a model with an image section: each decoded and transformed as a request's is."""
    assert manifest.image is not None
    files = photo_files(folder)
    if not files:
        raise CalibrationError(f"{where}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    spec = next(t for t in manifest.inputs if t.name == manifest.image.feeds)
    try:
        pixels = images.decode_all([f.read_bytes() for f in files], manifest.image, max_pixels, [f.name for f in files])
    except images.ImageTooLargeError as e:
        raise too_large(where, e) from None
    except images.ImageError as e:
        raise CalibrationError(f"{where}: {e}") from None
    source = f"images from {folder} ({len(files)} files, through the manifest's image section as requests are)"
    return Samples({spec.name: pixels.astype(spec.datatype.numpy)}, source)
