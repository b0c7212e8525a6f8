"""The model store: safe checkpoint loading and writing (the manifests themselves: :mod:`halfserve.manifest`; the
store's folders and files: :mod:`halfserve.storage`).

Layout::

    <store>/<name>/config.json          the manifest (validated by :class:`Manifest`)
    <store>/<name>/<version>/model.safetensors

The highest version is served unless the manifest (or the caller) pins one. Loading never runs code from a file:
weights come from safetensors, and architectures are looked up by name in :mod:`halfserve.models`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_tensors
from torch import nn

from halfserve import models
from halfserve.manifest import Manifest, load_manifest
from halfserve.storage import (
    MANIFEST,
    MAX_JSON_BYTES,
    WEIGHTS,
    StoreError,
    check_name,
    created_mode,
    next_version,
    read_json,
    readable_path,
    resolve_version,
)

__all__ = [
    "HF_ATTENTION_KEYS",
    "HF_REMOTE_CODE",
    "LoadedModel",
    "build",
    "check_architecture",
    "damaged",
    "from_weights_bytes",
    "key_mismatch",
    "load",
    "load_folder",
    "load_weights",
    "manifest_bytes",
    "nonfinite_buffer",
    "nonfinite_parameter",
    "save",
    "weights_bytes",
    "write_manifest",
    "write_weights",
]


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint read from the store: fp32 weights on the host, ready to be cast and moved by an engine."""

    manifest: Manifest
    version: int
    module: nn.Module
    path: Path


def load(root: Path, name: str, version: int | None = None) -> LoadedModel:
    """Load model ``name`` (the served version unless ``version`` is given) with fp32 weights on the CPU."""
    model_dir = root / check_name(name)
    manifest = load_manifest(model_dir)
    v = resolve_version(model_dir, version if version is not None else manifest.version)
    return load_folder(model_dir, manifest, model_dir / str(v), v)


def load_folder(model_dir: Path, manifest: Manifest, version_dir: Path, version: int) -> LoadedModel:
    """``manifest``'s model with the weights in ``version_dir``: a version folder, or the folder an import writes
    before it becomes one (:mod:`halfserve.importer`)."""
    path = version_dir / WEIGHTS
    module = build(model_dir, manifest, version_dir)
    try:
        with readable_path(path) as readable:
            state = load_file(readable, device="cpu")
    except FileNotFoundError:
        raise StoreError(f"{path}: checkpoint not found") from None
    except StoreError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise StoreError(f"{path}: cannot read safetensors checkpoint ({e})") from None
    load_weights(module, state, path, manifest.architecture)
    if (why := damaged(module)) is not None:
        raise StoreError(f"{path}: {why}")
    return LoadedModel(manifest=manifest, version=version, module=module.float().eval(), path=path)


def nonfinite_parameter(module: nn.Module) -> str | None:
    """The name of ``module``'s first floating parameter holding a NaN or an infinity, or None. Parameters only: a
    buffer may hold ``-inf`` by design (an attention mask)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.is_floating_point() and not bool(torch.isfinite(param).all()):
                return name
    return None


def damaged(module: nn.Module) -> str | None:
    """Why ``module``'s weights cannot give a finite answer (a parameter or buffer that holds NaN where none may:
    :func:`nonfinite_parameter`, :func:`nonfinite_buffer`), or None."""
    for kind, bad in (("parameter", nonfinite_parameter(module)), ("buffer", nonfinite_buffer(module))):
        if bad is not None:
            return (
                f"{kind} {bad!r} holds NaN or infinite values: the checkpoint is damaged (a training run that "
                "diverged?), and every answer would be NaN"
            )
    return None


RUNNING_STATISTICS = ("running_mean", "running_var")
"""A normalization layer's buffers, finite in any model that trained: an infinity there is damage, as in a weight."""


def nonfinite_buffer(module: nn.Module) -> str | None:
    """The name of ``module``'s first floating buffer holding a NaN (no design puts one there: a BatchNorm's
    ``running_var`` of a diverged run), or a running statistic (:data:`RUNNING_STATISTICS`) holding an infinity, or
    None. An infinity in another buffer may be by design (an attention mask's ``-inf``)."""
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if not buffer.is_floating_point():
                continue
            statistic = name.rpartition(".")[2] in RUNNING_STATISTICS
            if bool(torch.isnan(buffer).any()) or (statistic and not bool(torch.isfinite(buffer).all())):
                return name
    return None


def weights_bytes(module: nn.Module) -> bytes:
    """``module``'s weights as safetensors bytes, floating ones in fp32, each tensor its own copy (tied weights
    included): how an instance process gets exactly the weights this process loaded (:func:`from_weights_bytes`)."""
    state = {k: v.detach().float() if v.is_floating_point() else v.detach() for k, v in module.state_dict().items()}
    # A fresh row-major copy each: safetensors takes neither channels_last weights nor tensors sharing storage.
    return save_tensors({k: v.clone(memory_format=torch.contiguous_format) for k, v in state.items()})


def from_weights_bytes(
    root: Path, manifest: Manifest, version: int, data: bytes, hf_config: dict[str, Any] | None = None
) -> LoadedModel:
    """The model of ``manifest`` (as this process serves it) with the weights :func:`weights_bytes` wrote: no code runs
    from them, and the store's checkpoint is not read again (it may have changed since it was loaded); nor is a Hugging
    Face model's config.json, given as loaded (``hf_config``)."""
    model_dir = root / check_name(manifest.name)
    vdir = model_dir / str(version)
    module = build(model_dir, manifest, vdir, hf_config)
    load_weights(module, load_tensors(data), vdir / WEIGHTS, manifest.architecture)
    return LoadedModel(manifest=manifest, version=version, module=module.float().eval(), path=vdir / WEIGHTS)


HF_REMOTE_CODE = ("auto_map",)
"""config.json keys by which a Hugging Face model asks for code from its folder or the hub: refused."""
HF_ARCH_KWARGS: dict[str, tuple[str, ...]] = {"attn_implementation": ("eager", "sdpa")}
"""The ``arch_kwargs`` a ``transformers:`` model may pass to ``from_config``, each with the values it may take.
Anything else is refused: ``from_config`` hands its keyword arguments to the model's code and to transformers'
loaders (an ``attn_implementation`` naming a hub repository downloads and runs compiled kernels)."""


HF_ATTENTION_KEYS = ("attn_implementation", "_attn_implementation")
"""config.json keys naming the attention code transformers runs: held to ``arch_kwargs``' allow-list, since a hub
repository named there is downloaded and run as compiled kernels."""


def _check_attention(config_path: Path, config: dict[str, Any]) -> None:
    """Refuse an attention implementation in ``config`` (or a sub-model's config within it, such as ``text_config``)
    other than the allowed ones or ``null``. A stack, not recursion: the parser takes deeper nesting."""
    allowed = HF_ARCH_KWARGS["attn_implementation"]
    stack: list[tuple[str, dict[str, Any]]] = [("", config)]
    while stack:
        where, block = stack.pop()
        for key, value in block.items():
            if key in HF_ATTENTION_KEYS and value is not None and value not in allowed:
                raise StoreError(
                    f"{config_path}: {where}{key}: {value!r} is refused; use one of {list(allowed)} or leave it out"
                )
            if isinstance(value, dict):
                stack.append((f"{where}{key}.", value))


def build(model_dir: Path, manifest: Manifest, version_dir: Path, hf_config: dict[str, Any] | None = None) -> nn.Module:
    """A fresh ``nn.Module`` of the manifest's architecture (random weights); errors name the manifest's field. A
    Hugging Face model is built from ``hf_config`` when given, else from its folder's config.json."""
    where = model_dir / MANIFEST
    if manifest.architecture.startswith(models.TRANSFORMERS):
        return _hugging_face(where, manifest, version_dir, hf_config)
    try:
        factory = models.resolve(manifest.architecture)
    except models.UnknownArchitectureError as e:
        raise StoreError(f"{where}: architecture: {e}") from None
    try:
        module = factory(**manifest.arch_kwargs)
    except TypeError as e:
        raise StoreError(f"{where}: arch_kwargs: {e}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the factory is code: whatever it raises (SystemExit too) fails this model alone
        raise StoreError(
            f"{where}: architecture: {manifest.architecture!r} failed to build: {type(e).__name__}: {e}"
        ) from None
    try:
        return models.check_module(module, manifest.architecture)
    except models.UnknownArchitectureError as e:
        raise StoreError(f"{where}: architecture: {e}") from None


def _hugging_face(where: Path, manifest: Manifest, version_dir: Path, handed: dict[str, Any] | None) -> nn.Module:
    """A Hugging Face model from its folder's config.json: local files only, no remote code, weights (loaded after)
    from model.safetensors only."""
    auto_class = manifest.architecture.removeprefix(models.TRANSFORMERS)
    if "trust_remote_code" in manifest.arch_kwargs:
        raise StoreError(
            f"{where}: arch_kwargs: trust_remote_code is refused: it runs Python code shipped with the model folder"
        )
    for key, value in manifest.arch_kwargs.items():
        allowed = HF_ARCH_KWARGS.get(key)
        if allowed is None:
            raise StoreError(
                f"{where}: arch_kwargs: {key!r} is refused for a {models.TRANSFORMERS} model; it takes only "
                f"{sorted(HF_ARCH_KWARGS)} (the model's own settings come from its config.json)"
            )
        if value not in allowed:
            raise StoreError(f"{where}: arch_kwargs: {key}: {value!r} is refused; use one of {list(allowed)}")
    config_path = version_dir / "config.json"
    if handed is None and not (version_dir / WEIGHTS).is_file():
        pickles = sorted(p.name for p in version_dir.glob("*.bin")) if version_dir.is_dir() else []
        if pickles:
            raise StoreError(
                f"{version_dir / pickles[0]}: PyTorch pickle weights are refused (unpickling can run code); save the "
                f"model with save_pretrained(folder, safe_serialization=True) to get {WEIGHTS}"
            )
    try:
        config_json = handed if handed is not None else read_json(config_path)
    except FileNotFoundError:
        raise StoreError(
            f"{config_path}: a {manifest.architecture!r} version folder needs the model's config.json"
        ) from None
    if not isinstance(config_json, dict):
        raise StoreError(f"{config_path}: expected a JSON object, found {type(config_json).__name__}")
    remote = [k for k in HF_REMOTE_CODE if k in config_json]
    if remote:
        raise StoreError(
            f"{config_path}: {remote[0]}: the model asks for custom code (trust_remote_code), which is refused; "
            "serve it as a 'package.module:factory' architecture from --code-path instead"
        )
    _check_attention(config_path, config_json)
    models.broken_torchvision()  # a torchvision that cannot import is hidden, so transformers goes on without it
    try:
        import transformers  # noqa: PLC0415
    except ModuleNotFoundError:
        raise StoreError(
            f"{where}: architecture: transformers is not installed (pip install 'halfserve[hf]')"
        ) from None
    except Exception as e:  # installed, but it (or what it imports) fails
        raise StoreError(f"{where}: architecture: transformers does not import: {type(e).__name__}: {e}") from None
    cls = getattr(transformers, auto_class, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise StoreError(f"{where}: architecture: transformers has no auto class {auto_class!r} with from_config")
    try:
        if handed is not None:  # as the server process loaded it: the folder's may have changed since
            config = transformers.AutoConfig.for_model(**handed)
        else:
            config = transformers.AutoConfig.from_pretrained(str(version_dir), local_files_only=True)
        module = cls.from_config(config, **manifest.arch_kwargs)
    except (ValueError, TypeError, OSError, KeyError) as e:
        raise StoreError(f"{config_path}: {auto_class} cannot build this model: {e}") from None
    except (ImportError, RuntimeError) as e:  # the model's code, imported lazily by transformers, fails to import
        raise StoreError(f"{config_path}: {auto_class}: transformers cannot import this model's code: {e}") from None
    except Exception as e:  # anything else the model's code raises fails this model's load, named, not the server
        raise StoreError(f"{config_path}: {auto_class} cannot build this model: {type(e).__name__}: {e}") from None
    return models.check_module(module, manifest.architecture)


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:5])
    return shown + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


def key_mismatch(expected: dict[str, Any], found: set[str]) -> str | None:
    """What a checkpoint's tensor names lack or have beyond a module's state dict (``expected``, name to tensor), or
    ``None`` when they fit. ``expected`` holds the module's parameters themselves (``state_dict(keep_vars=True)``):
    a name the checkpoint lacks is fine when its parameter is one the checkpoint has under another name (tied weights,
    such as an output layer sharing the embedding's, which Hugging Face saves once)."""
    missing = sorted(k for k in expected if k not in found)
    if missing:
        present = {id(expected[k]) for k in expected if k in found}  # tied: one Parameter under two names
        missing = [k for k in missing if id(expected[k]) not in present]
    unexpected = sorted(found - set(expected))
    if not missing and not unexpected:
        return None
    parts = []
    if missing:
        parts.append(f"missing: {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected: {_listed(unexpected)}")
    return "; ".join(parts)


def load_weights(module: nn.Module, state: dict[str, Any], path: Path, architecture: str) -> None:
    """Load ``state`` into ``module`` strictly, naming the first missing and unexpected tensors when they differ."""
    mismatch = key_mismatch(module.state_dict(keep_vars=True), set(state))
    if mismatch:
        raise StoreError(f"{path}: checkpoint does not fit architecture {architecture!r}: {mismatch}")
    try:
        module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False)
    except RuntimeError as e:  # the names fit; a shape does not
        raise StoreError(f"{path}: checkpoint does not fit architecture {architecture!r}: {e}") from None
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()


def check_architecture(model_dir: Path, manifest: Manifest, version: int) -> None:
    """Before serving: build the architecture on the meta device (no memory, no weights) and compare its tensor names
    with the checkpoint's (read from its header alone), so a missing module, a factory that builds no model or a
    checkpoint that does not fit is named at start-up, before the port binds. A checkpoint that is missing or cannot
    be read fails that model's load alone, later, as a damaged file on a running server would."""
    vdir = model_dir / str(version)
    path = vdir / WEIGHTS
    with torch.device("meta"):
        module = build(model_dir, manifest, vdir)
    try:
        with readable_path(path) as readable, safe_open(readable, framework="pt") as f:
            found = set(f.keys())
    except StoreError:  # not a regular file: opening it by name could block start-up for ever
        raise
    except Exception:  # a missing or unreadable checkpoint fails that model's load alone, as it always has
        return
    mismatch = key_mismatch(module.state_dict(keep_vars=True), found)
    if mismatch:
        raise StoreError(f"{path}: checkpoint does not fit architecture {manifest.architecture!r}: {mismatch}")


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.fchmod(fd, created_mode())  # mkstemp's file is owner-only
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def manifest_bytes(manifest: Manifest) -> bytes:
    """``manifest`` as its ``config.json`` holds it; a :class:`StoreError` where that is past what the store reads
    (:data:`~halfserve.storage.MAX_JSON_BYTES`), so that nothing writes a manifest the server then refuses."""
    data = (manifest.model_dump_json(indent=2, exclude_none=True) + "\n").encode()
    if len(data) > MAX_JSON_BYTES:
        raise StoreError(
            f"{manifest.name}: its {MANIFEST} would be {len(data)} bytes, over the {MAX_JSON_BYTES}-byte limit on a "
            "model folder's JSON files (thousands of labels?)"
        )
    return data


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """Write ``<root>/<name>/config.json`` (atomically)."""
    data = manifest_bytes(manifest)
    model_dir = root / check_name(manifest.name)
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / MANIFEST
    atomic_write(path, data)
    return path


def save(root: Path, manifest: Manifest, module: nn.Module, version: int | None = None) -> Path:
    """Save ``module``'s weights as a new version of ``manifest.name`` (next number unless given) and the manifest.

    Returns the version folder. Weights are stored in fp32 whatever the module's dtype, so any precision can be
    served from them.
    """
    model_dir = root / check_name(manifest.name)
    model_dir.mkdir(parents=True, exist_ok=True)
    if version is None:
        while True:  # a number of its own, though another run saves beside this one
            version = next_version(model_dir)
            vdir = model_dir / str(version)
            try:
                vdir.mkdir()
                break
            except FileExistsError:
                continue
    else:
        vdir = model_dir / str(version)
        vdir.mkdir(parents=True, exist_ok=True)
    write_weights(vdir, module, {"name": manifest.name, "version": str(version)})
    write_manifest(root, manifest)
    return vdir


def write_weights(version_dir: Path, module: nn.Module, metadata: dict[str, str]) -> Path:
    """Write ``module``'s weights, floating ones in fp32, as ``version_dir``'s checkpoint."""
    state = {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in module.state_dict().items()
    }
    weights = version_dir / WEIGHTS
    save_file(state, str(weights), metadata=metadata)
    weights.chmod(created_mode())  # safetensors creates the file owner-only
    return weights
