"""What ``halfserve import``'s flags say, read into the manifest's fields: tensors (``--input``, ``--output``) and
their layout (``--input-format``), JSON objects (``--arch-kwargs``, ``--fidelity``, ``--answer``), the labels
(``--labels``) and the image section (``--image`` and ``--image-*``); each refusal names its flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from halfserve.imageinput import ImagePreset
from halfserve.importer import ImportFailure
from halfserve.manifest import DataType, InputFormat, TensorSpec
from halfserve.manifest import describe as describe_invalid


def parse_tensor(text: str, option: str) -> TensorSpec:
    """``NAME:DTYPE:SHAPE`` (``image:FP32:3x224x224``; DTYPE may be left out for FP32: ``features:64``); an output's
    SHAPE may be empty (``value:FP32:``): one value per row, a tensor of shape ``[B]``."""
    parts = text.split(":")
    expected = "expected NAME:DTYPE:SHAPE, e.g. image:FP32:3x224x224"
    if len(parts) == 2:
        if parts[1].upper() in DataType.__members__:
            raise ImportFailure(f"{option} {text!r}: no shape after the dtype; {expected}")
        parts = [parts[0], "FP32", parts[1]]
    if len(parts) != 3:
        raise ImportFailure(f"{option} {text!r}: {expected}")
    name, dtype, shape = parts
    if dtype.upper() not in DataType.__members__:
        names = ", ".join(DataType.__members__)
        raise ImportFailure(f"{option} {text!r}: dtype {dtype!r}: expected one of {names}")
    sizes = shape.lower().split("x") if shape.strip() else []  # nothing: one value per row (an output's shape [])
    if not sizes and option == "--input":
        raise ImportFailure(f"{option} {text!r}: no shape; an input has sizes joined by x, e.g. 3x224x224")
    # -1 first: a variable length (give --max-length)
    if not all(d.strip().removeprefix("-").isascii() and d.strip().removeprefix("-").isdigit() for d in sizes):
        also = " (or nothing for one value per row, e.g. value:FP32:)" if option == "--output" else ""
        raise ImportFailure(f"{option} {text!r}: shape {shape!r}: expected sizes joined by x, e.g. 3x224x224{also}")
    try:
        return TensorSpec(name=name, datatype=DataType(dtype.upper()), shape=[int(d) for d in sizes])
    except ValidationError as e:
        raise ImportFailure(f"{option} {text!r}: {describe_invalid(e)}") from None
    except ValueError as e:
        raise ImportFailure(f"{option} {text!r}: {e}") from None


def with_format(inputs: list[TensorSpec], text: str) -> list[TensorSpec]:
    """``inputs`` with the image layout ``text`` (``NCHW``, ``NHWC`` or ``NONE``) on those of three dimensions."""
    try:
        layout = InputFormat.parse(text)
    except ValueError as e:
        raise ImportFailure(f"--input-format: {e}") from None
    images = [t.name for t in inputs if len(t.shape) == 3 and not t.variable]
    if not images:
        shapes = ", ".join(f"{t.name} {t.shape}" for t in inputs)
        raise ImportFailure(f"--input-format: no input has three fixed dimensions (an image): {shapes}")
    return [TensorSpec.model_validate({**t.model_dump(), "format": layout}) if t.name in images else t for t in inputs]


def parse_json_object(text: str | None, option: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ImportFailure(f"{option}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ImportFailure(f"{option}: expected a JSON object, got {type(value).__name__}")
    return value


def read_labels(path: Path) -> list[str]:
    """``--labels``: a text file of class names (one per line), or TorchServe's ``index_to_name.json``, an object of
    class index to its name (``{"0": "tench"}``) or to ``[id, name]`` (``{"0": ["n01440764", "tench"]}``, the name
    last, as TorchServe's handlers read it)."""
    if path.suffix.lower() != ".json":
        return path.read_text().split()
    where = f"--labels {path}"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ImportFailure(f"{where}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not data:
        raise ImportFailure(f'{where}: expected an object of class index to name, e.g. {{"0": "tench"}}')
    names: dict[int, str] = {}
    for key, value in data.items():
        if not (key.isascii() and key.isdigit()):
            raise ImportFailure(f"{where}: key {key!r} is not a class index (0, 1, ...)")
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            value = value[-1]
        if not isinstance(value, str):
            raise ImportFailure(f'{where}: class {key}: expected a name or ["id", "name"], got {value!r}')
        names[int(key)] = value
    missing = sorted(set(range(len(names))) - set(names))
    if missing:
        raise ImportFailure(f"{where}: classes 0 to {len(names) - 1} each need a name; missing {missing[:5]}")
    return [names[i] for i in range(len(names))]


def image_section(
    name: str,
    inputs: list[TensorSpec],
    preset: str | None = None,
    **given: str | None,
) -> dict[str, Any]:
    """The manifest's ``image`` section of ``halfserve import --image NAME``: ``preset``'s transforms (if any), with
    the ``--image-*`` flags given (``given``, unparsed; None where not given) over them; it feeds the model's one
    input. Checked against that input by the manifest."""
    if len(inputs) != 1:
        raise ImportFailure("--image: images feed a model with one input")
    if name == inputs[0].name:
        raise ImportFailure(
            f"--image {name}: {name!r} is also the tensor input's name (--input); photos and the tensor they feed need "
            "a name each: give another to --image or to --input"
        )
    section: dict[str, Any] = {"input": name, "feeds": inputs[0].name}
    if preset is not None:
        try:
            section |= ImagePreset(preset).transforms
        except ValueError:
            choices = ", ".join(p.value for p in ImagePreset)
            raise ImportFailure(f"--image-preset {preset!r}: expected one of {choices}") from None
    for field, text in given.items():
        if text is None:
            continue
        option = f"--image-{field}"
        if field in ("resize", "crop"):
            section[field] = _size(text, option)
        elif field in ("mean", "std"):
            section[field] = [_number(v, option) for v in text.split(",")]
        elif field == "scale":
            section[field] = _number(text, option)
        elif field == "draft":
            if text not in ("on", "off", "auto"):
                raise ImportFailure(f"{option} {text!r}: expected auto (measured on the calibration photos), on or off")
            if text != "auto":  # auto leaves it out: the import measures it
                section[field] = text == "on"
        else:
            section[field] = text
    return section


def _size(text: str, option: str) -> int | list[int]:
    """``256`` (the shorter side, or a square crop) or ``HEIGHTxWIDTH``."""
    parts = text.lower().split("x")
    if len(parts) in (1, 2) and all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        sizes = [int(p) for p in parts]
        return sizes[0] if len(sizes) == 1 else sizes
    raise ImportFailure(f"{option} {text!r}: expected a size (256) or HEIGHTxWIDTH (224x224)")


def _number(text: str, option: str) -> float:
    try:
        if "/" in text:  # 1/255, as the scale is usually written
            top, bottom = text.split("/")
            return float(top) / float(bottom)
        return float(text)
    except (ValueError, ZeroDivisionError):
        raise ImportFailure(f"{option} {text!r}: expected a number (or a fraction such as 1/255)") from None
