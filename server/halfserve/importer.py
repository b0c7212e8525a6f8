"""``halfserve import``: turn the weights a team has into a model store entry.

Sources: a ``.pt``/``.pth`` state dict (read with ``torch.load(weights_only=True)``: tensors and plain containers only,
never code; ``{"state_dict": ...}`` and ``{"model": ...}`` wrappers are unwrapped and DataParallel's ``module.``
prefixes stripped), a ``.safetensors`` file, or a Hugging Face model folder (``config.json`` + ``model.safetensors``).

The architecture is built and the weights loaded strictly; the output signature comes from one fp32 forward on the
declared input shape, or where given is checked against it (:mod:`halfserve.outputcheck`); a text model's tokenizer is
copied from beside the weights; calibration samples (given, else random inputs of the declared shape) are stored
with the version and run in fp32 and in the half precision, and the agreement is printed and recorded in the
manifest's ``evaluation``. The version is written as the next one, with its manifest.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from torch import nn

from halfserve import (
    calibration,
    derivedoutputs,
    draftcheck,
    fidelity,
    handlers,
    mixed,
    models,
    outputcheck,
    padding,
    precision,
    precision_record,
    storage,
    store,
    text,
)
from halfserve.calibration import Samples
from halfserve.engine.core import Engine
from halfserve.manifest import DataType, InputFormat, Manifest, Normalize, Precision, TensorSpec, sent_inputs
from halfserve.manifest import describe as describe_invalid
from halfserve.settings import MAX_IMAGE_PIXELS
from halfserve.storage import Stage, StoreError

RANDOM_SAMPLES = calibration.RANDOM_SAMPLES
FULL_MODEL = (
    "{path}: holds a pickled model object, not a state dict. Unpickling it could run any code, so it is refused. "
    "Where the model is defined, save its weights instead: torch.save(model.state_dict(), 'weights.pth'), and import "
    "that file with --architecture naming the code that builds the model."
)


class ImportFailure(StoreError):
    """A source that cannot become a store entry; the message names the file or option and the reason."""


def sequence_inputs(
    inputs: list[TensorSpec], max_length: int | None, mask: str | None, truncate: bool = False
) -> list[TensorSpec]:
    """``inputs`` with ``max_length`` (and ``truncate``: longer requests cut, not refused) on the variable ones, and
    the attention mask input named ``mask`` (built by the server for the first variable input) after them."""
    variable = [t for t in inputs if t.variable]
    if variable and max_length is None:
        raise ImportFailure(f"--input {variable[0].name!r} has a variable length (-1): give --max-length")
    if truncate and not variable:
        raise ImportFailure("--truncate needs an --input with a variable length (-1)")
    out = [t.model_copy(update={"max_length": max_length, "truncate": truncate}) if t.variable else t for t in inputs]
    if mask is not None:
        if not variable:
            raise ImportFailure("--mask needs an --input with a variable length (-1)")
        out.append(TensorSpec(name=mask, datatype=DataType.INT64, shape=[-1], mask_for=variable[0].name))
    return out


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a ``.pt``/``.pth`` file (safely) or a ``.safetensors`` file, unwrapped and unprefixed."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ImportFailure(f"{path}: cannot read safetensors file ({e})") from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only load failed" in str(e):
            raise ImportFailure(FULL_MODEL.format(path=path)) from None
        raise ImportFailure(f"{path}: not a PyTorch state dict ({e})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ImportFailure(f"{path}: cannot read it as a PyTorch file ({e})") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if isinstance(obj, dict) and not obj:
        raise ImportFailure(f"{path}: an empty state dict (no tensors); save the model's state_dict() after training")
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ImportFailure(f"{path}: expected a state dict (names to tensors), found {type(obj).__name__}")
    if all(k.startswith("module.") for k in obj):  # saved from DataParallel / DistributedDataParallel
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


def _forward(module: nn.Module, inputs: list[TensorSpec], normalize: Normalize | None = None, rows: int = 2) -> object:
    """What the fp32 model returns for ``rows`` rows of zeros of ``inputs`` (:func:`halfserve.outputcheck.forward`)."""
    try:
        return outputcheck.forward(module, inputs, normalize, rows)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # the declared inputs do not fit the model
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ImportFailure(
            f"--input {_listed(inputs)}: the model's forward fails on rows of it ({reason}); {_first_layer(module)}"
        ) from None


def _listed(specs: list[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.datatype.value} {t.shape}" for t in specs)


def check_outputs(module: nn.Module, manifest: Manifest) -> None:
    """An :class:`ImportFailure` naming ``--output`` where the model's forward does not return ``manifest``'s outputs
    as declared (how many, each one's shape per row, floating or integer: :mod:`halfserve.outputcheck`)."""
    y = _forward(module, manifest.inputs, manifest.normalize)
    reason = outputcheck.mismatch(y, manifest)
    if reason is not None:
        raise ImportFailure(
            f"--output {_listed(manifest.outputs)}: {reason}; the model's forward returns {outputcheck.returned(y)} "
            f"(for {outputcheck.ROWS} rows); declare what it returns, or leave --output out to derive it"
        )


def derive_outputs(module: nn.Module, inputs: list[TensorSpec]) -> tuple[list[TensorSpec], list[str]]:
    """The outputs from one fp32 forward of two rows of zeros, and what the forward returns that they leave out, each
    with why (:mod:`halfserve.derivedoutputs`)."""
    try:
        return derivedoutputs.derive(_forward(module, inputs))
    except derivedoutputs.NothingServableError as e:
        raise ImportFailure(f"{e}; return one row per input row, or give its outputs with --output") from None


def _first_layer(module: nn.Module) -> str:
    """What the model's first layer with weights takes per sample, to set beside a declared ``--input`` shape."""
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            spatial = ", ".join(["N"] * (len(layer.kernel_size)))
            takes = f"[{layer.in_channels}, {spatial}] per sample (channels, then size)"
        elif isinstance(layer, nn.Linear):
            takes = f"[..., {layer.in_features}] per sample"
        elif isinstance(layer, nn.Embedding):
            takes = f"integer ids below {layer.num_embeddings} (an INT64 input)"
        else:
            continue
        return f"its first layer, {name} ({type(layer).__name__}), takes {takes}"
    return "give --input as the model's forward takes it"


@dataclass
class Imported:
    version_dir: Path
    manifest: Manifest
    samples_from: str
    fidelity: fidelity.Fidelity | None
    padding: padding.PaddingCheck | None = None
    shortfall: str | None = None
    """Why the server will serve this model in fp32 (it falls below its fidelity bar); ``None``: it will not."""
    record: precision_record.PrecisionRecord | None = None
    """The version's precision record, written as its ``precision.json``."""
    mixed: mixed.Outcome | None = None
    """The search for a mixed-precision plan, where the model falls below its bar."""
    dropped: list[str] = dataclasses.field(default_factory=list)
    """What the forward returned that the derived outputs leave out, each with why (clients will not get it)."""


def import_model(
    source: Path,
    root: Path,
    name: str,
    architecture: str,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec] | None = None,
    arch_kwargs: dict[str, Any] | None = None,
    labels: list[str] | None = None,
    calibration: Path | None = None,
    samples: int = RANDOM_SAMPLES,
    device: torch.device | None = None,
    strict: bool = False,
    extra_files: Mapping[str, Path] | None = None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    index_labels: bool = False,
    **manifest_fields: Any,
) -> Imported:
    """Write ``source``'s weights as the next version of ``name`` in the store at ``root`` (see the module), with
    ``extra_files`` (a ``.mar``'s, by their path in the version's folder) beside them. A calibration photo is held to
    ``max_image_pixels``, as a request's is.

    With ``strict``, a model below its fidelity bar is an :class:`ImportFailure`, and nothing is left written."""
    arch_kwargs = arch_kwargs or {}
    if source.is_dir() and not architecture.startswith(models.TRANSFORMERS):
        raise ImportFailure(_folder_needs_transformers(source, architecture))
    # An image input's layout is written as derived, so the manifest shows what the model config reports to clients.
    inputs = [t if t.format is not None else t.model_copy(update={"format": _derived(t)}) for t in inputs]
    hugging_face = architecture.startswith(models.TRANSFORMERS)
    folder = source if hugging_face else source.parent
    if hugging_face != source.is_dir():
        want = "a Hugging Face model folder" if hugging_face else "a .pt, .pth or .safetensors file"
        raise ImportFailure(f"{source}: architecture {architecture!r} imports from {want}")
    # The manifest's fields are checked before anything is built or written; the answer's, once the outputs are known.
    answer = manifest_fields.pop("answer", None)
    draft = _manifest(
        {
            "name": name,
            "architecture": architecture,
            "arch_kwargs": arch_kwargs,
            "inputs": inputs,
            "outputs": outputs or [TensorSpec(name="output", shape=[2])],  # a stand-in until derived
            **manifest_fields,
        }
    )
    model_dir = root / storage.check_name(name)
    tokenizer = _tokenizer(folder, draft)
    if hugging_face:
        if not (auto := architecture.removeprefix(models.TRANSFORMERS)).startswith("Auto"):
            raise ImportFailure(_auto_class_needed(source, auto))
        module = store.build(model_dir, draft, source)
        state = read_state_dict(source / storage.WEIGHTS) if (source / storage.WEIGHTS).is_file() else {}
        store.load_weights(module, state, source / storage.WEIGHTS, architecture)
    else:
        try:  # named here, before the store's manifest (not written yet) could be named as the culprit
            models.resolve(architecture)
        except models.UnknownArchitectureError as e:
            raise ImportFailure(f"--architecture: {e}") from None
        module = store.build(model_dir, draft, source.parent)
        store.load_weights(module, read_state_dict(source), source, architecture)
    if (why := store.damaged(module)) is not None:  # named as the file given, before anything is written
        raise ImportFailure(f"{source}: {why}")
    module = module.float().eval()
    if draft.handler is not None:  # built once here, so a handler that cannot be built is refused before writing
        try:
            handlers.build_within(draft.handler, (), name, folder, draft.batching.max_batch_size, max_image_pixels)
        except handlers.HandlerLoadError as e:
            raise ImportFailure(f"--handler: {e}") from None
    if outputs:
        check_outputs(module, draft)
    dropped: list[str] = []
    if not outputs:
        outputs, dropped = derive_outputs(module, inputs)
    one = _forward(module, inputs, draft.normalize, 1)
    if (reason := outputcheck.mismatch(one, draft.model_copy(update={"outputs": outputs}), 1)) is not None:
        raise ImportFailure(f"{reason}; its forward returns {outputcheck.returned(one, 1)}: {outputcheck.ONE_ROW}")
    if hugging_face and labels is None:
        labels = hugging_face_labels(source, outputs[0])
    if index_labels and labels is None and len(outputs) == 1 and len(shape := outputs[0].shape) == 1 and shape[0] > 0:
        labels = [str(i) for i in range(shape[0])]  # each class by its index, as TorchServe names it without a mapping
    manifest = _manifest(
        {**draft.model_dump(exclude_none=True), "outputs": outputs, "labels": labels, "answer": answer}
    )
    if draft.image is not None and "draft" not in draft.image.model_fields_set:  # measured unless the section says
        manifest = draftcheck.chosen(store.LoadedModel(manifest, 0, module, source), calibration, max_image_pixels)
    try:
        store.manifest_bytes(manifest)  # before the work: the version it would write could never be served
    except StoreError as e:
        raise ImportFailure(str(e)) from None
    given = _samples(calibration, manifest, module, samples, folder, max_image_pixels)
    # Checked before anything is written: a refused model leaves no version behind.
    unsaved = store.LoadedModel(manifest, 0, module, source)
    try:
        padded = padding.check(unsaved, given)
    except (StoreError, RuntimeError, ValueError, IndexError) as e:
        raise ImportFailure(f"the model fails on its calibration samples ({given.source}): {e}") from None
    if padded is not None and not padded.invariant and not padded.accepted:
        raise ImportFailure(f"{source}: {padding.reason(padded, unsaved)}")
    stage = Stage.open(model_dir)
    try:
        if hugging_face:
            _copy_files(source, stage.path, manifest)
        else:
            store.write_weights(stage.path, module, {"name": manifest.name})
            if tokenizer is not None and tokenizer.name not in (extra_files or {}):  # an archive's comes with it
                shutil.copyfile(tokenizer, stage.path / tokenizer.name)
        given.save(stage.path)
        on = device or precision.default_device()
        held_to = fidelity.bar(manifest)
        record, plan = None, None
        measured: fidelity.Fidelity | None
        shortfall: str | None
        try:
            measured, loaded, rows = _measure(model_dir, manifest, stage.path, on)
        except fidelity.UnanswerableError as e:
            raise ImportFailure(f"{source}: {e.reason}") from None
        except fidelity.HalfForwardError as e:  # nothing measured, so no record: a load finds it so again
            measured, shortfall = None, _unrunnable(str(e), held_to, strict, model_dir)
        else:
            assert measured is not None
            half = Precision(measured.precision)
            under = precision_record.conditions(stage.path, manifest, half, held_to, precision.device_kind(on))
            record = precision_record.measured(under, measured)
            precision_record.write(stage.path, record)
            shortfall = fidelity.shortfall(measured, held_to) if held_to.check else None
            if shortfall is not None and strict:
                raise ImportFailure(
                    f"--strict: below the fidelity bar: {shortfall}; nothing was written to {model_dir}"
                )
            if shortfall is not None:
                batch = min(64, fidelity.RANDOM_SAMPLES)
                plan = mixed.find(loaded, half, on, held_to, mixed.IMPORT_LIMIT_S, batch, None, (), rows)
                if plan.plan is not None:  # stored with the version: a load measures it again rather than searching
                    record = dataclasses.replace(record, fp32_modules=list(plan.plan.modules))
                    precision_record.write(stage.path, record)
        _copy_extra(extra_files or {}, stage.path)
        vdir = stage.install()
    except BaseException:
        stage.discard()  # a refused or failed import leaves no version behind, and no model folder it created
        raise
    if measured is not None:
        half = Precision(measured.precision)
        evaluation = {
            "calibration_samples": measured.samples,
            f"{half.value}_top1_agreement": measured.top1_agreement,
            f"{half.value}_max_abs_error": measured.max_abs_error,
            f"{half.value}_max_rel_error": measured.max_rel_error,
            f"{half.value}_min_cosine": measured.min_cosine,
        }
        manifest = manifest.model_copy(update={"evaluation": evaluation})
    # After the version is in place: killed in between, the store holds the new version under the old manifest, and
    # the server passes over a version that does not load for the one before it.
    store.write_manifest(root, manifest)
    return Imported(vdir, manifest, given.source, measured, padded, shortfall, record, plan, dropped)


def _unrunnable(reason: str, held_to: fidelity.Bar, strict: bool, model_dir: Path) -> str:
    """Why the server will serve in fp32 a model whose half-precision forward raises (``reason``), or an
    :class:`ImportFailure` where it would not serve it at all (its check off) or ``strict`` refuses it."""
    if not held_to.check:
        raise ImportFailure(
            f"{reason}; its fidelity check is off, so the server would serve it in that precision alone and its load "
            f"would fail: leave the check on to have it served in fp32; nothing was written to {model_dir}"
        )
    if strict:
        raise ImportFailure(f"--strict: {reason}; nothing was written to {model_dir}")
    return reason


def _tokenizer(folder: Path, manifest: Manifest) -> Path | None:
    """A text model's tokenizer file, beside its weights (in a Hugging Face model's folder), which the import copies
    into the version; an :class:`ImportFailure` naming it and the fix where it is not there, is not a regular file or
    does not read as a tokenizer (the version would fail its load)."""
    if manifest.text is None:
        return None
    path = folder / manifest.text.tokenizer
    where = f"--text {manifest.text.input}: {path}"
    if not path.exists() and not path.is_symlink():
        raise ImportFailure(
            f"{where}: not found; a text model is served with the {path.name} beside its weights, which the import "
            f"copies into the version: put the model's tokenizer there"
        )
    if path.is_symlink():  # copied, it would be the linked file's bytes, whatever it is
        raise ImportFailure(f"{where}: a symbolic link; put the tokenizer file itself there")
    try:
        text.encoder_at(path, manifest)  # read as the server will read it: a file that does not is refused now
    except text.TextError as e:
        raise ImportFailure(f"--text {manifest.text.input}: {e}") from None
    return path


def _samples(
    path: Path | None, manifest: Manifest, module: nn.Module, count: int, folder: Path, max_pixels: int
) -> Samples:
    """The calibration samples: read from ``path`` (texts tokenized with the tokenizer in ``folder``, the weights',
    photos held to ``max_pixels``), else random."""
    if path is None:
        return calibration.random_samples(sent_inputs(manifest), count, calibration.int_range(module))
    tokenizer = folder / manifest.text.tokenizer if manifest.text is not None else None
    return calibration.read(path, manifest, tokenizer, max_pixels)


GENERIC_LABEL = re.compile(r"LABEL_\d+")
"""The names transformers gives classes it was not told the names of."""


def hugging_face_labels(folder: Path, output: TensorSpec) -> list[str] | None:
    """The class names in a Hugging Face folder's ``config.json`` (``id2label``), one per value of ``output``'s last
    dimension; ``None`` where it has none, they are the generic ``LABEL_0``, ``LABEL_1``..., or they do not fit."""
    try:
        id2label = json.loads((folder / "config.json").read_text()).get("id2label")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(id2label, dict):
        return None
    try:
        by_id = {int(k): v for k, v in id2label.items()}
    except (TypeError, ValueError):
        return None
    if not output.shape:  # one value per row: no classes to name
        return None
    classes = output.shape[-1]
    if sorted(by_id) != list(range(classes)) or not all(isinstance(v, str) and v for v in by_id.values()):
        return None
    labels = [by_id[i] for i in range(classes)]
    if all(GENERIC_LABEL.fullmatch(label) for label in labels):
        return None
    return labels


def _manifest(fields: dict[str, Any]) -> Manifest:
    """The manifest of ``fields``, or an :class:`ImportFailure` naming each wrong field on one line."""
    try:
        return Manifest.model_validate(fields)
    except ValidationError as e:
        raise ImportFailure(f"manifest: {describe_invalid(e)}") from None


def _folder_needs_transformers(source: Path, architecture: str) -> str:
    """Why ``architecture`` cannot import the folder ``source``, and the ``transformers:`` architecture that can: the
    auto class of the model's task, read from its config.json (``BertForSequenceClassification`` is
    ``AutoModelForSequenceClassification``)."""
    if not (source / "config.json").is_file():
        return (
            f"{source}: a folder imports as a Hugging Face model folder (config.json and {storage.WEIGHTS}) with "
            "--architecture transformers:<AutoClass>; for a state dict, give its .pt, .pth or .safetensors file"
        )
    try:
        declared = json.loads((source / "config.json").read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        declared = []
    task = next((c.partition("For")[2] for c in declared if isinstance(c, str) and "For" in c), "")
    auto = f"AutoModelFor{task}" if task else "AutoModel"
    return (
        f"{source}: --architecture {architecture!r} cannot build a Hugging Face model folder: use "
        f"--architecture transformers:{auto}"
        + (f" (its config.json declares {declared[0]})" if declared and isinstance(declared[0], str) else "")
        + ". An architecture is 'transformers:<AutoClass>' for such a folder, or for a state dict file "
        "a registered name, 'package.module:factory' or 'torchvision:<builder>'"
    )


def _auto_class_needed(source: Path, named: str) -> str:
    """Why ``transformers:<named>``, a model class rather than an auto class, cannot build ``source``, and the auto
    class that can (its task's: ``BertForSequenceClassification`` is ``AutoModelForSequenceClassification``)."""
    task = named.partition("For")[2]
    return (
        f"--architecture transformers:{named}: a Hugging Face folder is built by the auto class of its task, from its "
        f"config.json; use --architecture transformers:{f'AutoModelFor{task}' if task else 'AutoModel'}"
    )


def _derived(spec: TensorSpec) -> InputFormat | None:
    layout = spec.image_format
    return None if layout is InputFormat.NONE else layout


def _copy_files(source: Path, version_dir: Path, manifest: Manifest) -> None:
    """A Hugging Face folder's config, weights and tokenizer into the folder of the version being imported."""
    files = ["config.json", storage.WEIGHTS]
    if manifest.text is not None:
        files.append(manifest.text.tokenizer)
    for file in files:
        if not (source / file).is_file():
            raise ImportFailure(f"{source / file}: not found (the model folder needs it)")
        shutil.copyfile(source / file, version_dir / file)


def _copy_extra(files: Mapping[str, Path], version_dir: Path) -> None:
    """A ``.mar``'s extra files into the version's folder, last, so that one named as a file the store writes is
    refused rather than written over."""
    for name, path in files.items():
        target = version_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with path.open("rb") as src, target.open("xb") as dst:
                shutil.copyfileobj(src, dst)
        except FileExistsError:
            raise ImportFailure(f"the archive's extra file {name} has the name of a file the store writes") from None


def _measure(
    model_dir: Path, manifest: Manifest, version_dir: Path, device: torch.device
) -> tuple[fidelity.Fidelity, store.LoadedModel, fidelity.Samples]:
    """The staged version's half precision against fp32 on its samples, with the version and samples read for it
    (a mixed-precision search reuses them)."""
    loaded = store.load_folder(model_dir, manifest, version_dir, 0)
    samples = fidelity.samples(loaded)
    # The precision the server would serve in there; where that is fp32 (auto on a CPU without native bf16), the
    # half precision it would take elsewhere, so the figure is there when the model moves.
    half = precision.resolve(loaded.manifest.precision, device)
    if half is Precision.FP32:
        half = Precision.FP16 if device.type == "cuda" else Precision.BF16
    engine = Engine(loaded, half, device)
    try:
        measured = fidelity.measure(engine, loaded, samples.rows, min(64, len(samples.rows)), samples.source)
    finally:
        engine.close()
    return measured, loaded, samples


def _figures(f: fidelity.Fidelity) -> str:
    shown = [f"top-1 agreement {f.top1_agreement:.4f}"] if f.top1_agreement is not None else []
    if f.min_cosine is not None:
        shown.append(f"lowest cosine similarity {f.min_cosine:.6f}")
    if f.max_rel_error is not None:
        shown.append(f"max rel error {f.max_rel_error:.4g}")
    return ", ".join([*shown, f"max abs error {f.max_abs_error:.4g}"])


def describe(result: Imported) -> str:
    m = result.manifest
    lines = [
        f"imported {m.name} v{result.version_dir.name} into {result.version_dir}",
        f"  architecture {m.architecture}",
        "  inputs  " + ", ".join(f"{t.name} {t.datatype.value} {t.shape}" for t in m.inputs),
        "  outputs " + ", ".join(f"{t.name} {t.datatype.value} {t.shape}" for t in m.outputs),
        f"  calibration: {result.samples_from}, stored as {fidelity.CALIBRATION}",
    ]
    if m.image is not None:
        i = m.image
        lines.insert(
            3,
            f"  images  {i.input!r} (JPEG, PNG, WebP) -> {i.feeds}: {i.mode.value}, resize {i.resize}, crop {i.crop}, "
            f"scale {i.scale:.6g}, mean {i.mean}, std {i.std}, {i.layout.value}",
        )
        chose = i.draft_check.detail if i.draft_check is not None else f"{'on' if i.draft else 'off'} (given)"
        lines.insert(4, f"  JPEG draft {chose}")
    if m.handler is not None:
        lines.insert(3, f"  handler {m.handler.code} on /predictions (time limit {m.handler.timeout_s:g} s)")
    if result.dropped:
        lines.append(
            "  WARNING: returned by the forward but not served (clients will not get it): " + "; ".join(result.dropped)
        )
    f = result.fidelity
    if f is None and result.shortfall is not None:
        lines.append(f"  WARNING: {result.shortfall}: the server serves it in fp32")
    if f is None:
        return "\n".join(lines)
    lines.append(f"  {f.precision} vs fp32 on {f.samples} {f.source} samples: {_figures(f)}")
    held_to = fidelity.bar(m)
    if not held_to.check:
        lines.append('  fidelity bar: off (the manifest\'s "fidelity": {"check": false})')
    elif result.shortfall is None and f.source == fidelity.Source.RANDOM.value:
        lines.append(
            f"  fidelity bar ({held_to.describe()}): met on {f.samples} random samples, not your data (give "
            f"--calibration FILE to measure on real inputs), so the server serves it in {f.precision}"
        )
    elif result.shortfall is None:
        lines.append(f"  fidelity bar ({held_to.describe()}): met, so the server serves it in {f.precision}")
    else:
        lines += [
            f"  WARNING: below the fidelity bar: {result.shortfall}.",
            *mixed.said(result.mixed, f.precision, _figures),
            "  halfserve import --strict refuses such a model instead.",
        ]
        if f.source == fidelity.Source.RANDOM.value:
            lines.append(
                "  Those were random samples, not your data: give --calibration FILE to measure on real inputs."
            )
    r = result.record
    if r is not None:
        device = r.device
        on = (
            device["name"]
            if device["capability"] is None
            else f"{device['name']} (compute capability {device['capability']})"
        )
        lines.append(
            f"  precision record: {precision_record.RECORD}, {r.precision} measured on {on} with torch {r.torch} at "
            f"{r.measured_at}; a load under the same conditions trusts it instead of measuring"
        )
    p = result.padding
    if p is not None:
        lines.append(
            f"  padding: a sample alone and padded to {p.padded_to} differ by {p.max_rel_diff:.3g} of the output "
            f"(tolerance {p.tolerance:g}, {p.samples} samples in fp32)"
            + ("" if p.invariant else ": ANSWERS CHANGE WITH PADDING, accepted by --accept-padding-variance")
        )
    return "\n".join(lines)
