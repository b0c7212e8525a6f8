"""Manifests: what a model takes and returns, and how it is served; torch-free.

A model's manifest is ``<store>/<name>/config.json``, validated by :class:`Manifest`; the tensor specs, datatypes
and precision names it uses are here too. Nothing here imports torch, so the routes, the front-end processes and the
gRPC service read manifests without it. A batch's rows as records are :mod:`halfserve.packing`'s; the store's folders
and files :mod:`halfserve.storage`'s; checkpoints, architectures and weights :mod:`halfserve.store`'s.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from halfserve.answershapes import AnswerSection
from halfserve.execution import Batching, Compile, Execution
from halfserve.handlerinput import HandlerSection
from halfserve.imageinput import ImageInput
from halfserve.storage import MANIFEST, NAME_PATTERN, StoreError, read_json


class Precision(str, Enum):
    """How a model's forward runs."""

    FP16 = "fp16"
    """``model.half()``; inputs cast to float16."""
    BF16 = "bf16"
    """``model.to(torch.bfloat16)``; inputs cast to bfloat16."""
    AUTOCAST = "autocast"
    """fp32 weights, forward under ``torch.autocast`` (fp16 on CUDA, bf16 on CPU): for models that need fp32 islands."""
    FP32 = "fp32"
    """The fallback switch: full precision."""
    AUTO = "auto"
    """fp16 on CUDA; bf16 on a CPU with native bf16; fp32 otherwise."""

    def __str__(self) -> str:
        return self.value


log = logging.getLogger(__name__)

MAX_TENSORS = 16
"""Inputs or outputs a model may declare."""
TENSOR_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
"""What an input or output may be called."""
MAX_SAMPLE_VALUES = 2**28
"""Most values one sample of a tensor may hold (1 GiB in fp32; a 3x8192x8192 image is 201 million): a shape past it
is a typing slip (``30x30x30x30x30x30``, 729 million) whose probe forward at import would allocate gigabytes."""


class DataType(str, Enum):
    """The KServe V2 protocol's tensor datatypes that carry numbers: what requests may send, and (those in
    :data:`SERVED_TYPES`) what a manifest may declare. ``BYTES`` strings feed no input; they leave only as the
    classification extension's answer."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    FP64 = "FP64"
    INT64 = "INT64"
    INT32 = "INT32"
    INT16 = "INT16"
    INT8 = "INT8"
    UINT64 = "UINT64"
    UINT32 = "UINT32"
    UINT16 = "UINT16"
    UINT8 = "UINT8"
    BOOL = "BOOL"

    @property
    def numpy(self) -> np.dtype[Any]:
        """The host dtype a tensor of this type is batched as, the same for requests and warm-up: its own, but BF16
        (no numpy dtype), which travels as float32 and is cast on the device."""
        return np.dtype(np.float32) if self is DataType.BF16 else self.wire_dtype.newbyteorder("=")

    @property
    def wire_dtype(self) -> np.dtype[Any]:
        """The little-endian numpy dtype of one element on the wire (BF16 travels as its 16 raw bits)."""
        return _WIRE[self]

    @property
    def is_float(self) -> bool:
        return self in (DataType.FP16, DataType.FP32, DataType.FP64, DataType.BF16)

    @property
    def is_integer(self) -> bool:
        return self.wire_dtype.kind in "iu" and self is not DataType.BF16


_WIRE: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype("?"),
    DataType.UINT8: np.dtype("<u1"),
    DataType.UINT16: np.dtype("<u2"),
    DataType.UINT32: np.dtype("<u4"),
    DataType.UINT64: np.dtype("<u8"),
    DataType.INT8: np.dtype("<i1"),
    DataType.INT16: np.dtype("<i2"),
    DataType.INT32: np.dtype("<i4"),
    DataType.INT64: np.dtype("<i8"),
    DataType.FP16: np.dtype("<f2"),
    DataType.FP32: np.dtype("<f4"),
    DataType.FP64: np.dtype("<f8"),
    DataType.BF16: np.dtype("<u2"),
}

SERVED_TYPES = frozenset(
    {
        DataType.FP32,
        DataType.FP16,
        DataType.BF16,
        DataType.FP64,
        DataType.INT64,
        DataType.INT32,
        DataType.UINT8,
        DataType.BOOL,
    }
)
"""The datatypes a manifest may declare for an input or output (a request's other numeric types are converted to
them, within range)."""


class OverflowPolicy(str, Enum):
    """What serving does when a half-precision output is not finite for a finite input (fp16 overflows past 65504)."""

    RERUN_FP32 = "rerun_fp32"
    """Rerun those requests' rows in fp32 (the host keeps the fp32 weights); the response says ``fp32``."""
    ERROR = "error"
    """Fail those requests (500 naming the overflow); the batch's other requests are answered."""
    ALLOW = "allow"
    """Return the non-finite values (JSON writes them as ``null``; binary outputs carry them)."""


class InputFormat(str, Enum):
    """How an image input's per-sample dimensions are laid out, named as Triton's ``ModelInput.Format`` names it (its
    model configuration reports it; Triton's image clients read it to lay out the pixels they send)."""

    NONE = "FORMAT_NONE"
    """No image layout (or not an image)."""
    NHWC = "FORMAT_NHWC"
    """Height, width, channels (per sample, without the batch dimension)."""
    NCHW = "FORMAT_NCHW"
    """Channels, height, width: what torchvision's models take."""

    @classmethod
    def parse(cls, text: str) -> InputFormat:
        """``NCHW``, ``nhwc`` or ``FORMAT_NCHW`` as a format; ``ValueError`` naming the choices otherwise."""
        name = text.strip().upper().removeprefix("FORMAT_")
        if name not in cls.__members__:
            raise ValueError(f"{text!r} is not an input format; expected NCHW, NHWC or NONE")
        return cls[name]


IMAGE_CHANNELS = (1, 3, 4)
"""Channel counts an image has (grey, RGB, RGBA): a three-dimensional input with one of these first and not last
is read as NCHW, and last and not first as NHWC."""


class TensorSpec(BaseModel):
    """One input or output: its name, element type and per-sample shape (no batch dimension)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TENSOR_NAME)
    datatype: DataType = DataType.FP32
    shape: list[int]
    """Per sample. A first dimension of -1 is variable (a sequence length): requests of different lengths share a
    batch, padded to its longest with ``pad``. An output's may be empty, ``[]``: one value per row (a regression's
    value, a class index), which the model returns as a tensor of shape ``[B]``; an input has at least one
    dimension."""
    max_length: int | None = Field(default=None, ge=1, le=65536)
    """An input's longest variable dimension; longer requests are a 400, or cut to it with ``truncate``."""
    truncate: bool = False
    pad: float = 0.0
    """The value a variable input is padded with."""
    mask_for: str | None = None
    """This input is the attention mask of the named variable input: built by the server (1 where that input has a
    value, 0 where it was padded) in this input's datatype, never sent by clients."""
    format: InputFormat | None = None
    """An image input's layout (Triton's ``format``); unset, it is derived from the shape where that is unambiguous
    (:attr:`image_format`)."""

    @field_validator("datatype")
    @classmethod
    def _served(cls, datatype: DataType) -> DataType:
        if datatype not in SERVED_TYPES:
            served = ", ".join(t.value for t in DataType if t in SERVED_TYPES)
            raise ValueError(f"{datatype.value} is not a datatype a model may declare; one of {served}")
        return datatype

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: list[int]) -> list[int]:
        if shape and (any(d <= 0 for d in shape[1:]) or shape[0] == 0 or shape[0] < -1):
            raise ValueError(f"every dimension must be a positive integer (the first may be -1, variable), got {shape}")
        values = math.prod(d for d in shape if d > 0)
        if values > MAX_SAMPLE_VALUES:
            raise ValueError(
                f"{shape} is {values} values a sample, more than the {MAX_SAMPLE_VALUES} a tensor may hold (the "
                "import's and the load's probes would allocate them per row)"
            )
        return shape

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Written without the variable-length fields left at their defaults: a fixed tensor reads as before."""
        data: dict[str, Any] = handler(self)
        for key, default in (
            ("max_length", None),
            ("truncate", False),
            ("pad", 0.0),
            ("mask_for", None),
            ("format", None),
        ):
            if key in data and data[key] == default:
                del data[key]
        return data

    @model_validator(mode="after")
    def _image_shaped(self) -> TensorSpec:
        if self.format not in (None, InputFormat.NONE) and (len(self.shape) != 3 or self.variable):
            raise ValueError(
                f"format {self.format.value} needs three fixed per-sample dimensions (an image), got {self.shape}"
            )
        return self

    @property
    def variable(self) -> bool:
        """Whether its first per-sample dimension is variable."""
        return bool(self.shape) and self.shape[0] == -1

    @property
    def image_format(self) -> InputFormat:
        """Its ``format``, or where unset the layout its shape shows: three dimensions of a floating or ``UINT8``
        type, with an image's channel count (:data:`IMAGE_CHANNELS`) first and not last (NCHW) or last and not first
        (NHWC); any other shape, or one that could be either ([3, 3, 3]), is ``FORMAT_NONE``."""
        if self.format is not None:
            return self.format
        if len(self.shape) != 3 or self.variable or self.mask_for is not None or self.datatype.numpy.kind not in "fu":
            return InputFormat.NONE
        first, last = self.shape[0] in IMAGE_CHANNELS, self.shape[-1] in IMAGE_CHANNELS
        if first and not last:
            return InputFormat.NCHW
        if last and not first:
            return InputFormat.NHWC
        return InputFormat.NONE

    @property
    def wire_shape(self) -> list[int]:
        """Its per-row shape as the V2 protocol presents it (metadata, responses, the model configuration's ``dims``):
        ``[1]`` for one value per row (shape ``[]``), as Triton presents an output its model returns as ``[B]``
        (``dims: [1]`` with ``reshape: {shape: []}``: Triton's dims may not be empty)."""
        return list(self.shape) or [1]

    def bounded(self, length: int | None = None) -> list[int]:
        """The shape with the variable dimension at ``length`` (default: its ``max_length``)."""
        if not self.variable:
            return self.shape
        return [length or self.max_length or 1, *self.shape[1:]]


class Normalize(BaseModel):
    """Input normalisation run on the device, in fp32, before the model's cast: ``(x * scale - mean) / std``.

    ``mean`` and ``std`` hold one value per channel (the sample's first dimension). With a ``UINT8`` input, clients
    send images as bytes (a quarter of FP32's) and the server widens and normalises them where it is cheap.
    """

    model_config = ConfigDict(extra="forbid")

    scale: float = Field(default=1.0, gt=0.0)
    mean: list[float] | None = None
    std: list[float] | None = None

    @field_validator("std")
    @classmethod
    def _positive_std(cls, std: list[float] | None) -> list[float] | None:
        if std is not None and any(v <= 0 for v in std):
            raise ValueError(f"every std must be positive, got {std}")
        return std


class TextInput(BaseModel):
    """Text clients may send instead of a sequence input's token ids: tokenized by the server with the version's
    Hugging Face ``tokenizer.json`` (the ``tokenizers`` library: a JSON file, no code)."""

    model_config = ConfigDict(extra="forbid")

    input: str = Field(pattern=TENSOR_NAME)
    """The ``BYTES`` input's name: one UTF-8 text per row (V2), or ``/predict`` ``{"inputs": ["text", ...]}``."""
    feeds: str
    """The variable integer input the token ids go to (its ``max_length`` and ``truncate`` apply)."""
    tokenizer: str = Field(default="tokenizer.json", pattern=r"^[A-Za-z0-9_.-]+\.json$")
    """The tokenizer file in the version folder."""
    max_bytes: int = Field(default=65536, ge=1, le=2**24)
    """Longest text accepted, in UTF-8 bytes; longer is a 400 before tokenizing."""


class FidelityBar(BaseModel):
    """How close a model's half-precision outputs must come to its fp32 outputs at load to be served in half precision
    (:mod:`halfserve.fidelity`); a field left unset takes the server's default bar
    (:data:`halfserve.fidelity.DEFAULT_BAR`), so a later default applies to manifests written before it."""

    model_config = ConfigDict(extra="forbid")

    check: bool = True
    """Measure at load and serve in fp32 below the bar; off, the model is served in its half precision unmeasured."""
    min_top1_agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    """For the class scores (the first output when the manifest has labels, else the first floating output of one
    dimension of 2 or more): the share of samples whose top class is the same in both. 0: no bar on it."""
    min_cosine: float | None = Field(default=None, ge=-1.0, le=1.0)
    """For every other floating output with several values per row (embeddings, per-token outputs): the lowest cosine
    similarity of a row with its fp32 row. -1: no bar on it."""
    max_rel_error: float | None = Field(default=None, ge=0.0)
    """For floating outputs of one value per row (regression): the largest difference from fp32, relative to the
    output's largest fp32 magnitude on the samples."""


_EVALUATION_KEY = re.compile(r"[a-z0-9_]{1,64}")
_DEVICE = re.compile(r"[a-z0-9:_]{1,32}")


class Manifest(BaseModel):
    """A model's ``config.json``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    architecture: str
    """A registered name, ``package.module:factory``, ``torchvision:<builder>`` or ``transformers:<AutoClass>`` (see
    :mod:`halfserve.models`); its keyword arguments are ``arch_kwargs``.

    ``torch.export`` programs are not accepted: ``torch.export.load`` falls back to full unpickling
    (``weights_only=False``) when the safe load fails, so a crafted archive could run code.
    """
    arch_kwargs: dict[str, Any] = Field(default_factory=dict)
    inputs: list[TensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    """The forward's inputs. With one, it is passed positionally; with several, as keyword arguments named as here,
    or positionally in this order where ``forward`` takes ``*args`` and names none of them."""
    outputs: list[TensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    """What the forward returns: a tensor (one output), a tuple or list (in this order), or a mapping such as a
    Hugging Face ``ModelOutput`` (by name)."""
    labels: list[str] | None = None
    """Class names for the first output's last dimension."""
    text: TextInput | None = None
    image: ImageInput | None = None
    handler: HandlerSection | None = None
    answer: AnswerSection | None = None
    """``/predictions``' answer: TorchServe's detection or segmentation shape (:mod:`halfserve.answershapes`)."""
    precision: Precision = Precision.AUTO
    overflow: OverflowPolicy = OverflowPolicy.RERUN_FP32
    min_agreement: float | None = Field(default=None, gt=0.0, le=1.0)
    """Serve in fp32 instead when the half precision's top-1 agreement with fp32 on the version's calibration samples
    (:mod:`halfserve.fidelity`) is below this: the older spelling of ``fidelity.min_top1_agreement``."""
    fidelity: FidelityBar | None = None
    """The fidelity bar at load; unset, the server's default bar for every measure."""
    padding_invariant: bool = True
    """A model with a variable dimension must answer a sample alone as it does in a batch padded to a longer one
    (checked at import and at load, :mod:`halfserve.padding`); ``false`` serves one whose answers change with the
    batch's padding, with a warning, where it would be refused."""
    allow_nonfinite_inputs: bool = False
    """Accept NaN and infinite input values (only binary tensors can carry them); refused with a 400 otherwise."""
    normalize: Normalize | None = None
    batching: Batching = Field(default_factory=Batching)
    execution: Execution = Field(default_factory=Execution)
    version: int | None = Field(default=None, ge=1)
    """Pin a version; ``None`` serves the highest."""
    description: str = ""
    dataset: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    """What ``halfserve train`` measured: ``test_samples`` (an integer), ``device`` (a short name), and numbers (or
    null) under names such as ``fp16_accuracy``; shown on the status page, so nothing else is accepted."""

    @field_validator("evaluation")
    @classmethod
    def _evaluation(cls, block: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (block or {}).items():
            if not _EVALUATION_KEY.fullmatch(key):
                raise ValueError(f"evaluation: {key!r} is not a metric name (lower case, digits and _)")
            if key == "test_samples":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif key == "device":
                ok = isinstance(value, str) and _DEVICE.fullmatch(value) is not None
            else:
                ok = value is None or (isinstance(value, int | float) and not isinstance(value, bool))
            if not ok:
                raise ValueError(f"evaluation.{key}: unexpected value {value!r}")
        return block

    @field_validator("inputs")
    @classmethod
    def _input_shapes(cls, inputs: list[TensorSpec]) -> list[TensorSpec]:
        for t in inputs:
            if not t.shape:
                raise ValueError(f"{t.name!r}: shape [] (one value per row) is for outputs; an input has dimensions")
        return inputs

    @field_validator("architecture")
    @classmethod
    def _architecture(cls, name: str) -> str:
        # Its form only (what it names is imported when the model is built), and only where the architectures are
        # known: halfserve.models hands its check over when imported (check_architectures_with), which a front-end,
        # without torch, never does.
        return _architecture_check(name) if _architecture_check is not None else name

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        for field, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            names = [t.name for t in specs]
            if len(set(names)) != len(names):
                raise ValueError(f"{field}: names must be distinct, got {names}")
        if self.min_agreement is not None and not any(
            t.datatype.numpy.kind == "f" and math.prod(t.shape) > 1 for t in self.outputs
        ):
            raise ValueError("min_agreement needs a floating output with more than one value per row to rank")
        if self.min_agreement is not None and (self.fidelity and self.fidelity.min_top1_agreement) is not None:
            raise ValueError("min_agreement and fidelity.min_top1_agreement: give one (the first is the older name)")
        variable = [t for t in self.inputs if t.variable and t.mask_for is None]
        for t in self.inputs:
            if t.variable and t.mask_for is None and t.max_length is None:
                raise ValueError(f"inputs: {t.name!r} has a variable dimension (-1) and needs a max_length")
            if t.mask_for is not None:
                target = next((v for v in variable if v.name == t.mask_for), None)
                if target is None:
                    raise ValueError(f"inputs: {t.name!r}: mask_for {t.mask_for!r} names no variable input")
                if t.shape != [-1] or t.datatype.numpy.kind not in "iub":
                    raise ValueError(f"inputs: {t.name!r}: a mask has shape [-1] and an integer or BOOL datatype")
        if self.text is not None:
            target = next((t for t in variable if t.name == self.text.feeds), None)
            if target is None or target.datatype.numpy.kind not in "iu":
                raise ValueError(f"text.feeds: {self.text.feeds!r} names no variable integer input")
            if any(t.name == self.text.input for t in self.inputs):
                raise ValueError(f"text.input: {self.text.input!r} is also the name of a tensor input")
        if self.image is not None:
            self.image.check(self.inputs)
        if any(t.variable for t in self.outputs) and not variable:
            raise ValueError("outputs: a variable dimension (-1) needs an input with one")
        if variable and (self.normalize is not None or self.execution.compile is not Compile.NONE):
            raise ValueError("a model with variable dimensions runs eagerly: no normalize, execution.compile 'none'")
        if self.normalize is not None and len(self.inputs) > 1:
            raise ValueError("normalize applies to a model with one input")
        if self.normalize is not None and self.inputs[0].format is InputFormat.NHWC:
            raise ValueError("normalize takes channels first (the sample's first dimension): format FORMAT_NHWC")
        for t in self.outputs:
            if t.format is not None:
                raise ValueError(f"outputs: {t.name!r}: format applies to inputs")
        if self.execution.compile in (Compile.INDUCTOR, Compile.AOTI) and (
            len(self.inputs) > 1 or len(self.outputs) > 1
        ):
            raise ValueError(
                f"execution.compile {self.execution.compile.value!r} takes models with one input and one output"
            )
        if self.answer is not None and self.handler is not None:
            raise ValueError("answer and handler: a handler's postprocess answers /predictions itself; give one")
        if self.answer is not None:
            self.answer.check(self.outputs, self.labels)
        elif self.labels is not None and not self.outputs[0].shape:
            raise ValueError(
                f"labels name the classes of the first output's last dimension; {self.outputs[0].name!r} has one "
                "value per row (shape [])"
            )
        elif self.labels is not None and len(self.labels) != self.outputs[0].shape[-1]:
            raise ValueError(
                f"labels has {len(self.labels)} entries but the output's last dimension is {self.outputs[0].shape[-1]}"
            )
        if self.normalize is not None:
            channels = self.inputs[0].shape[0]
            for field, values in (("mean", self.normalize.mean), ("std", self.normalize.std)):
                if values is not None and len(values) != channels:
                    raise ValueError(
                        f"normalize.{field} has {len(values)} values but the input has {channels} channels "
                        "(its first dimension)"
                    )
        return self


def sample_values(manifest: Manifest) -> int:
    """Input values one row (sample) can hold, every input's together, variable ones at their ``max_length``."""
    return sum(math.prod(t.bounded()) for t in manifest.inputs)


def sent_inputs(manifest: Manifest) -> list[TensorSpec]:
    """The inputs clients send: all but the masks the server builds."""
    return [t for t in manifest.inputs if t.mask_for is None]


def bytes_input(manifest: Manifest) -> str | None:
    """The ``BYTES`` input clients may send instead of the tensor it feeds: a text model's texts or an image model's
    encoded photos, one per row; None for a model that takes neither."""
    section = manifest.text or manifest.image
    return section.input if section is not None else None


def describe(err: ValidationError) -> str:
    """A manifest's validation errors on one line, each as ``field: problem``."""
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(top level)"
        parts.append(f"{field}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def load_manifest(model_dir: Path) -> Manifest:
    """Read and validate ``<model_dir>/config.json``; errors name the file and the field."""
    path = model_dir / MANIFEST
    try:
        raw = read_json(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: manifest not found") from None
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        raise StoreError(f"{path}: {describe(e)}") from None
    except RecursionError:  # within the parser's depth, but past the validator's
        raise StoreError(f"{path}: nested too deeply") from None
    if manifest.name != model_dir.name:
        raise StoreError(f"{path}: name: {manifest.name!r} does not match its folder {model_dir.name!r}")
    return manifest


_architecture_check: Callable[[str], str] | None = None


def check_architectures_with(check: Callable[[str], str]) -> None:
    """Validate every manifest's ``architecture`` with ``check`` from now on (it returns the name or raises
    ``ValueError``): :mod:`halfserve.models` hands over its own when imported, so where models are built, an unknown
    architecture fails at validation, naming the field."""
    global _architecture_check
    _architecture_check = check
